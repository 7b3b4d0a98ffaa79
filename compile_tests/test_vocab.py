"""fa3_spec.eagle.vocab: two-stage reductions equal their one-stage torch ops."""

from __future__ import annotations

import pytest
import torch

from fa3_spec.eagle.vocab import vocab_argmax, vocab_topk


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
    got = vocab_argmax(x, block=block)
    assert torch.equal(got, x.argmax(-1)), (got, x.argmax(-1))
    assert got.dtype == torch.int64 and got.shape == (6,)


def test_vocab_argmax_keeps_leading_dims_and_bf16():
    x = _logits(12, 300, 3, torch.bfloat16).view(3, 4, 300)
    assert torch.equal(vocab_argmax(x, block=32), x.argmax(-1))


@pytest.mark.parametrize("v, k, block", [(7, 2, 2), (7, 2, 3), (64, 4, 8), (1000, 8, 64),
                                         (1001, 3, 10), (1024, 8, 256), (300, 8, 4), (20, 8, 16),
                                         (9, 9, 4), (4096, 1, 16)])
def test_vocab_topk_has_topks_values_and_indices_of_those_values(v, k, block):
    x = torch.randn(5, v, generator=torch.Generator().manual_seed(v), dtype=torch.float64)
    x[1, : v // 2] = float("-inf")  # fewer finite entries than may be needed
    x[2] = x[2].round()  # ties
    vals, idx = vocab_topk(x, k, block=block)
    ref_vals, ref_idx = torch.topk(x, k, dim=-1)
    assert torch.equal(vals, ref_vals)
    assert idx.dtype == torch.int64 and bool(((idx >= 0) & (idx < v)).all())
    assert torch.equal(x.gather(-1, idx), vals)  # every index holds its value
    for row in range(5):  # distinct entries (no index twice)
        assert len(set(idx[row].tolist())) == k
    distinct = torch.tensor([len(set(r.tolist())) == v for r in x[[0, 3, 4]]])
    if bool(distinct.all()):  # no ties: the same indices as torch.topk
        assert torch.equal(idx[[0, 3, 4]], ref_idx[[0, 3, 4]])


@pytest.mark.parametrize("bad", [0, 11, -1, True, 2.0])
def test_vocab_topk_refuses_a_k_outside_one_to_v(bad):
    with pytest.raises(ValueError, match="k must be an int in"):
        vocab_topk(torch.zeros(2, 10), bad)


@pytest.mark.parametrize("fn", [lambda x: vocab_argmax(x, block=0),
                                lambda x: vocab_topk(x, 2, block=-3)])
def test_a_bad_block_is_refused(fn):
    with pytest.raises(ValueError, match="block must be an int >= 1"):
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


def test_both_compile_fullgraph_and_match_eager():
    x = torch.randn(3, 2000, generator=torch.Generator().manual_seed(0))
    fn = torch.compile(lambda t: (vocab_argmax(t, block=128), *vocab_topk(t, 8, block=128)),
                       backend="aot_eager", fullgraph=True)
    a, vals, idx = fn(x)
    assert torch.equal(a, x.argmax(-1))
    ref_vals, ref_idx = torch.topk(x, 8)
    assert torch.equal(vals, ref_vals) and torch.equal(idx, ref_idx)
