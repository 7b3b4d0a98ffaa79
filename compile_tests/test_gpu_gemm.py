"""The ``fa3_spec::skinny_mm`` op and the fused ``rms_norm_mm`` and
``swiglu_mm`` on CUDA: the Triton kernels against fp32 on the target's
shapes, the row kernels and cuBLAS beyond 16 rows, eager, in a CUDA graph
and inside an inductor-compiled function.

Skipped without CUDA or Triton. Run on the H200 (compile_tests/GPU_RESULTS.md).
"""

import pytest
import torch

from fa3_spec.eagle import fused, gemm
from fa3_spec.attention import fused_store_available
from fa3_spec.graphs import capture, compile_fullgraph

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and fused_store_available()),
                       reason="needs CUDA and Triton"),
]


def _pair(m, k, n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    return x, w


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("k, n", [(4096, 6144), (4096, 4096), (14336, 4096), (4096, 1000), (320, 130)])
@pytest.mark.parametrize("m", [1, 7, 16])
def test_the_kernel_matches_fp32(m, k, n):
    x, w = _pair(m, k, n)
    assert gemm.skinny_applies(x, w)
    got = gemm.skinny_mm(x, w)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert _rel(got, x.float() @ w.float()) < 1e-2
    assert torch.equal(got, gemm.skinny_mm_triton(x, w))  # the op took the kernel
    assert torch.equal(got, gemm.skinny_mm(x, w))  # deterministic, split K included


def test_more_than_16_rows_go_to_cublas():
    x, w = _pair(17, 4096, 4096)
    assert not gemm.skinny_applies(x, w)
    assert torch.equal(gemm.skinny_mm(x, w), x @ w)


def test_graph_replay_and_inductor_give_the_eager_result():
    x, w = _pair(4, 14336, 4096)
    eager = gemm.skinny_mm(x, w)
    graph, out = capture(gemm.matmul, x, w)
    x.copy_(_pair(4, 14336, 4096, seed=1)[0])
    graph.replay()
    torch.testing.assert_close(out, gemm.skinny_mm(x, w), rtol=0, atol=0)
    fn = compile_fullgraph(lambda a, b: gemm.matmul(a, b) * 2, dynamic=False)
    x2, _ = _pair(4, 14336, 4096)
    torch.testing.assert_close(fn(x2, w), eager * 2, rtol=0, atol=0)


# ------------------------------------------------------------------ fused prologues

def _norm_case(m, k, n, nd, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    deltas = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
              for _ in range(nd)]
    gain = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).to(torch.bfloat16)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    s = x.float()
    for d in deltas:
        s = s + d.float()
    s = s.to(torch.bfloat16)
    sf = s.float()
    ref = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-5) * gain.float()) @ w.float()
    return x, deltas, gain, w, s, ref


@pytest.mark.parametrize("k, n, nd", [(4096, 6144, 2), (4096, 28672, 1), (4096, 128256, 0),
                                      (320, 130, 2)])
@pytest.mark.parametrize("m", [1, 16, 17, 40])
def test_the_norm_fused_into_the_gemm_matches_fp32(m, k, n, nd):
    """Up to 16 rows the fused kernel, beyond it the row kernel and cuBLAS."""
    x, deltas, gain, w, s_ref, ref = _norm_case(m, k, n, nd)
    fits = gemm.prologue_applies(x, w, prologue=gemm.RMS_NORM, deltas=deltas, gain=gain)
    assert fits == (m <= 16)
    got = fused.rms_norm_mm(x, deltas, gain, w, 1e-5, nd > 0)
    assert got[0].shape == (m, n) and got[0].dtype == torch.bfloat16
    assert _rel(got[0], ref) < 1e-2
    if nd:
        assert torch.equal(got[1], s_ref)  # the stream, rounded once, on both paths
    again = fused.rms_norm_mm(x, deltas, gain, w, 1e-5, nd > 0)
    assert all(torch.equal(a, b) for a, b in zip(got, again))  # deterministic
    if fits:  # the op took the fused kernel
        direct = gemm.launch(x, w, prologue=gemm.RMS_NORM, deltas=deltas, gain=gain, eps=1e-5,
                             store_sum=nd > 0)
        assert torch.equal(got[0], direct[0] if nd else direct)


@pytest.mark.parametrize("i, n", [(14336, 4096), (192, 70)])
@pytest.mark.parametrize("m", [1, 16, 17])
def test_swiglu_fused_into_the_gemm_matches_fp32(m, i, n):
    g = torch.Generator(device="cuda").manual_seed(3)
    gu = torch.randn(m, 2 * i, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(i, n, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    gate, up = gu.float().chunk(2, -1)
    ref = (gate * torch.sigmoid(gate) * up) @ w.float()
    assert gemm.prologue_applies(gu, w, prologue=gemm.SWIGLU) == (m <= 16)
    got = fused.swiglu_mm(gu, w)
    assert got.shape == (m, n) and _rel(got, ref) < 1e-2
    assert torch.equal(got, fused.swiglu_mm(gu, w))


def test_the_fused_ops_replay_in_a_graph_and_compile_to_the_eager_result():
    x, deltas, gain, w, _, _ = _norm_case(4, 4096, 6144, 2)
    wd = torch.randn(3072, 4096, device="cuda", dtype=torch.bfloat16) * 0.02

    def fn(a, d1, d2):
        s, out = fused.rms_norm_matmul(a, gain, w, 1e-5, deltas=[d1, d2], return_sum=True)
        return s, fused.swiglu_matmul(out, wd)

    eager = fn(x, *deltas)
    graph, out = capture(fn, x, *deltas)
    x.copy_(_norm_case(4, 4096, 6144, 2, seed=1)[0])
    graph.replay()
    for a, b in zip(out, fn(x, *deltas)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    compiled = compile_fullgraph(fn, dynamic=False)
    x2 = _norm_case(4, 4096, 6144, 2)[0]
    for a, b in zip(compiled(x2, *deltas), eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
