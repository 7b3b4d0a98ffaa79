"""The ``fa3_spec::rope_store_kv`` op on CUDA: its fused Triton kernel, eager,
captured in a CUDA graph and inside an inductor-compiled function.

Skipped without CUDA or Triton. Run on the H200 (compile_tests/GPU_RESULTS.md).
"""

import pytest
import torch

from fa3_spec.eagle.rope_kv import (fused_rope_kv_applies, rope_and_store, rope_store_kv,
                                    rope_store_kv_split)
from fa3_spec.graphs import capture
from fa3_spec.triton_support import triton_available
from helpers import cuda_kernel_names

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()),
                       reason="needs CUDA and Triton"),
]

L, N, P, HQ, H, D = 4, 64, 16, 32, 8, 128  # llama3-8b's heads


def _tensors(t, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    kc = torch.randn(L, N, P, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(L, N, P, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    qkv = torch.randn(t, (HQ + 2 * H) * D, device="cuda", dtype=torch.bfloat16,
                      generator=g).view(t, HQ + 2 * H, D)
    pos = torch.randint(0, 8192, (t,), device="cuda", generator=g)
    inv = 500000.0 ** -(torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D)
    ang = pos.float().unsqueeze(-1) * inv
    slots = torch.randperm(L * N * P, device="cuda", generator=g)[:t]
    return kc, vc, slots, qkv, ang.cos(), ang.sin()


def _within_one_unit(a, b):
    """Apart by at most one bf16 unit of the larger, plus 1e-6 where a
    rotation cancels to near 0 (FMA contraction moves a float32 sum by about
    one float32 unit of its terms, which are below 8 here)."""
    a, b = a.float(), b.float()
    bound = torch.finfo(torch.bfloat16).eps * torch.maximum(a.abs(), b.abs()) + 1e-6
    return bool(((a - b).abs() <= bound).all())


@pytest.mark.parametrize("t", [1, 16, 1024])
def test_the_op_on_cuda_is_one_launch_and_matches_the_default_within_one_unit(t):
    kc, vc, slots, qkv, cos, sin = _tensors(t)
    assert fused_rope_kv_applies(kc, vc, slots, qkv, cos, sin, HQ)
    want_k, want_v = kc.clone(), vc.clone()
    q_want = rope_store_kv_split(want_k, want_v, slots, qkv, cos, sin, HQ)
    out = {}
    names = cuda_kernel_names(lambda: out.setdefault("q", rope_store_kv(kc, vc, slots, qkv, cos, sin, HQ)))
    assert len(names) == 1 and "rope_store_kv_kernel" in names[0], names
    assert _within_one_unit(out["q"], q_want) and _within_one_unit(kc, want_k)
    assert torch.equal(vc, want_v)
    bitwise = torch.equal(out["q"], q_want) and torch.equal(kc, want_k)
    print(f"T={t}: bitwise equal to the default: {bitwise}")


def test_slots_out_of_range_write_nothing_on_cuda():
    kc, vc, _, qkv, cos, sin = _tensors(4)
    rows = L * N * P
    slots = torch.tensor([-1, rows, 2 ** 40, 5], device="cuda")
    before = (kc.clone(), vc.clone())
    rope_store_kv(kc, vc, slots, qkv, cos, sin, HQ)
    torch.cuda.synchronize()
    want = (before[0].clone(), before[1].clone())
    rope_store_kv_split(*want, slots[3:], qkv[3:], cos[3:], sin[3:], HQ)
    changed = (kc != before[0]).any(-1).any(-1).flatten().nonzero().flatten().tolist()
    assert changed == [5] and _within_one_unit(kc, want[0]) and torch.equal(vc, want[1])


def test_the_layers_call_under_inductor_in_a_cuda_graph_writes_each_replay_s_rows():
    kc, vc, slots, qkv, cos, sin = _tensors(16)
    ref_k, ref_v = kc.clone(), vc.clone()
    q_out = torch.empty(16, HQ, D, device="cuda", dtype=torch.bfloat16)

    @torch.compile(backend="inductor", fullgraph=True)
    def step(kc, vc, slots, qkv, cos, sin):
        q_out.copy_(rope_and_store(kc, vc, slots, qkv * 2, cos, sin, HQ))  # a producer, as the GEMM

    def reference():
        return rope_store_kv_split(ref_k, ref_v, slots, qkv * 2, cos, sin, HQ)

    graph, _ = capture(lambda: step(kc, vc, slots, qkv, cos, sin), warmup=2)
    reference()
    names = cuda_kernel_names(graph.replay)
    assert any("rope_store_kv_kernel" in n for n in names), names
    assert not any("store_kv_kernel" in n and "rope" not in n for n in names), names
    reference()
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(3):
        qkv.copy_(torch.randn(qkv.shape, device="cuda", dtype=qkv.dtype, generator=g))
        slots.copy_(torch.randperm(L * N * P, device="cuda", generator=g)[:16])
        graph.replay()
        q_want = reference()
        torch.cuda.synchronize()
        assert _within_one_unit(q_out, q_want)
    assert _within_one_unit(kc, ref_k) and torch.equal(vc, ref_v)


def test_a_cache_the_kernel_refuses_falls_back_to_the_default_on_cuda():
    kc, vc, slots, qkv, cos, sin = _tensors(8)
    kt, vt = kc.transpose(0, 1), vc.transpose(0, 1)  # not contiguous: refused by layout
    assert not fused_rope_kv_applies(kt, vt, slots, qkv, cos, sin, HQ)
    want_k, want_v = kt.clone(), vt.clone()
    q_want = rope_store_kv_split(want_k, want_v, slots, qkv, cos, sin, HQ)
    out = {}
    names = cuda_kernel_names(lambda: out.setdefault("q", rope_store_kv(kt, vt, slots, qkv, cos, sin, HQ)))
    assert not any("rope_store_kv_kernel" in n for n in names), names
    assert torch.equal(out["q"], q_want) and torch.equal(kt, want_k) and torch.equal(vt, want_v)


# A captured chain of library kernels with inductor's between them: skinny
# GEMM -> (inductor) -> the op -> (inductor) -> GEMM -> split-K GEMM + sum,
# replayed on new inputs, once with PDL on and once off, in this process.
def _pdl_chain(on: bool) -> dict:
    from fa3_spec.eagle.gemm import matmul
    from fa3_spec.graphs import capture
    from fa3_spec.triton_support import pdl_launch, set_pdl

    previous = set_pdl(on)
    try:
        torch._dynamo.reset()
        h, t = 8, 4
        g = torch.Generator(device="cuda").manual_seed(3)

        def rnd(*shape, scale=1.0):
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * scale

        x = rnd(t, 4096)
        wqkv = rnd(4096, (HQ + 2 * h) * D, scale=0.02)
        wu, wd = rnd(HQ * D, 14336, scale=0.02), rnd(14336, 4096, scale=0.02)
        kc, vc = rnd(4, 64, 16, h, D), rnd(4, 64, 16, h, D)
        slots = torch.randperm(4 * 64 * 16, device="cuda", generator=g)[:t]
        ang = torch.rand(t, D // 2, device="cuda", generator=g) * 6.3
        cos, sin = ang.cos(), ang.sin()

        @torch.compile(backend="inductor", fullgraph=True)
        def chain(x, kc, vc, slots, cos, sin):
            qkv = (matmul(x, wqkv) * 1.5).view(t, HQ + 2 * h, D)
            q = rope_store_kv(kc, vc, slots, qkv, cos, sin, HQ)
            return matmul(torch.relu(matmul(q.reshape(t, -1) + 1, wu)), wd)

        graph, out = capture(lambda: chain(x, kc, vc, slots, cos, sin), warmup=2)
        outs = []
        for _ in range(3):
            x.copy_(rnd(t, 4096))
            slots.copy_(torch.randperm(4 * 64 * 16, device="cuda", generator=g)[:t])
            graph.replay()
            outs.append(out.clone())
        torch.cuda.synchronize()
        return {"pdl": pdl_launch(x), "outs": outs, "k": kc, "v": vc}
    finally:
        set_pdl(previous)


def test_pdl_is_on_on_hopper_and_changes_no_bit_of_a_captured_chain_with_inductor_between():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9")
    runs = {mode: _pdl_chain(mode == "on") for mode in ("on", "off")}
    assert runs["on"]["pdl"] and not runs["off"]["pdl"]
    for a, b in zip(runs["on"]["outs"], runs["off"]["outs"]):
        assert torch.equal(a, b)
    assert not torch.equal(runs["on"]["outs"][0], runs["on"]["outs"][1])  # the inputs changed
    assert torch.equal(runs["on"]["k"], runs["off"]["k"]) and torch.equal(runs["on"]["v"], runs["off"]["v"])
