"""fa3_spec.eagle.ranking: pairwise ranks give exactly a stable descending sort's order."""

from __future__ import annotations

import pytest
import torch

from fa3_spec.eagle.ranking import descending_ranks, top_index_set, top_indices


def _scores(rows: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 3, (rows, length), generator=g).float()  # many ties
    x[0, ::3] = float("nan")  # NaNs among numbers: first, by index
    x[1] = float("-inf")
    x[2, ::2] = float("inf")
    x[3] = float("nan")
    return x


@pytest.mark.parametrize("length, k", [(264, 15), (64, 8), (5, 5), (1, 1), (7, 1)])
def test_top_indices_and_set_equal_the_stable_sorts(length, k):
    x = _scores(40, length, length)
    ref = torch.sort(x, dim=-1, descending=True, stable=True).indices
    assert torch.equal(descending_ranks(x), torch.argsort(ref, dim=-1))
    got = top_indices(x, k)
    assert got.dtype == torch.int64 and torch.equal(got, ref[:, :k])
    assert torch.equal(top_index_set(x, k), torch.sort(ref[:, :k], dim=-1).values)


def test_leading_dims_and_half_precision():
    x = _scores(12, 30, 1).view(3, 4, 30).to(torch.bfloat16)
    ref = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :6]
    assert torch.equal(top_indices(x, 6), ref)
    assert torch.equal(top_index_set(x, 6), torch.sort(ref, dim=-1).values)


@pytest.mark.parametrize("bad, error", [(0, ValueError), (31, ValueError), (True, TypeError),
                                        (2.0, TypeError)])
def test_a_k_outside_the_row_is_refused(bad, error):
    for fn in (top_indices, top_index_set):
        with pytest.raises(error, match="k must be"):
            fn(torch.zeros(2, 30), bad)


def test_integer_scores_are_refused():
    with pytest.raises(TypeError, match="floating-point"):
        descending_ranks(torch.zeros(2, 5, dtype=torch.int64))


@pytest.mark.parametrize("unbacked", [False, True])
def test_compiles_fullgraph_with_a_dynamic_or_unbacked_row_count(unbacked):
    torch._dynamo.reset()
    fn = torch.compile(lambda t: (top_indices(t, 8), top_index_set(t, 15)), backend="inductor",
                       fullgraph=True)
    for rows in (6, 9):
        x = _scores(rows, 264, rows)
        if unbacked:
            torch._dynamo.decorators.mark_unbacked(x, 0)
        else:
            torch._dynamo.mark_dynamic(x, 0)
        best, chosen = fn(x)
        ref = torch.sort(x, dim=-1, descending=True, stable=True).indices
        assert torch.equal(best, ref[:, :8])
        assert torch.equal(chosen, torch.sort(ref[:, :15], dim=-1).values)
