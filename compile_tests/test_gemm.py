"""`fa3_spec.eagle.gemm`: the skinny Triton GEMM against ``x @ w``, the op and
its fake, and `matmul`'s dispatch.

On CPU the kernel runs in Triton's interpreter in a child process (fp16:
the interpreter's bf16 ``tl.dot`` is not exact), with the Triton the sglang
parity tests use when none is installed. The CUDA side: test_gpu_gemm.py.
"""


import pytest
import torch

import children
from fa3_spec.eagle import gemm

CHILD = children.TRITON_INTERPRETER_PREAMBLE + r"""
from fa3_spec.eagle.gemm import TileConfig, skinny_applies, skinny_mm_triton, tile_config

g = torch.Generator().manual_seed(0)
out = {"cases": [], "refused": {}}
# (M, K, N): one slice and split K, tiles that divide the shapes and ones that do not.
for m, k, n in [(1, 512, 4096), (16, 512, 64), (5, 700, 130), (3, 1024, 300), (16, 96, 33)]:
    x = torch.randn(m, k, generator=g).half()
    w = (torch.randn(k, n, generator=g) * 0.05).half()
    ref = x.float() @ w.float()
    got = skinny_mm_triton(x, w)
    strided = torch.randn(m, 2 * k, generator=g).half()[:, ::2]  # no: the column stride is 2
    rowpad = torch.full((m, k + 8), float("nan")).half()  # a row stride of k + 8, NaN past K:
    rowpad[:, :k] = torch.randn(m, k, generator=g).half()  # a read past K shows
    rowpad = rowpad[:, :k]
    got_pad = skinny_mm_triton(rowpad, w)
    out["cases"].append(dict(m=m, k=k, n=n, split=tile_config(k, n).split, shape=list(got.shape),
                             dtype=str(got.dtype),
                             err=float((got.float() - ref).abs().max() / ref.abs().max()),
                             pad_err=float((got_pad.float() - rowpad.float() @ w.float()).abs().max()
                                           / ref.abs().max()),
                             strided_refused=not skinny_applies(strided, w)))
x, w = torch.randn(4, 64).half(), torch.randn(64, 32).half()
for cfg in [(16, 32, 2), (32, 16, 3), (64, 128, 1)]:  # explicit tiles, split K that does not divide K
    got = skinny_mm_triton(x, w, TileConfig(*cfg))
    out.setdefault("configs", []).append(float((got.float() - x.float() @ w.float()).abs().max()
                                               / (x.float() @ w.float()).abs().max()))
bad = {"17 rows": (torch.randn(17, 64).half(), w), "fp32": (x.float(), w.float()),
       "mixed dtype": (x, w.float()), "K mismatch": (x, w[:32]),
       "w transposed": (x, torch.randn(32, 64).half().t()), "3-D x": (x.view(2, 2, 64), w),
       "0 rows": (x[:0], w)}
for name, args in bad.items():
    out["refused"][name] = refusal(skinny_applies, skinny_mm_triton, *args)
print(json.dumps(out))
"""


@pytest.mark.children(job=children.triton_interpreter_job(CHILD))
def test_the_triton_kernel_matches_fp32_and_refuses_what_it_cannot_take(child):
    doc = child.result()
    if "skip" in doc:
        pytest.skip(doc["skip"])
    assert len(doc["cases"]) == 5
    assert {c["split"] for c in doc["cases"]} == {1, 4}  # both paths ran
    for case in doc["cases"]:
        assert case["shape"] == [case["m"], case["n"]] and case["dtype"] == "torch.float16", case
        assert case["err"] < 2e-3 and case["pad_err"] < 2e-3, case
        assert case["strided_refused"], case
    for name, (refused, raised) in doc["refused"].items():
        assert refused and "skinny_mm_triton" in raised, name
    assert len(doc["configs"]) == 3 and max(doc["configs"]) < 2e-3


@pytest.mark.parametrize("config", [(128, 64), (48, 64, 1), (128, 8, 1), (128, 64, 0), "128x64"])
def test_a_bad_tile_config_raises_naming_it(config):
    x, w = torch.randn(2, 64).half(), torch.randn(64, 32).half()
    with pytest.raises(ValueError, match="config must be a TileConfig"):
        gemm.skinny_mm_triton(x, w, config)


def test_tile_config_is_the_fitted_rule():
    assert gemm.tile_config(14336, 4096) == (128, 64, 4)   # down
    assert gemm.tile_config(4096, 4096) == (32, 256, 1)    # o
    assert gemm.tile_config(4096, 6144) == (64, 256, 1)    # fused qkv
    assert gemm.tile_config(4096, 28672) == (128, 64, 1)   # fused gate/up
    assert gemm.tile_config(4096, 128256) == (128, 64, 1)  # lm_head
    assert gemm.tile_config(192, 32) == (128, 64, 1)       # too short to split


def test_the_op_is_x_at_w_on_cpu_and_passes_opcheck():
    x, w = torch.randn(5, 24), torch.randn(24, 7)
    torch.testing.assert_close(gemm.skinny_mm(x, w), x @ w)
    torch.library.opcheck(torch.ops.fa3_spec.skinny_mm.default, (x, w),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("x_shape, w_shape, dtype, err, match", [
    ((4, 8), (9, 3), torch.float32, ValueError, "disagree on K"),
    ((4, 8, 1), (8, 3), torch.float32, ValueError, "must be 2-D"),
    ((4, 8), (8, 3), torch.float64, TypeError, "share a dtype"),
])
def test_bad_shapes_and_dtypes_raise_naming_them(x_shape, w_shape, dtype, err, match):
    x, w = torch.randn(*x_shape), torch.randn(*w_shape, dtype=dtype)
    with pytest.raises(err, match=match):
        gemm.skinny_mm(x, w)
    with pytest.raises(err, match=match), torch._subclasses.FakeTensorMode():
        gemm.skinny_mm(torch.empty(*x_shape), torch.empty(*w_shape, dtype=dtype))


def test_matmul_keeps_x_at_w_on_cpu_and_flattens_leading_dims():
    x, w = torch.randn(2, 3, 16), torch.randn(16, 5)
    torch.testing.assert_close(gemm.matmul(x, w), x @ w)
    # Under compile the CPU graph holds no custom op: inductor sees the matmul as before.
    found = []

    def backend(gm, inputs):
        found.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch.compile(gemm.matmul, backend=backend, fullgraph=True)(x, w)
    assert not any("skinny_mm" in t for t in found) and found


def test_the_op_compiles_fullgraph_with_a_dynamic_row_count_in_one_frame():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda x, w: gemm.skinny_mm(x, w) + 1, backend=counter, fullgraph=True,
                       dynamic=True)
    w = torch.randn(16, 4)
    for m in (2, 3, 9):
        x = torch.randn(m, 16)
        torch.testing.assert_close(fn(x, w), x @ w + 1)
    assert counter.frame_count == 1


def test_x_and_w_on_two_devices_raise_naming_them():
    with pytest.raises(ValueError, match="x and w must be on one device"), \
            torch._subclasses.FakeTensorMode():
        gemm.skinny_mm(torch.empty(2, 8), torch.empty(8, 3, device="meta"))


def test_kernels_are_chosen_by_a_dataclass_and_restored():
    """Each op's CUDA implementation is chosen by `select_kernels`, never by the
    environment; a bad choice names its field, and the previous choice restores."""
    from fa3_spec.attention import expand_kernel
    from fa3_spec.eagle.kernels import Kernels, select_kernels, selected_kernels
    from fa3_spec.triton_support import pdl_launch

    start = selected_kernels()  # Kernels() unless the run passed --kernels
    assert expand_kernel() == start.expand_attention
    other = Kernels(gemm="cublas", store_kv="index_copy", rope_kv="split",
                    expand_attention="fa3" if start.expand_attention == "triton" else "triton",
                    pdl=False)
    previous = select_kernels(other)
    try:
        assert previous == start and selected_kernels() == other
        assert expand_kernel() == other.expand_attention
    finally:
        select_kernels(previous)
    assert selected_kernels() == start and not pdl_launch(torch.zeros(1))
    assert expand_kernel() == start.expand_attention
    for field, value in (("gemm", "cutlass"), ("store_kv", "scatter"), ("rope_kv", "triton"),
                         ("expand_attention", "cuda")):
        with pytest.raises(ValueError, match=f"{field} must be one of"):
            Kernels(**{field: value})
    with pytest.raises(TypeError, match="pdl must be a bool"):
        Kernels(pdl="off")
    with pytest.raises(TypeError, match="kernels must be a Kernels"):
        select_kernels({"gemm": "cublas"})


def test_kernels_parse_from_name_value_pairs():
    from fa3_spec.eagle.kernels import Kernels, parse_kernels

    assert parse_kernels([]) == Kernels()
    assert parse_kernels(["expand_attention=fa3", "pdl=off"]) == Kernels(
        expand_attention="fa3", pdl=False)
    for pairs, says in ((["gemm"], "expected NAME=VALUE"), (["speed=fast"], "expected NAME=VALUE"),
                        (["pdl=no"], "pdl must be on or off"), (["rope_kv=x"], "rope_kv must be"),
                        (["gemm=cublas", "gemm=cublas"], "gemm given twice")):
        with pytest.raises(ValueError, match=says):
            parse_kernels(pairs)
