"""Scan-free prefix sums of the per-request metadata: bitwise equal to the
int32 cumsum they replace, on every path `exclusive_sums` takes (eager scan,
compiled unrolled, compiled reduction, compiled with a symbolic batch)."""

import pytest
import torch
import torch.nn.functional as F

from fa3_spec import offsets
from fa3_spec.builders.draft import _branch_cu_seqlens
from fa3_spec.probes import RecordingBackend


def cumsum_reference(lengths):
    return F.pad(torch.cumsum(lengths, -1, dtype=torch.int32), (1, 0))


def compiled(fn, dynamic=False):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=dynamic)


@pytest.mark.parametrize("n", [0, 1, 7, 8, offsets.UNROLLED_SUMS, offsets.UNROLLED_SUMS + 1, 64])
def test_cu_seqlens_matches_cumsum_eager_and_compiled(n):
    g = torch.Generator().manual_seed(n)
    lengths = torch.randint(0, 9000, (3, n), generator=g, dtype=torch.int32)
    for fn in (offsets.cu_seqlens, compiled(offsets.cu_seqlens)):
        assert torch.equal(fn(lengths), cumsum_reference(lengths))
        assert torch.equal(fn(lengths[0]), cumsum_reference(lengths[0]))


def test_compiled_cu_seqlens_with_a_symbolic_batch_matches_cumsum_and_does_not_recompile():
    torch._dynamo.reset()
    counter = RecordingBackend("aot_eager")
    fn = torch.compile(offsets.cu_seqlens, fullgraph=True, backend=counter, dynamic=True)
    for n in (5, 9, 40):  # one graph: no guard on n from the unrolled/reduction switch
        lengths = torch.randint(0, 9000, (n,), dtype=torch.int32)
        assert torch.equal(fn(lengths), cumsum_reference(lengths))
    assert counter.frame_count == 1


def test_a_symbolic_batch_bounded_below_the_unrolled_width_is_not_specialised():
    # A bound like max_bs = 8 (a guard B <= 8) makes n <= UNROLLED_SUMS provable:
    # the unrolled sums must then still not depend on n's current value.
    def bounded(lengths):
        if lengths.shape[0] > 8:
            raise ValueError("batch past max_bs")
        return offsets.cu_seqlens(lengths)

    torch._dynamo.reset()
    counter = RecordingBackend("aot_eager")
    fn = torch.compile(bounded, fullgraph=True, backend=counter, dynamic=True)
    for n in (2, 3, 5, 8):
        lengths = torch.randint(0, 9000, (n,), dtype=torch.int32)
        assert torch.equal(fn(lengths), cumsum_reference(lengths))
    assert counter.frame_count == 1


@pytest.mark.parametrize("n", [5, 20])
def test_cu_seqlens_wraps_like_int32_cumsum(n):
    lengths = torch.full((n,), 2**29, dtype=torch.int32)  # sums pass 2^31
    for fn in (offsets.cu_seqlens, compiled(offsets.cu_seqlens)):
        assert torch.equal(fn(lengths), cumsum_reference(lengths))


def test_scan_cu_seqlens_is_the_cumsum():
    lengths = torch.randint(0, 9000, (300,), dtype=torch.int32)
    assert torch.equal(offsets.scan_cu_seqlens(lengths), cumsum_reference(lengths))


@pytest.mark.parametrize("bs,topk", [(0, 4), (1, 8), (8, 8), (20, 3)])
def test_branch_cu_seqlens_matches_cumsum_over_branch_rows(bs, topk):
    g = torch.Generator().manual_seed(bs * 10 + topk)
    per_request = torch.randint(0, 10, (4, bs), generator=g, dtype=torch.int32)
    rows = per_request.repeat_interleave(topk, dim=1)  # [steps, B*K]
    expected = cumsum_reference(rows)
    assert torch.equal(_branch_cu_seqlens(per_request, topk), expected)
    assert torch.equal(compiled(_branch_cu_seqlens)(per_request, topk), expected)


def test_the_draft_step_compiles_two_frames_across_buckets_with_a_small_max_bs():
    # The CPU twin of test_gpu_runner's one-compile test: max_bs = 8 bounds the
    # batch below UNROLLED_SUMS; bucket 1 is dynamo's own 0/1 specialisation.
    import fa3_spec
    from fa3_spec.harness.toy import ToyModel, example_batch, make_step
    from fa3_spec.harness.worlds import make_world

    cfg = fa3_spec.SpecConfig(page_size=2, topk=8, num_steps=5, num_draft_tokens=16, max_bs=8,
                              max_context_len=256)
    base = make_world(cfg, 8, seed=0)
    model = ToyModel.create(layers=1, num_pages=base.num_pages, page_size=2, num_heads=4,
                            num_kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu")
    step = make_step("draft_decode", cfg, model, base.req_to_token, attention_backend="torch")
    torch._dynamo.reset()
    counter = RecordingBackend("eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for bs in (8, 6, 4, 3, 2, 1):
        batch = {k: v.clone() for k, v in example_batch("draft_decode", cfg, model, bs,
                                                          device="cpu").items()}
        for t in batch.values():
            torch._dynamo.maybe_mark_dynamic(t, 0)
        compiled(**batch)
    assert counter.frame_count == 2
