"""fa3_spec.eagle.vocab: two-stage reductions equal their one-stage torch ops,
alone, compiled, and inside the loop on a vocabulary wider than the blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fa3_spec
from fa3_spec.eagle import (
    PRESETS, EagleDraft, EagleEngine, EagleModels, LlamaTarget, LoopConfig, greedy_generate,
)
from fa3_spec.eagle.cli import workload
from fa3_spec.eagle.vocab import TOPK_BLOCK, VOCAB_BLOCK, vocab_argmax, vocab_cumsum, vocab_topk


def _logits(rows: int, v: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # few distinct values: many ties, across and inside blocks
    return torch.randint(-6, 6, (rows, v), generator=g).to(dtype)


@pytest.mark.parametrize("v, block", [(7, 2), (64, 8), (1000, 64), (1000, 1000), (1001, 1000),
                                      (5, 8)])
def test_vocab_argmax_is_the_first_maximum(v, block):
    x = _logits(6, v, v)
    x[1] = float("-inf")  # all -inf: index 0
    x[2, v // 2] = float("nan")  # a NaN is the largest value
    x[3, -1] = 100.0  # the maximum in the padded last block
    x[4, 0] = float("inf")
    x[4, -1] = float("nan")  # NaN beats an earlier +inf, as for argmax
    got = vocab_argmax(x, block=block)
    assert torch.equal(got, x.argmax(-1)), (got, x.argmax(-1))
    assert got.dtype == torch.int64 and got.shape == (6,)


def test_vocab_argmax_keeps_leading_dims_and_bf16():
    x = _logits(12, 300, 3, torch.bfloat16).view(3, 4, 300)
    assert torch.equal(vocab_argmax(x, block=32), x.argmax(-1))
    for y in (_logits(1, 300, 4)[0], torch.zeros(0, 300)):  # [V] and no rows
        assert torch.equal(vocab_argmax(y, block=32), y.argmax(-1))


def test_vocab_argmax_docstring_example():
    assert vocab_argmax(torch.tensor([3.0, 1, 7, 7, 2]), block=2).item() == 2


@pytest.mark.parametrize("v, k, block", [(7, 2, 2), (7, 2, 3), (64, 4, 8), (1000, 8, 64),
                                         (1001, 3, 10), (1024, 8, 256), (300, 8, 4), (20, 8, 16),
                                         (9, 9, 4), (4096, 1, 16)])
def test_vocab_topk_has_topks_values_and_indices_of_those_values(v, k, block):
    x = torch.randn(5, v, generator=torch.Generator().manual_seed(v), dtype=torch.float64)
    x[1, : v // 2] = float("-inf")  # half the row
    x[3, : v - k + 1] = float("-inf")  # fewer finite entries than k: -inf ties are taken too
    x[2] = x[2].round()  # ties
    vals, idx = vocab_topk(x, k, block=block)
    ref_vals, ref_idx = torch.topk(x, k, dim=-1)
    assert torch.equal(vals, ref_vals)
    assert idx.dtype == torch.int64 and bool(((idx >= 0) & (idx < v)).all())
    assert torch.equal(x.gather(-1, idx), vals)  # every index holds its value
    for row in range(5):  # distinct entries (no index twice)
        assert len(set(idx[row].tolist())) == k
    assert torch.equal(idx[[0, 4]], ref_idx[[0, 4]])  # no ties there: the same indices


def test_vocab_topk_keeps_a_nan_as_the_largest_value():
    x = torch.randn(2, 3000, generator=torch.Generator().manual_seed(1))
    x[0, 5] = float("nan")
    x[1, 2999] = float("nan")  # in the tail
    vals, idx = vocab_topk(x, 2)
    assert bool(vals[:, 0].isnan().all()) and idx[:, 0].tolist() == [5, 2999]
    assert torch.equal(vals[:, 1], torch.topk(x, 2).values[:, 1])


@pytest.mark.parametrize("bad, error", [(0, ValueError), (11, ValueError), (-1, ValueError),
                                        (True, TypeError), (2.0, TypeError)])
def test_vocab_topk_refuses_a_k_outside_one_to_v(bad, error):
    with pytest.raises(error, match="k must be"):
        vocab_topk(torch.zeros(2, 10), bad)


@pytest.mark.parametrize("fn", [lambda x: vocab_argmax(x, block=0),
                                lambda x: vocab_topk(x, 2, block=-3),
                                lambda x: vocab_cumsum(x, block=0)])
def test_a_bad_block_is_refused(fn):
    with pytest.raises(ValueError, match="block must be >= 1"):
        fn(torch.zeros(2, 10))


def test_vocab_argmax_refuses_integer_logits():
    with pytest.raises(TypeError, match="floating-point"):
        vocab_argmax(torch.zeros(2, 10, dtype=torch.int64))


def test_vocab_topk_docstring_example():
    vals, idx = vocab_topk(torch.tensor([[5.0, 1, 4, 8, 2, 6, 3]]), 2, block=2)
    assert vals.tolist() == [[8.0, 6.0]] and idx.tolist() == [[3, 5]]


def test_vocab_topk_finds_winners_in_the_tail_and_in_blocks_of_equal_maxima():
    x = torch.zeros(1, 103)
    x[0, 5] = x[0, 15] = x[0, 25] = 1.0  # three blocks of maximum 1 (block 10), k = 2
    x[0, 101] = 2.0  # the tail (100..102) holds the best
    vals, idx = vocab_topk(x, 2, block=10)
    assert vals.tolist() == [[2.0, 1.0]] and idx[0, 0] == 101 and idx[0, 1] in (5, 15, 25)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_both_compile_fullgraph_with_a_dynamic_batch_and_match_torch(backend):
    torch._dynamo.reset()
    fn = torch.compile(lambda t: (vocab_argmax(t), *vocab_topk(t, 8)), backend=backend,
                       fullgraph=True)
    v = 3000  # two stages each: 2 blocks of 1024 and a tail; 11 blocks of 256 (> k) and a tail
    assert v // VOCAB_BLOCK >= 2 and v // TOPK_BLOCK > 8 and v % TOPK_BLOCK
    for rows in (3, 5):  # [B, N, V] as the verify has it, B dynamic
        x = torch.randn(rows, 2, v, generator=torch.Generator().manual_seed(rows))
        torch._dynamo.mark_dynamic(x, 0)
        a, vals, idx = fn(x)
        assert torch.equal(a, x.argmax(-1))
        ref_vals, ref_idx = torch.topk(x, 8)
        assert torch.equal(vals, ref_vals) and torch.equal(idx, ref_idx)


@pytest.mark.parametrize("v, block", [(1, 4), (4, 4), (7, 4), (8, 4), (9, 4), (2500, 1024), (3, 1024)])
def test_vocab_cumsum_is_the_cumsum_in_two_short_scans(v, block):
    x = torch.rand(2, 3, v, dtype=torch.float64, generator=torch.Generator().manual_seed(v))
    got = vocab_cumsum(x, block=block)
    assert got.shape == x.shape
    torch.testing.assert_close(got, torch.cumsum(x, -1), rtol=1e-13, atol=1e-12)
    compiled = torch.compile(lambda t: vocab_cumsum(t, block=block), backend="aot_eager",
                             fullgraph=True)(x)
    torch.testing.assert_close(compiled, got, rtol=0, atol=0)


def _wide_models():
    shape = dataclasses.replace(PRESETS["tiny"], vocab_size=3000)
    target = LlamaTarget.random(shape, seed=0, dtype=torch.float64)
    for w in target.layers[1:]:  # as make_models' derived draft: layer 0 dominates
        w.wo.mul_(0.05)
        w.w_down.mul_(0.05)
    return EagleModels(target, EagleDraft.derived(target, seed=1))


def _wide_engine(models):
    spec = fa3_spec.SpecConfig(page_size=2, topk=8, num_steps=5, num_draft_tokens=8,
                               max_bs=4, max_context_len=30 + 24 + 8)
    spec = dataclasses.replace(spec, num_pages=spec.pool_pages(8, LoopConfig.draft_attention))
    return EagleEngine(LoopConfig(spec, max_new_tokens=24, attention_backend="torch"), models,
                       max_reqs=8)


def test_the_loop_on_a_vocabulary_wider_than_the_blocks_equals_greedy():
    """The tiny preset's 512 tokens take the one-stage paths; 3000 takes both
    two-stage ones (verify argmax over 3 blocks of 1024, draft top-8 over 11
    blocks of 256 and a tail). Their compiled trace, with a dynamic batch and
    the verify's ``[B, N, V]``, is tested above."""
    assert 3000 > 2 * VOCAB_BLOCK and 3000 // TOPK_BLOCK > 8
    models = _wide_models()
    prompts, news = workload(6, page_size=2, max_prompt=30, max_new=24, vocab=3000, seed=4,
                             min_new=16)
    eng = _wide_engine(models)
    ids = [eng.submit(p, m) for p, m in zip(prompts, news)]
    out = eng.run()
    assert [out[i] for i in ids] == greedy_generate(models, prompts, news, page_size=2,
                                                    attention_backend="torch")
    assert eng.stats.mean_accept_len > 1.5  # drafts accepted: the top-k path chose real tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape, dtype", [((1, 128256), torch.bfloat16),
                                          ((8, 128256), torch.float32),
                                          ((3, 16, 128256), torch.bfloat16)])
def test_on_cuda_compiled_and_captured_both_match_torch(shape, dtype):
    """The two-stage paths at the vocabulary the GPU runs (llama3's 128256):
    eager, inductor, and a CUDA graph of the compiled call replayed on new data."""
    from fa3_spec.graphs import capture

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, generator=g, device="cuda").to(dtype)
    if dtype == torch.float32:
        x[0, ..., 7] = float("nan")  # a NaN wins both, as in torch
    fn = torch.compile(lambda t: (vocab_argmax(t), *vocab_topk(t.float(), 8)), backend="inductor",
                       fullgraph=True)

    def check(t, got):
        a, vals, idx = got
        ref = torch.topk(t.float(), 8)
        assert torch.equal(a, t.argmax(-1))
        torch.testing.assert_close(vals, ref.values, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(t.float().gather(-1, idx).nan_to_num(), vals.nan_to_num())

    check(x, (vocab_argmax(x), *vocab_topk(x.float(), 8)))
    check(x, fn(x))
    graph, out = capture(fn, x)
    x.copy_(torch.randn(shape, generator=g, device="cuda").to(dtype))
    graph.replay()
    check(x, out)
