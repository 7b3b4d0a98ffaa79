"""`fa3_spec.eagle.fused`: RMSNorm and SwiGLU fused into the skinny GEMM.

On CPU the fused kernel and the row kernels run in Triton's interpreter in a
child process (fp16, as test_gemm.py), against the fp32 compositions; the
ops, their fakes and the wrappers' CPU path run here. The CUDA side:
test_gpu_gemm.py.
"""

import pytest
import torch

import children
from fa3_spec.eagle import fused, gemm

CHILD = children.TRITON_INTERPRETER_PREAMBLE + r"""
from fa3_spec.eagle import fused
from fa3_spec.eagle.gemm import RMS_NORM, SWIGLU, TileConfig, launch, prologue_applies

g = torch.Generator().manual_seed(0)


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def ref_norm(x, deltas, gain, w, eps):
    s = x.float()
    for d in deltas:
        s = s + d.float()
    s = s.half()  # the stream, rounded once
    sf = s.float()
    return s, (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps) * gain.float()) @ w.float()


out = {"norm": [], "swiglu": [], "rows": [], "refused": {}}
# (M, K, N): tiles that divide the shapes and ones that do not; 0, 1 and 2 deltas.
for (m, k, n), nd in [((1, 512, 256), 2), ((16, 256, 64), 1), ((5, 700, 130), 2), ((3, 96, 33), 0)]:
    x = torch.randn(m, k, generator=g).half()
    deltas = [torch.randn(m, k, generator=g).half() for _ in range(nd)]
    gain = (1 + 0.1 * torch.randn(k, generator=g)).half()
    w = (torch.randn(k, n, generator=g) * 0.05).half()
    s_ref, ref = ref_norm(x, deltas, gain, w, 1e-5)
    got = launch(x, w, prologue=RMS_NORM, deltas=deltas, gain=gain, eps=1e-5, store_sum=nd > 0)
    got, s = got if nd else (got, s_ref)
    h, s_rows = fused._add_rms_norm_rows(x, deltas, gain, 1e-5, nd > 0)
    out["norm"].append(dict(m=m, k=k, n=n, nd=nd, shape=list(got.shape), err=rel(got, ref),
                            sum_exact=bool(torch.equal(s, s_ref)),
                            rows_err=rel(h.float() @ w.float(), ref),
                            rows_sum_exact=nd == 0 or bool(torch.equal(s_rows, s_ref))))
for m, i, n in [(1, 1024, 64), (4, 300, 70), (16, 192, 32)]:  # split K (I >= 3N) and one slice
    gu = torch.randn(m, 2 * i, generator=g).half()
    w = (torch.randn(i, n, generator=g) * 0.05).half()
    gate, up = gu.float().chunk(2, -1)
    ref = (gate * torch.sigmoid(gate) * up) @ w.float()
    got = launch(gu, w, prologue=SWIGLU)
    out["swiglu"].append(dict(m=m, i=i, n=n, err=rel(got, ref),
                              rows_err=rel(fused._swiglu_rows(gu).float() @ w.float(), ref)))
x, w, gain = torch.randn(4, 64).half(), torch.randn(64, 32).half(), torch.ones(64).half()
bad = {
    "split K with the norm": dict(prologue=RMS_NORM, gain=gain, config=TileConfig(16, 16, 2)),
    "no gain": dict(prologue=RMS_NORM),
    "a gain without the norm": dict(gain=gain),
    "three deltas": dict(prologue=RMS_NORM, gain=gain, deltas=[x, x, x]),
    "a delta of another shape": dict(prologue=RMS_NORM, gain=gain, deltas=[x[:2]]),
    "a gain of another length": dict(prologue=RMS_NORM, gain=gain[:32]),
    "swiglu on K columns": dict(prologue=SWIGLU),
}
for name, kw in bad.items():
    try:
        launch(x, w, **kw)
        raised = ""
    except TypeError as e:
        raised = str(e)
    out["refused"][name] = [not prologue_applies(x, w, **kw), raised]
print(json.dumps(out))
"""


@pytest.mark.children(job=children.triton_interpreter_job(CHILD))
def test_the_fused_prologues_and_the_row_kernels_match_fp32(child):
    doc = child.result()
    if "skip" in doc:
        pytest.skip(doc["skip"])
    assert len(doc["norm"]) == 4 and len(doc["swiglu"]) == 3
    for case in doc["norm"]:
        assert case["shape"] == [case["m"], case["n"]], case
        assert case["err"] < 3e-3 and case["rows_err"] < 3e-3, case
        assert case["sum_exact"] and case["rows_sum_exact"], case
    for case in doc["swiglu"]:
        assert case["err"] < 3e-3 and case["rows_err"] < 3e-3, case
    assert len(doc["refused"]) == 7
    for name, (refused, raised) in doc["refused"].items():
        assert refused and "skinny_mm_triton" in raised, name


def _norm_args(m=3, k=16, n=5, nd=2, dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(m, k, dtype=dtype)
    return x, [torch.randn(m, k, dtype=dtype) for _ in range(nd)], torch.rand(k, dtype=dtype) + 0.5, \
        torch.randn(k, n, dtype=dtype)


def test_the_ops_are_the_compositions_on_cpu_and_pass_opcheck():
    x, deltas, gain, w = _norm_args()
    s = x + deltas[0] + deltas[1]
    out, total = fused.rms_norm_mm(x, deltas, gain, w, 1e-6, True)
    torch.testing.assert_close(total, s)
    torch.testing.assert_close(out, fused.rms_norm(s, gain, 1e-6) @ w)
    for args in [(x, deltas, gain, w, 1e-6, True), (x, deltas[:1], gain, w, 1e-6, False),
                 (x, [], gain, w, 1e-5, False)]:
        torch.library.opcheck(torch.ops.fa3_spec.rms_norm_mm.default, args,
                              test_utils=("test_schema", "test_faketensor"))
    gu, wd = torch.randn(4, 12), torch.randn(6, 3)
    gate, up = gu.chunk(2, -1)
    torch.testing.assert_close(fused.swiglu_mm(gu, wd), (torch.nn.functional.silu(gate) * up) @ wd)
    torch.library.opcheck(torch.ops.fa3_spec.swiglu_mm.default, (gu, wd),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("change, err, match", [
    (dict(w=(15, 5)), ValueError, "disagree on K"),
    (dict(x=(3, 16, 1)), ValueError, "must be 2-D"),
    (dict(deltas=[(2, 16)]), ValueError, r"deltas\[0\] must have x's shape"),
    (dict(deltas=[(3, 16)] * 3), ValueError, "at most 2 deltas"),
    (dict(gain=(8,)), ValueError, r"gain must be \[K\]"),
    (dict(gain=((16,), torch.float64)), TypeError, "gain must have x's dtype"),
    (dict(deltas=[], return_sum=True), ValueError, "return_sum needs deltas"),
])
def test_bad_norm_arguments_raise_naming_them(change, err, match):
    """Eagerly and under fake tensors (what a compile traces with)."""
    spec = dict(x=(3, 16), deltas=[(3, 16)] * 2, gain=(16,), w=(16, 5), return_sum=False) | change

    def make(s):
        shape, dtype = s if isinstance(s[0], tuple) else (s, torch.float32)
        return torch.randn(shape, dtype=dtype)

    def args():
        return dict(x=make(spec["x"]), deltas=[make(d) for d in spec["deltas"]],
                    gain=make(spec["gain"]), w=make(spec["w"]), eps=1e-6,
                    return_sum=spec["return_sum"])

    with pytest.raises(err, match=match):
        fused.rms_norm_mm(**args())
    with pytest.raises(err, match=match), torch._subclasses.FakeTensorMode():
        fused.rms_norm_mm(**args())


def test_a_delta_on_another_device_raises_naming_it():
    with pytest.raises(ValueError, match=r"deltas\[0\] must be on x's device"), \
            torch._subclasses.FakeTensorMode():
        fused.rms_norm_mm(torch.empty(2, 8), [torch.empty(2, 8, device="meta")], torch.empty(8),
                          torch.empty(8, 3), 1e-6, False)


@pytest.mark.parametrize("gu_shape, w_shape, dtype, err, match", [
    ((4, 12), (5, 3), torch.float32, ValueError, "disagree on I"),
    ((4, 12, 1), (6, 3), torch.float32, ValueError, "must be 2-D"),
    ((4, 12), (6, 3), torch.float64, TypeError, "share a dtype"),
])
def test_bad_swiglu_arguments_raise_naming_them(gu_shape, w_shape, dtype, err, match):
    with pytest.raises(err, match=match):
        fused.swiglu_mm(torch.randn(*gu_shape), torch.randn(*w_shape, dtype=dtype))


def test_the_wrappers_keep_the_plain_compositions_on_cpu():
    x, deltas, gain, w = _norm_args(m=6, nd=2)
    x3 = x.view(2, 3, 16)
    d3 = [d.view(2, 3, 16) for d in deltas]
    s, out = fused.rms_norm_matmul(x3, gain, w, 1e-6, deltas=d3, return_sum=True)
    want_s = (x + deltas[0]) + deltas[1]
    assert torch.equal(s, want_s.view(2, 3, 16))
    assert torch.equal(out, gemm.matmul(fused.rms_norm(want_s, gain, 1e-6), w).view(2, 3, 5))
    same, _ = fused.rms_norm_matmul(x, gain, w, 1e-6, return_sum=True)
    assert same is x  # no deltas: the sum is x itself
    gu, wd = torch.randn(2, 3, 12), torch.randn(6, 4)
    assert torch.equal(fused.swiglu_matmul(gu, wd), gemm.matmul(fused.swiglu(gu), wd))
    # Under compile the CPU graph holds no custom op: inductor fuses the norm as before.
    found = []

    def backend(gm, inputs):
        found.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    w12 = torch.randn(16, 12)
    torch.compile(lambda a, b, c: fused.swiglu_matmul(
        fused.rms_norm_matmul(a, gain, w12, 1e-6, deltas=[b]), c),
        backend=backend, fullgraph=True)(x3, d3[0], wd)
    assert found and not any("fa3_spec" in t for t in found)


def test_the_ops_compile_fullgraph_with_a_dynamic_row_count_in_one_frame():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")

    def fn(x, d, gain, w, wd):
        out, s = fused.rms_norm_mm(x, [d], gain, w, 1e-6, True)
        return fused.swiglu_mm(out, wd) + s.sum()

    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    _, _, gain, w = _norm_args(k=16, n=8)
    wd = torch.randn(4, 3)
    for m in (2, 3, 9):
        x, d = torch.randn(m, 16), torch.randn(m, 16)
        torch.testing.assert_close(compiled(x, d, gain, w, wd), fn(x, d, gain, w, wd))
    assert counter.frame_count == 1
