"""``fa3_spec::expand_attention`` on CUDA: the Triton kernel against FA3's own
expand call, index tensors out of range, a whole cascade on either kernel,
and the op inside an inductor-compiled function captured in a CUDA graph.

Skipped without CUDA or an FA3 provider. Results: compile_tests/GPU_RESULTS.md.
"""

import pytest
import torch

import fa3_spec
from fa3_spec import build_metadata as build
from fa3_spec.attention import (expand_attention, expand_attention_triton, fa3_available,
                                fa3_paged_attention, paged_attention_reference,
                                select_expand_kernel)
from fa3_spec.graphs import capture
from fa3_spec.harness.oracle import num_queries
from fa3_spec.harness.worlds import fill_kv_cache, make_world
from fa3_spec.metadata import FA3Metadata
from helpers import cuda_kernel_names

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not fa3_available(), reason="needs CUDA sm90 and an FA3 provider"),
]

HQ, HKV, D, SLOTS = 32, 8, 128, 8192  # llama3-8b's heads


def _calls(rows, n, seed, dtype=torch.bfloat16, hq=HQ, hkv=HKV, d=D):
    """An expand call's tensors: ``rows`` rows of one query over up to ``n`` slots."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(rows, hq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(SLOTS, 1, hkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(SLOTS, 1, hkv, d, device="cuda", dtype=dtype, generator=g)
    pt = torch.randint(1, SLOTS, (rows, n), device="cuda", generator=g, dtype=torch.int32)
    sl = torch.randint(1, n + 1, (rows,), device="cuda", generator=g, dtype=torch.int32)
    cu = torch.arange(rows + 1, device="cuda", dtype=torch.int32)
    return q, k, v, pt, sl, cu


def _expand(batch, n, seed=0, dtype=torch.bfloat16):
    """A tree's expand call: ``batch * n`` rows of one query over up to ``n`` slots."""
    q, k, v, pt, sl, cu = _calls(batch * n, n, seed, dtype)
    sl[::7] = 0  # rows with no key
    return q, k, v, pt, sl, cu


def _assert_gives_fa3_s(q, k, v, pt, sl, cu, n):
    """The kernel's output and LSE are FA3's on rows with keys; 0 and -inf on the rest."""
    scale = q.shape[-1] ** -0.5
    got_o, got_l = expand_attention_triton(q, k, v, pt, sl, cu, n, scale)
    want_o, want_l = fa3_paged_attention(q, k, v, pt, sl, cu, 1, scale, False, 1)
    live = sl > 0
    torch.testing.assert_close(got_o[live], want_o[live], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_l[:, live], want_l[:, live], atol=1e-3, rtol=1e-4)
    assert (got_o[~live] == 0).all() and torch.isneginf(got_l[:, ~live]).all()


@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("n", [8, 16])
def test_the_kernel_gives_fa3_s_output_and_lse(batch, n):
    _assert_gives_fa3_s(*_expand(batch, n, seed=batch * 100 + n), n)


@pytest.mark.parametrize("d, hq, hkv, n, dtype", [
    (256, 32, 2, 128, torch.bfloat16),  # the largest tile: D 256, 16 heads per KV head, 128 keys
    (64, 8, 8, 33, torch.float16),      # one head per KV head, keys not a power of two
])
def test_the_kernel_gives_fa3_s_output_and_lse_at_the_edges_of_its_tiles(d, hq, hkv, n, dtype):
    q, k, v, pt, sl, cu = _calls(24, n, d + n, dtype, hq, hkv, d)
    sl[0], sl[1], sl[2] = n, 0, 1  # every key, none, one
    _assert_gives_fa3_s(q, k, v, pt, sl, cu, n)


def test_the_op_is_one_launch_of_the_kernel():
    q, k, v, pt, sl, cu = _expand(4, 16)
    names = cuda_kernel_names(lambda: expand_attention(q, k, v, pt, sl, cu, 16, 0.1))
    assert len(names) == 1 and "expand_attention_kernel" in names[0], names


def test_indices_out_of_range_read_inside_the_caches():
    q, k, v, pt, sl, cu = _expand(8, 16, seed=3)
    pt[0] = -7
    pt[1] = SLOTS + 5
    pt[2, ::2] = 2 ** 30
    sl[3], sl[4] = 10 ** 6, -4
    cu[-1] = 10 ** 6  # the last row claims queries past q
    got_o, got_l = expand_attention_triton(q, k, v, pt, sl, cu, 16, 0.1)
    torch.cuda.synchronize()
    md = FA3Metadata(pt, sl, cu, cu, 1, 16, 1, False)
    want_o, want_l = paged_attention_reference(q, k, v, md, 0.1)
    # The last row claims queries past q: it still owns its one, the last.
    torch.testing.assert_close(got_o.float(), want_o.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_l, want_l, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("mode, step", [("target_verify", 0), ("draft_decode", 2)])
def test_a_cascade_gives_the_same_on_either_kernel_compiled_and_captured(mode, step):
    cfg = fa3_spec.SpecConfig(page_size=2, topk=8, num_steps=5, num_draft_tokens=16, max_bs=16,
                              max_context_len=600)
    world = make_world(cfg, 5, seq_lens=[1, 77, 300, 0, 513], seed=11, device="cuda")
    kc, vc = fill_kv_cache(world, num_kv_heads=HKV, head_dim=D, dtype=torch.bfloat16, seed=1)
    md = build(mode, cfg, step=step, **world.mode_kwargs(mode, tree=True, step=step,
                                                          draft_attention="ancestors"))
    assert isinstance(md, fa3_spec.CascadeMetadata) and md.expand is not None
    q = torch.randn(num_queries(world, mode), HQ, D, device="cuda", dtype=torch.bfloat16)

    def attend(q, kernel):
        previous = select_expand_kernel(kernel)
        try:
            return fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="fa3")
        finally:
            select_expand_kernel(previous)

    names = cuda_kernel_names(lambda: attend(q, "triton"))
    assert any("expand_attention_kernel" in name for name in names), names
    assert not any("expand_attention_kernel" in n for n in cuda_kernel_names(lambda: attend(q, "fa3")))
    torch.testing.assert_close(attend(q, "triton"), attend(q, "fa3"), atol=2e-2, rtol=2e-2)
    previous = select_expand_kernel("triton")
    try:
        compiled = torch.compile(lambda q: fa3_spec.cascade_attention(q, kc, vc, md,
                                                                      attention_backend="fa3"),
                                 fullgraph=True)
        graph, out = capture(compiled, q)
    finally:
        select_expand_kernel(previous)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.testing.assert_close(out, attend(q, "fa3"), atol=2e-2, rtol=2e-2)
