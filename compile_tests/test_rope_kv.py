"""`fa3_spec.eagle.rope_kv`: RoPE and the K/V write as one op.

The op's default against `apply_rope` and `store_kv_index_copy`, its fake
(`torch.library.opcheck`), its argument checks, the layers' call under
``torch.compile``; the fused Triton kernel against the default in Triton's
interpreter, in a child process (as test_kv_store.py). The CUDA side:
test_gpu_rope_kv.py.
"""


import pytest
import torch

import children
from fa3_spec.attention import store_kv_index_copy
from fa3_spec.eagle.rope_kv import (apply_rope, rope_and_store, rope_store_kv,
                                    rope_store_kv_split)

T, HQ, HKV, D = 6, 4, 2, 8


def _tensors(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(3, 4, HKV, D, generator=g).to(dtype)
    vc = torch.randn(3, 4, HKV, D, generator=g).to(dtype)
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, generator=g).to(dtype).view(T, HQ + 2 * HKV, D)
    angles = torch.rand(T, D // 2, generator=g, dtype=torch.float64) * 6.3
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    slots = torch.tensor([0, 5, 11, 2, 7, 9])
    return kc, vc, slots, qkv, angles.cos().to(cdt), angles.sin().to(cdt)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_op_rotates_q_and_k_writes_k_and_v_at_their_slots_and_nothing_else(dtype):
    kc, vc, slots, qkv, cos, sin = _tensors(dtype)
    want_k, want_v = kc.clone(), vc.clone()
    store_kv_index_copy(want_k, want_v, slots, apply_rope(qkv[:, HQ:HQ + HKV], cos, sin),
                        qkv[:, HQ + HKV:])
    q = rope_store_kv(kc, vc, slots, qkv, cos, sin, HQ)
    assert torch.equal(q, apply_rope(qkv[:, :HQ], cos, sin))
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    # The rotation itself, spelled out for a query head and for a key head as
    # the cache holds it: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s).
    c, s = cos[2].double(), sin[2].double()
    for head, got in ((1, q[2, 1]), (HQ + 1, kc.view(-1, HKV, D)[slots[2], 1])):
        x1, x2 = qkv[2, head, :D // 2].double(), qkv[2, head, D // 2:].double()
        want = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s])
        tol = 1e-12 if dtype == torch.float64 else 2 * torch.finfo(dtype).eps
        assert torch.allclose(got.double(), want, rtol=tol, atol=tol), head
    assert not torch.equal(q, qkv[:, :HQ])  # the angles are not all 0


def test_the_fake_matches_the_op():
    kc, vc, slots, qkv, cos, sin = _tensors()
    torch.library.opcheck(torch.ops.fa3_spec.rope_store_kv, (kc, vc, slots, qkv, cos, sin, HQ))


@pytest.mark.parametrize("change, error, says", [
    (lambda a: {**a, "qkv": a["qkv"].flatten(1)}, ValueError, "qkv must be [T, H_q + 2 H_kv, D]"),
    (lambda a: {**a, "num_heads": HQ + 1}, ValueError, "not num_heads (5) + 2 x the caches' H_kv (2)"),
    (lambda a: {**a, "cos": a["cos"][:, :2]}, ValueError, "cos and sin must be [T, D/2]"),
    (lambda a: {**a, "slots": a["slots"][:3]}, ValueError, "slots must be [T] = [6]"),
    (lambda a: {**a, "slots": a["slots"].int()}, TypeError, "slots must be int64"),
    (lambda a: {**a, "v_cache": a["v_cache"][..., :4]}, ValueError, "must end in [H_kv, D]"),
    (lambda a: {**a, "k_cache": a["k_cache"][..., :0, :], "v_cache": a["v_cache"][..., :0, :],
                "qkv": a["qkv"][:, :HQ]}, ValueError, "H_kv >= 1"),
    (lambda a: {**a, "v_cache": a["v_cache"].float()}, TypeError, "must share a dtype"),
    (lambda a: {**a, "sin": a["sin"].float()}, TypeError, "cos and sin must share a floating dtype"),
])
def test_bad_arguments_raise_naming_them(change, error, says):
    kc, vc, slots, qkv, cos, sin = _tensors()
    args = change(dict(k_cache=kc, v_cache=vc, slots=slots, qkv=qkv, cos=cos, sin=sin, num_heads=HQ))
    with pytest.raises(error, match=f"rope_store_kv: .*{__import__('re').escape(says)}"):
        rope_store_kv(**args)


def test_the_fused_entry_and_the_layers_call_check_shapes_like_the_op():
    from fa3_spec.eagle.rope_kv import rope_store_kv_fused

    kc, vc, slots, qkv, cos, sin = _tensors()
    for call in (rope_store_kv_fused, rope_and_store):
        with pytest.raises(ValueError, match="not num_heads \\(2\\)"):
            call(kc, vc, slots, qkv, cos, sin, 2)


@pytest.mark.parametrize("entry", [lambda *a: torch.ops.fa3_spec.rope_store_kv(*a), rope_and_store],
                         ids=["the op", "the layers' call"])
def test_it_compiles_whole_under_aot_eager_and_matches_eager(entry):
    kc, vc, slots, qkv, cos, sin = _tensors()
    eager_k, eager_v = kc.clone(), vc.clone()
    want = rope_store_kv_split(eager_k, eager_v, slots, qkv, cos, sin, HQ)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(kc, vc, slots, qkv, cos, sin):
        return entry(kc, vc, slots, qkv * 1, cos, sin, HQ)

    got = step(kc, vc, slots, qkv, cos, sin)
    assert torch.equal(got, want) and torch.equal(kc, eager_k) and torch.equal(vc, eager_v)


CHILD = children.TRITON_INTERPRETER_PREAMBLE + r"""
from fa3_spec.eagle.rope_kv import fused_rope_kv_applies, rope_store_kv_fused, rope_store_kv_split

out = {"cases": [], "refused": {}}
g = torch.Generator().manual_seed(0)
L, N, P, HQ, H, D = 2, 5, 4, 3, 2, 20  # D/2 = 10, not a power of two: the block is masked
rows = L * N * P
for dtype in (torch.bfloat16, torch.float32):
    kc = torch.randn(L, N, P, H, D, generator=g).to(dtype)
    vc = torch.randn(L, N, P, H, D, generator=g).to(dtype)
    # A view with a row stride wider than its heads, as a slice of a bigger output.
    qkv = torch.randn(8, (HQ + 2 * H + 1) * D, generator=g).to(dtype).view(8, -1, D)[:, :HQ + 2 * H]
    ang = torch.rand(8, D // 2, generator=g) * 6.3
    cos, sin = ang.cos(), ang.sin()
    slots = torch.tensor([0, 5, rows - 1, 17, -1, rows, 10**6, 3])
    keep = (slots >= 0) & (slots < rows)
    want, got = (kc.clone(), vc.clone()), (kc.clone(), vc.clone())
    q_want = rope_store_kv_split(*want, slots[keep], qkv[keep], cos[keep], sin[keep], HQ)
    q_got = rope_store_kv_fused(*got, slots, qkv, cos, sin, HQ)
    ulp = torch.finfo(dtype).eps
    def close(a, b):  # float32 bitwise; bf16 within one unit: the interpreter
        # converts float32 to bf16 by truncation, torch by rounding to nearest
        if dtype == torch.float32:
            return torch.equal(a, b)
        a, b = a.float(), b.float()
        return bool(((a - b).abs() <= ulp * torch.maximum(a.abs(), b.abs())).all())
    out["cases"].append(dict(
        dtype=str(dtype), q_close=close(q_got[keep], q_want), q_all_rows=close(
            q_got, rope_store_kv_split(kc.clone(), vc.clone(), slots.clamp(0, rows - 1), qkv, cos, sin, HQ)),
        k_close=close(got[0], want[0]), v_equal=torch.equal(got[1], want[1]),
        changed=int((got[0] != kc).any(-1).any(-1).sum()), v_changed=int((got[1] != vc).any(-1).any(-1).sum())))
q = rope_store_kv_fused(kc, vc, torch.empty(0, dtype=torch.int64), qkv[:0], cos[:0], sin[:0], HQ)
out["empty"] = list(q.shape)

a = (kc, vc, slots, qkv, cos, sin, HQ)
out["applies"] = fused_rope_kv_applies(*a)
bad = {
    "strided cache": (kc.transpose(0, 1), vc.transpose(0, 1), *a[2:]),
    "mixed dtype": (kc, vc, slots, qkv.double(), *a[4:]),
    "float64 cos": (kc, vc, slots, qkv, cos.double(), sin.double(), HQ),
    "D stride 2": (kc, vc, slots, torch.ones(8, HQ + 2 * H, 2 * D, dtype=kc.dtype)[..., ::2], *a[4:]),
    "int32 slots": (kc, vc, slots.int(), *a[3:]),
    "cos stride 2": (kc, vc, slots, qkv, torch.ones(8, D)[:, ::2], torch.ones(8, D)[:, ::2], HQ),
    "slots stride 2": (kc, vc, torch.arange(16)[::2], *a[3:]),
}
for name, args in bad.items():
    out["refused"][name] = refusal(fused_rope_kv_applies, rope_store_kv_fused, *args)
print(json.dumps(out))
"""


@pytest.mark.children(job=children.triton_interpreter_job(CHILD))
def test_the_fused_kernel_matches_the_default_drops_slots_out_of_range_and_refuses_odd_layouts(child):
    doc = child.result()
    if "skip" in doc:
        pytest.skip(doc["skip"])
    assert len(doc["cases"]) == 2
    for case in doc["cases"]:
        # q of every token, k within one unit (FMA), v bitwise, only in-range slots.
        assert case["q_close"] and case["q_all_rows"] and case["k_close"] and case["v_equal"], case
        assert case["changed"] == 5 and case["v_changed"] == 5, case
    assert doc["empty"] == [0, 3, 20]
    assert doc["applies"]
    for name, (refused, raised) in doc["refused"].items():  # a TypeError naming the op either way
        assert refused and raised.startswith("rope_store_kv"), name


def test_no_launch_off_cuda_uses_pdl():
    from fa3_spec.triton_support import pdl_kwargs, pdl_launch

    assert not pdl_launch(torch.zeros(1))
    assert pdl_kwargs(False) == {} and pdl_kwargs(True) == {"launch_pdl": True}
