"""Scan-free prefix sums of the per-request metadata: bitwise equal to the
int32 cumsum they replace, on every path `exclusive_sums` takes (eager scan,
compiled unrolled, compiled reduction, compiled with a symbolic batch)."""

import pytest
import torch
import torch.nn.functional as F

from fa3_spec import _paged
from fa3_spec.builders.draft import _branch_cu_seqlens
from fa3_spec.probes import RecordingBackend


def cumsum_reference(lengths):
    return F.pad(torch.cumsum(lengths, -1, dtype=torch.int32), (1, 0))


def compiled(fn, dynamic=False):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=dynamic)


@pytest.mark.parametrize("n", [0, 1, 7, 8, _paged.UNROLLED_SUMS, _paged.UNROLLED_SUMS + 1, 64])
def test_cu_seqlens_matches_cumsum_eager_and_compiled(n):
    g = torch.Generator().manual_seed(n)
    lengths = torch.randint(0, 9000, (3, n), generator=g, dtype=torch.int32)
    for fn in (_paged.cu_seqlens, compiled(_paged.cu_seqlens)):
        assert torch.equal(fn(lengths), cumsum_reference(lengths))
        assert torch.equal(fn(lengths[0]), cumsum_reference(lengths[0]))


def test_compiled_cu_seqlens_with_a_symbolic_batch_matches_cumsum_and_does_not_recompile():
    torch._dynamo.reset()
    counter = RecordingBackend("aot_eager")
    fn = torch.compile(_paged.cu_seqlens, fullgraph=True, backend=counter, dynamic=True)
    for n in (5, 9, 40):  # one graph: no guard on n from the unrolled/reduction switch
        lengths = torch.randint(0, 9000, (n,), dtype=torch.int32)
        assert torch.equal(fn(lengths), cumsum_reference(lengths))
    assert counter.frame_count == 1


@pytest.mark.parametrize("n", [5, 20])
def test_cu_seqlens_wraps_like_int32_cumsum(n):
    lengths = torch.full((n,), 2**29, dtype=torch.int32)  # sums pass 2^31
    for fn in (_paged.cu_seqlens, compiled(_paged.cu_seqlens)):
        assert torch.equal(fn(lengths), cumsum_reference(lengths))


def test_scan_cu_seqlens_is_the_cumsum():
    lengths = torch.randint(0, 9000, (300,), dtype=torch.int32)
    assert torch.equal(_paged.scan_cu_seqlens(lengths), cumsum_reference(lengths))


@pytest.mark.parametrize("bs,topk", [(0, 4), (1, 8), (8, 8), (20, 3)])
def test_branch_cu_seqlens_matches_cumsum_over_branch_rows(bs, topk):
    g = torch.Generator().manual_seed(bs * 10 + topk)
    per_request = torch.randint(0, 10, (4, bs), generator=g, dtype=torch.int32)
    rows = per_request.repeat_interleave(topk, dim=1)  # [steps, B*K]
    expected = cumsum_reference(rows)
    assert torch.equal(_branch_cu_seqlens(per_request, topk), expected)
    assert torch.equal(compiled(_branch_cu_seqlens)(per_request, topk), expected)
