"""``fa3_spec::expand_attention``: the expand call's Triton kernel against the
reference, the op's fake and registration, and when `cascade_attention` routes
a call to it.

On CPU the kernel runs in Triton's interpreter, in a child process (as the
other kernels' tests). The CUDA side, against FA3: test_gpu_expand_attention.py.
"""

import pytest
import torch

import children
import fa3_spec
from fa3_spec.attention import (EXPAND_KERNELS, expand_attention, expand_call_applies,
                                expand_kernel, select_expand_kernel)
from fa3_spec.metadata import FA3Metadata

CHILD = children.TRITON_INTERPRETER_PREAMBLE + r"""
from fa3_spec.attention import expand_attention, expand_attention_triton, expand_kernel_applies

out = {"cases": [], "refused": {}}
g = torch.Generator().manual_seed(0)
S = 40
for dtype in (torch.float32, torch.float16):
    for hkv, group, d in ((2, 4, 32), (1, 1, 16), (3, 5, 64)):
        n, rows = 6, 10
        q = torch.randn(rows + 2, hkv * group, d, generator=g).to(dtype)
        k = torch.randn(S, 1, hkv, d, generator=g).to(dtype)
        v = torch.randn(S, 1, hkv, d, generator=g).to(dtype)
        # Slots out of the cache, a table narrower than the key bound, rows
        # with no key, a negative count, a count past the bound, a row with no
        # query, a query offset past q.
        pt = torch.randint(-5, S + 5, (rows, n - 2), generator=g, dtype=torch.int32)
        sl = torch.tensor([0, 1, 2, 3, 4, 5, 6, 99, -3, 2], dtype=torch.int32)
        cu = torch.tensor([0, 1, 2, 3, 3, 4, 5, 6, 7, 8, 40], dtype=torch.int32)
        want_o, want_l = expand_attention(q, k, v, pt, sl, cu, n, 0.3)
        got_o, got_l = expand_attention_triton(q, k, v, pt, sl, cu, n, 0.3)
        # Queries 0-8 have a row each (row 3 has none; row 9 claims 8 onwards,
        # past max_seqlen_q = 1, so only its first is compared).
        owned = torch.arange(q.shape[0]) < 9
        out["cases"].append(dict(
            dtype=str(dtype), hkv=hkv, group=group, d=d,
            applies=expand_kernel_applies(q, k, v, pt, sl, cu, n),
            out_err=(want_o[owned].float() - got_o[owned].float()).abs().max().item(),
            same_inf=torch.equal(torch.isinf(want_l[:, owned]), torch.isinf(got_l[:, owned])),
            lse_err=(want_l[:, owned] - got_l[:, owned]).nan_to_num(0, 0, 0).abs().max().item(),
            # Queries 0 and 7: rows with no key (count 0, count -3).
            empty_rows_zero=bool((got_o[[0, 7]] == 0).all()),
            empty_rows_lse=bool(torch.isneginf(got_l[:, [0, 7]]).all())))

# A row that claims three queries (max_seqlen_q = 1 says one): its first gets
# the row's attention, the other two 0 and -inf, never what the allocator left.
qx = torch.randn(4, 8, 32)
kx, vx = torch.randn(S, 1, 2, 32), torch.randn(S, 1, 2, 32)
cux = torch.tensor([0, 3, 4], dtype=torch.int32)
ptx, slx = torch.randint(0, S, (2, 4), generator=g, dtype=torch.int32), torch.tensor([3, 4], dtype=torch.int32)
want_o, want_l = expand_attention(qx, kx, vx, ptx, slx, cux, 4, 0.3)
got_o, got_l = expand_attention_triton(qx, kx, vx, ptx, slx, cux, 4, 0.3)
out["extra"] = dict(
    first=bool(torch.allclose(got_o[[0, 3]], want_o[[0, 3]], atol=1e-5)),
    zero=bool((got_o[1:3] == 0).all()), lse=bool(torch.isneginf(got_l[:, 1:3]).all()))

q = torch.randn(4, 8, 32)
k = torch.randn(S, 1, 2, 32)
v = torch.randn(S, 1, 2, 32)
pt = torch.zeros(4, 6, dtype=torch.int32)
sl = torch.full((4,), 3, dtype=torch.int32)
cu = torch.arange(5, dtype=torch.int32)
good = (q, k, v, pt, sl, cu, 6)
out["applies"] = expand_kernel_applies(*good)
bad = {
    "D not a power of two": (q[..., :24], k[..., :24], v[..., :24], pt, sl, cu, 6),
    "Dv != D": (q, k, torch.randn(S, 1, 2, 64), pt, sl, cu, 6),
    "page size 2": (q, k.view(S // 2, 2, 2, 32), v.view(S // 2, 2, 2, 32), pt, sl, cu, 6),
    "H_q not a multiple": (q[:, :7], k, v, pt, sl, cu, 6),
    "mixed dtype": (q.half(), k, v, pt, sl, cu, 6),
    "int64 table": (q, k, v, pt.long(), sl, cu, 6),
    "strided cache": (q, torch.randn(S, 1, 2, 64)[..., :32], v, pt, sl, cu, 6),
    "cu length": (q, k, v, pt, sl, cu[:-1], 6),
    "key bound 0": (q, k, v, pt, sl, cu, 0),
    "key bound above the tile": (q, k, v, pt, sl, cu, 129),
    "empty cache": (q, k[:0], v[:0], pt, sl, cu, 6),
}
for name, args in bad.items():  # the launch takes a softmax scale after the applies' arguments
    out["refused"][name] = refusal(expand_kernel_applies,
                                   lambda *a: expand_attention_triton(*a, 0.5), *args)
print(json.dumps(out))
"""


@pytest.mark.children(job=children.triton_interpreter_job(CHILD))
def test_the_kernel_reads_what_the_reference_reads_whatever_the_indices_hold(child):
    doc = child.result()
    if "skip" in doc:
        pytest.skip(doc["skip"])
    assert len(doc["cases"]) == 6
    for case in doc["cases"]:
        assert case["applies"], case
        tol = 1e-5 if case["dtype"] == "torch.float32" else 4e-3  # fp16: a few units
        assert case["out_err"] <= tol and case["lse_err"] <= 1e-4, case
        assert case["same_inf"] and case["empty_rows_zero"] and case["empty_rows_lse"], case
    assert doc["extra"] == dict(first=True, zero=True, lse=True)
    # ... and it refuses, by layout and size alone, what it cannot take.
    assert doc["applies"]
    for name, (refused, raised) in doc["refused"].items():
        assert refused and "expand_attention_triton" in raised, name


def _tensors(rows=5, hq=8, hkv=2, d=16, slots=30, n=4, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(rows, hq, d, generator=g).to(dtype)
    k = torch.randn(slots, 1, hkv, d, generator=g).to(dtype)
    v = torch.randn(slots, 1, hkv, d, generator=g).to(dtype)
    pt = torch.randint(0, slots, (rows, n), generator=g, dtype=torch.int32)
    sl = torch.randint(0, n + 1, (rows,), generator=g, dtype=torch.int32)
    cu = torch.arange(rows + 1, dtype=torch.int32)
    return q, k, v, pt, sl, cu


def test_the_op_has_a_fake_and_its_default_is_the_reference():
    q, k, v, pt, sl, cu = _tensors()
    torch.library.opcheck(expand_attention, (q, k, v, pt, sl, cu, 4, 0.25))
    md = FA3Metadata(pt, sl, cu, cu, 1, 4, 1, False)
    want = fa3_spec.attention.paged_attention_reference(q, k, v, md, 0.25)
    got = expand_attention(q, k, v, pt, sl, cu, 4, 0.25)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="page size 1"):
        expand_attention(q, k.view(15, 2, 2, 16), v.view(15, 2, 2, 16), pt, sl, cu, 4, 0.25)


def test_the_op_compiles_fullgraph():
    q, k, v, pt, sl, cu = _tensors()
    fn = torch.compile(lambda *a: expand_attention(*a, 4, 0.25), backend="aot_eager",
                       fullgraph=True)
    got, want = fn(q, k, v, pt, sl, cu), expand_attention(q, k, v, pt, sl, cu, 4, 0.25)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _md(max_q=1, page_size=1, window_left=-1):
    z = torch.zeros(2, dtype=torch.int32)
    return FA3Metadata(torch.zeros(2, 3, dtype=torch.int32), z, torch.zeros(3, dtype=torch.int32),
                       torch.zeros(3, dtype=torch.int32), max_q, 3, page_size, False, window_left)


@pytest.mark.parametrize("md, dtype, kw, applies", [
    (_md(), torch.bfloat16, {}, True),
    (_md(), torch.float16, {}, True),
    (_md(), torch.float32, {}, False),            # FA3 takes no fp32: neither path changes
    (_md(max_q=2), torch.bfloat16, {}, False),    # a prefix call
    (_md(page_size=2), torch.bfloat16, {}, False),
    (_md(window_left=4), torch.bfloat16, {}, False),
    (_md(), torch.bfloat16, {"window_size": (4, 0)}, False),
    (_md(), torch.bfloat16, {"softcap": 30.0}, False),
    (_md(), torch.bfloat16, {"descaled": True}, False),
], ids=["bf16", "fp16", "fp32", "prefix", "paged", "md-window", "window", "softcap", "fp8"])
def test_only_one_query_per_row_in_page_size_one_with_no_extras_is_an_expand_call(md, dtype, kw,
                                                                                 applies):
    args = dict(softcap=0.0, window_size=(-1, -1), descaled=False)
    args.update(kw)
    assert expand_call_applies(md, torch.zeros(1, 2, 16, dtype=dtype), **args) is applies


def test_select_expand_kernel_refuses_an_unknown_kernel():
    assert EXPAND_KERNELS == ("fa3", "triton") and expand_kernel() == "triton"  # the default
    with pytest.raises(ValueError, match="kernel must be one of"):
        select_expand_kernel("torch")
    assert expand_kernel() == "triton"


def test_an_expand_call_under_fa3_with_the_kernel_selected_goes_to_the_op():
    """On CPU the op's default is the reference: an expand call routed to it
    under ``"fa3"`` gives the torch backend's result (FA3 itself would refuse
    CPU tensors)."""
    from fa3_spec.attention import attention_call

    q, k, v, pt, sl, cu = _tensors()
    md = FA3Metadata(pt, sl, cu, cu, 1, 4, 1, False)
    want = attention_call(q, k, v, md, softmax_scale=0.25, attention_backend="torch")
    previous = select_expand_kernel("triton")
    try:
        got = attention_call(q, k, v, md, softmax_scale=0.25, attention_backend="fa3")
    finally:
        select_expand_kernel(previous)
    assert torch.equal(got[0], want[0].to(got[0].dtype)) and torch.equal(got[1], want[1])


def test_a_region_passes_the_kernel_s_tile_as_an_expand_call_s_key_bound():
    """FA3's equivalent bound (127 for 1-127 keys) shares one program among
    the draft steps; under the expand kernel the tile's bound does (16 for
    1-16 keys), so the kernel does not read a tile of 128 for 16 keys."""
    from fa3_spec.attention import expand_key_bound
    from fa3_spec.eagle.regions import _encode_metadata

    assert [expand_key_bound(n) for n in (1, 5, 16, 17, 128)] == [16, 16, 16, 32, 128]
    _, _, _, pt, sl, cu = _tensors()
    md = FA3Metadata(pt, sl, cu, cu, 1, 5, 1, False)
    previous = select_expand_kernel("fa3")
    try:
        assert _encode_metadata(md, fa3=True)[1][2] == 127
        select_expand_kernel("triton")
        assert _encode_metadata(md, fa3=True)[1][2] == 16
        assert _encode_metadata(md)[1][2] == 5  # no rewrite off FA3
    finally:
        select_expand_kernel(previous)
