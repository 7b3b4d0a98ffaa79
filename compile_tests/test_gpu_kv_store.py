"""The ``fa3_spec::store_kv`` op on CUDA: its fused Triton kernel, eager,
captured in a CUDA graph and inside an inductor-compiled function.

Skipped without CUDA or Triton. Run on the H200 (compile_tests/GPU_RESULTS.md).
"""

import pytest
import torch

from fa3_spec.attention import STORE_KV_IMPLS, fused_store_available, store_kv, store_kv_index_copy
from fa3_spec.graphs import capture
from helpers import cuda_kernel_names

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and fused_store_available()),
                       reason="needs CUDA and Triton"),
]

L, N, P, HQ, H, D = 4, 64, 16, 8, 2, 128


def _tensors(t, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    kc = torch.randn(L, N, P, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(L, N, P, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    qkv = torch.randn(t, HQ + 2 * H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    slots = torch.randperm(L * N * P, device="cuda", generator=g)[:t]
    return kc, vc, qkv, slots


def test_the_op_on_cuda_is_one_triton_launch_and_writes_what_index_copy_writes():
    assert STORE_KV_IMPLS == ("index_copy", "triton")
    kc, vc, qkv, slots = _tensors(37)
    k, v = qkv[:, HQ:HQ + H].contiguous(), qkv[:, HQ + H:]
    want = (kc.clone(), vc.clone())
    store_kv_index_copy(*want, slots, k, v)
    names = cuda_kernel_names(lambda: store_kv(kc, vc, slots, k, v))
    assert torch.equal(kc, want[0]) and torch.equal(vc, want[1])
    assert len(names) == 1 and "store_kv_kernel" in names[0], names


def test_slots_out_of_range_write_nothing_on_cuda():
    kc, vc, qkv, _ = _tensors(4)
    k, v = qkv[:, HQ:HQ + H].contiguous(), qkv[:, HQ + H:]
    rows = L * N * P
    slots = torch.tensor([-1, rows, 2 ** 40, 5], device="cuda")
    before = (kc.clone(), vc.clone())
    store_kv(kc, vc, slots, k, v)
    torch.cuda.synchronize()
    want = (before[0].clone(), before[1].clone())
    store_kv_index_copy(*want, slots[3:], k[3:], v[3:])
    assert torch.equal(kc, want[0]) and torch.equal(vc, want[1])


def test_the_op_in_a_cuda_graph_and_under_inductor_writes_each_replay_s_rows():
    kc, vc, qkv, slots = _tensors(16)
    ref_k, ref_v = kc.clone(), vc.clone()

    @torch.compile(backend="inductor", fullgraph=True)
    def write(kc, vc, qkv, slots):
        k = qkv[:, HQ:HQ + H] * 2  # a producer inductor fuses, as RoPE is
        store_kv(kc, vc, slots, k, qkv[:, HQ + H:])

    def reference():
        store_kv_index_copy(ref_k, ref_v, slots, qkv[:, HQ:HQ + H] * 2, qkv[:, HQ + H:])

    graph, _ = capture(lambda: write(kc, vc, qkv, slots), warmup=2)
    reference()  # the warm-up's writes (the same rows each time)
    # The compiled op took the fused kernel (a layout it refused would fall
    # back to index_copy_ and still write the right rows).
    assert any("store_kv_kernel" in n for n in cuda_kernel_names(graph.replay))
    reference()  # that replay's writes
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(3):
        qkv.copy_(torch.randn(qkv.shape, device="cuda", dtype=qkv.dtype, generator=g))
        slots.copy_(torch.randperm(L * N * P, device="cuda", generator=g)[:16])
        graph.replay()
        reference()
    torch.cuda.synchronize()
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    # Rows no replay named are the initial ones: nothing else was written.
    assert int((kc != _tensors(16)[0]).any(-1).any(-1).sum()) <= 16 * 4
