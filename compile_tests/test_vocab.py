"""fa3_spec.eagle.vocab: two-stage reductions equal their one-stage torch ops,
alone, compiled, and inside the loop on a vocabulary wider than the blocks."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import fa3_spec
from fa3_spec.eagle import (
    PRESETS, EagleDraft, EagleEngine, EagleModels, LlamaTarget, LoopConfig, greedy_generate,
)
from fa3_spec.eagle.cli import workload
from fa3_spec.eagle.vocab import (
    TOPK_BLOCK, VOCAB_BLOCK, log_prob_topk, vocab_argmax, vocab_cumsum, vocab_exp_sum, vocab_topk,
)


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
    x[3, -1] = 100.0  # the maximum last: in the tail where V % block and V >= 2 * block
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
                                lambda x: vocab_cumsum(x, block=0),
                                lambda x: vocab_exp_sum(x, block=0)])
def test_a_bad_block_is_refused(fn):
    with pytest.raises(ValueError, match="block must be >= 1"):
        fn(torch.zeros(2, 10))


@pytest.mark.parametrize("fn", [vocab_argmax, vocab_exp_sum, lambda x: log_prob_topk(x, 2)])
def test_integer_logits_are_refused(fn):
    with pytest.raises(TypeError, match="floating-point"):
        fn(torch.zeros(2, 10, dtype=torch.int64))


def test_vocab_argmax_finds_the_first_maximum_across_blocks_and_tail():
    """Ties and NaNs on both sides of the boundary between the full blocks
    and the tail: the earlier entry wins, and a NaN beats any number."""
    x = torch.zeros(5, 7)  # block 2: blocks [0:2] [2:4] [4:6], tail [6]
    x[0, 3] = x[0, 6] = 5.0  # a tie: the block's entry comes first
    x[1, 6] = 5.0  # only the tail's
    x[2, 6] = float("nan")  # a NaN in the tail beats the blocks' numbers
    x[3, 1] = x[3, 6] = float("nan")  # NaN on both sides: the block's comes first
    x[4, 6] = float("-inf")  # the tail lower than every block
    assert vocab_argmax(x, block=2).tolist() == [3, 6, 6, 1, 0] == x.argmax(-1).tolist()


def _exp_sum_lse(x: torch.Tensor, block: int) -> torch.Tensor:
    shift, total = vocab_exp_sum(x, block=block)
    return shift + torch.log(total)


@pytest.mark.parametrize("v, block", [(7, 2), (64, 8), (1000, 64), (1000, 1000), (1001, 1000),
                                      (5, 8), (3000, VOCAB_BLOCK)])
def test_vocab_exp_sum_gives_the_logsumexp_with_its_infinities_and_nans(v, block):
    x = torch.randn(7, v, generator=torch.Generator().manual_seed(v), dtype=torch.float64) * 30
    x[1] = float("-inf")  # every entry -inf: -inf
    x[2, : v // 2] = float("-inf")  # whole blocks of -inf beside finite ones
    x[3, v // 3] = float("inf")  # +inf: +inf, not NaN
    x[4, -1] = float("nan")  # a NaN in the last entry (the tail, where V % block): NaN
    x[5, 0] = float("inf")
    x[5, -1] = float("-inf")
    got = _exp_sum_lse(x, block)
    assert got.shape == (7,) and got.dtype == torch.float64
    torch.testing.assert_close(got, torch.logsumexp(x, -1), rtol=1e-13, atol=1e-12, equal_nan=True)
    assert got[1] == float("-inf") and got[3] == float("inf") and got[5] == float("inf")
    assert bool(got[4].isnan()) and bool(got[[0, 2, 6]].isfinite().all())


def test_vocab_exp_sum_keeps_leading_dims_its_docstring_example_and_sums_bf16_in_float32():
    x = torch.randn(3, 4, 300, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_exp_sum_lse(x, 32), torch.logsumexp(x, -1))
    assert vocab_exp_sum(torch.zeros(0, 300), block=32)[1].shape == (0,)
    shift, total = vocab_exp_sum(torch.tensor([0.0, 0.0, 0.0, 0.0, math.log(4)]), block=2)
    torch.testing.assert_close((shift, total), (torch.tensor(math.log(4)), torch.tensor(2.0)))
    xb = x.bfloat16()
    shift, total = vocab_exp_sum(xb, block=32)
    assert shift.dtype == total.dtype == torch.float32
    torch.testing.assert_close(shift + total.log(), torch.logsumexp(xb.float(), -1))


def test_vocab_exp_sum_refuses_an_empty_vocabulary():
    with pytest.raises(ValueError, match="at least one entry"):
        vocab_exp_sum(torch.zeros(2, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_log_prob_topk_is_log_softmaxs_topk(dtype):
    """The ``k`` best log-probabilities, as ``log_softmax`` then ``topk`` give
    them, over a vocabulary of many blocks and a tail (indices compared by
    their logits: bf16's ties may pick other entries of a tied value)."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(2, 3, 3000, generator=g) * 4).to(dtype)
    vals, idx = log_prob_topk(logits, 8)
    ref = torch.log_softmax(logits.float(), -1).topk(8)
    assert vals.dtype == torch.float32 and idx.dtype == torch.int64 and vals.shape == (2, 3, 8)
    torch.testing.assert_close(vals, ref.values, rtol=0, atol=1e-5)
    assert torch.equal(logits.float().gather(-1, idx), logits.float().gather(-1, ref.indices))


def test_log_prob_topk_on_rows_of_infinities_and_nans():
    x = torch.randn(4, 3000, generator=torch.Generator().manual_seed(6))
    x[0, :2000] = float("-inf")  # whole blocks of -inf beside finite entries: as log_softmax
    x[1] = float("-inf")
    x[1, 2500] = -1e5  # the one finite entry, very negative, in the tail beside -inf blocks
    x[2, 5] = float("nan")
    x[3, 9] = float("inf")
    vals, idx = log_prob_topk(x, 4)
    ref = torch.log_softmax(x, -1)
    torch.testing.assert_close(vals[:2], ref[:2].topk(4).values, rtol=0, atol=1e-5)
    assert bool(vals[2].isnan().all())  # NaN spreads, as in log_softmax
    assert idx[3, 0] == 9 and bool(vals[3, 0].isnan()) and bool((vals[3, 1:] == -float("inf")).all())


@pytest.mark.parametrize("offset", [0.0, 1e3, 1e5])
def test_log_prob_topk_is_as_precise_as_log_softmax_on_large_logits(offset):
    """The shift is an entry of the row, as in ``log_softmax``: no precision
    is lost to a log-sum-exp rounded at the logits' magnitude."""
    x = torch.randn(4, 5000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x = (x * 3 + offset).float()
    exact = torch.log_softmax(x.double(), -1).topk(8).values
    vals, _ = log_prob_topk(x, 8)
    ours = (vals.double() - exact).abs().max()
    torchs = (torch.log_softmax(x, -1).topk(8).values.double() - exact).abs().max()
    assert ours <= 2 * torchs + 1e-6, (ours, torchs)


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
    fn = torch.compile(lambda t: (vocab_argmax(t), *vocab_topk(t, 8), *log_prob_topk(t, 8)),
                       backend=backend, fullgraph=True)
    v = 3000  # two stages each: 2 blocks of 1024 and a tail; 11 blocks of 256 (> k) and a tail
    assert v // VOCAB_BLOCK >= 2 and v // TOPK_BLOCK > 8 and v % TOPK_BLOCK
    for rows in (3, 5):  # [B, N, V] as the verify has it, B dynamic
        x = torch.randn(rows, 2, v, generator=torch.Generator().manual_seed(rows))
        torch._dynamo.mark_dynamic(x, 0)
        a, vals, idx, lp, lp_idx = fn(x)
        assert torch.equal(a, x.argmax(-1))
        ref_lp = torch.log_softmax(x, -1).topk(8)
        torch.testing.assert_close(lp, ref_lp.values)
        assert torch.equal(lp_idx, ref_lp.indices)
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
    eager, inductor, and a CUDA graph of the compiled call replayed on new data;
    the draft's top-k log-probabilities read the logits in their own dtype."""
    from fa3_spec.graphs import capture

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, generator=g, device="cuda").to(dtype)
    if dtype == torch.float32:
        x[0, ..., 7] = float("nan")  # a NaN wins both, as in torch

    def both(t):
        return (vocab_argmax(t), *vocab_topk(t.float(), 8), *log_prob_topk(t, 8))

    fn = torch.compile(both, backend="inductor", fullgraph=True)

    def check(t, got):
        a, vals, idx, lp, lp_idx = got
        ref = torch.topk(t.float(), 8)
        assert torch.equal(a, t.argmax(-1))
        torch.testing.assert_close(vals, ref.values, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(t.float().gather(-1, idx).nan_to_num(), vals.nan_to_num())
        ref_lp = torch.log_softmax(t.float(), -1)
        torch.testing.assert_close(lp, ref_lp.topk(8).values, rtol=0, atol=1e-5, equal_nan=True)
        torch.testing.assert_close(ref_lp.gather(-1, lp_idx), lp, rtol=0, atol=1e-5, equal_nan=True)

    check(x, both(x))
    check(x, fn(x))
    graph, out = capture(fn, x)
    x.copy_(torch.randn(shape, generator=g, device="cuda").to(dtype))
    graph.replay()
    check(x, out)
