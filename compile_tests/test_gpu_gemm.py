"""The ``fa3_spec::skinny_mm`` op on CUDA: the Triton kernel against fp32 on
the target's shapes, cuBLAS beyond 16 rows, eager, in a CUDA graph and
inside an inductor-compiled function.

Skipped without CUDA or Triton. Run on the H200 (compile_tests/GPU_RESULTS.md).
"""

import pytest
import torch

from fa3_spec.eagle import gemm
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
