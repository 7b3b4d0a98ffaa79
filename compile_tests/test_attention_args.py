"""FA3's per-layer arguments through `cascade_attention` (CPU, torch backend).

Every argument (sinks, softcap, FP8 KV descales, window_size) through every
metadata shape (draft topk > 1 cascade at P in {1, 2, 16}, tree-verify
cascade, and the single calls) against a float64 dense oracle written here:
softmax over each query's exact key set, with the sink as one more logit of
value 0, softcap on the scaled scores, the window counted in token positions
and FP8 values dequantised with their request's scales. Plus: compile
(aot_eager, fullgraph), ``out=``, the static checks on ``q`` and the cache,
the empty-row LSE normalisation and the
provider capability check. About 25 s on 2 cores.
"""

import dataclasses

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fa3_spec
from fa3_spec.attention import add_attention_sink, merge_attention_states, providers
from fa3_spec.attention import cascade as cascade_mod
from fa3_spec.harness.oracle import expected_key_slots, num_queries
from fa3_spec.harness.worlds import fill_kv_cache, make_world

FP8 = torch.float8_e4m3fn
HQ, HKV, DIM = 4, 2, 16

# (id, mode, page size, topk, tree)
CASCADES = [(f"draft_cascade-P{p}", "draft_decode", p, 4, True) for p in (1, 2, 16)] + [
    (f"tree_verify-P{p}", "target_verify", p, 4, True) for p in (1, 2, 16)]
SINGLES = [
    ("decode", "decode", 2, 4, True),
    ("draft_topk1", "draft_decode", 2, 1, True),
    ("chain_verify", "target_verify", 2, 4, False),
    ("draft_extend", "draft_extend", 2, 4, True),
]


def _world(p, k, seed=0, bs=4):
    cfg = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=3, num_draft_tokens=5, max_bs=8,
                              max_context_len=40)
    return make_world(cfg, bs, num_padding=1, seed=seed + 7 * p + k)


def _steps(world, mode):
    return range(world.cfg.num_steps - 1) if mode == "draft_decode" else [0]


def _metadata(world, mode, step, tree):
    return fa3_spec.build_metadata(mode, world.cfg, step=step, **world.mode_kwargs(mode, tree=tree, draft_attention="branch"))


def _query_requests(world, mode):
    """The request of each query, in ``q`` order (extend: packed live queries only)."""
    cfg, bs = world.cfg, world.batch_size
    if mode == "decode" or (mode == "draft_decode" and cfg.topk == 1):
        return list(range(bs))
    if mode == "draft_decode":
        return [b for b in range(bs) for _ in range(cfg.topk)]
    if mode == "target_verify":
        return [b for b in range(bs) for _ in range(cfg.num_draft_tokens)]
    ext = world.extend_seq_lens.tolist()
    return [b for b in range(bs) for _ in range(ext[b] if world.seq_lens[b] > 0 else 0)]


def oracle(q, kc, vc, key_slots, requests, *, scale=DIM ** -0.5, softcap=0.0, left=-1, sinks=None,
           q_descale=None, k_descale=None, v_descale=None):
    """float64 ``(out [T, H, D], lse [H, T])``: per query, softmax over its keys (+ sink).

    ``key_slots[i]`` are query ``i``'s keys in position order, the last one at
    the query's own position (single calls), so a left window ``W`` keeps the
    last ``W + 1``. Queries past ``len(key_slots)`` see no key. Descales are
    ``[B, H_kv]``, indexed by the query's request.
    """
    total, hq, dim = q.shape
    hkv = kc.shape[2]
    g = hq // hkv
    kf = kc.reshape(-1, hkv, dim).double()
    vf = vc.reshape(-1, hkv, vc.shape[-1]).double()
    out = torch.zeros(total, hq, vc.shape[-1], dtype=torch.float64)
    lse = torch.full((hq, total), float("-inf"), dtype=torch.float64)
    for i in range(total):
        slots = list(key_slots[i]) if i < len(key_slots) else []
        if left >= 0:
            slots = slots[max(0, len(slots) - 1 - left):]
        qi = q[i].double()
        k, v = kf[slots], vf[slots]  # [L, Hkv, D]
        if slots:
            b = requests[i]
            if q_descale is not None:
                qi = qi * q_descale[b].double().repeat_interleave(g)[:, None]
            if k_descale is not None:
                k = k * k_descale[b].double()[None, :, None]
            if v_descale is not None:
                v = v * v_descale[b].double()[None, :, None]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        logits = torch.einsum("hd,lhd->hl", qi, k) * scale
        if softcap > 0:
            logits = softcap * torch.tanh(logits / softcap)
        if sinks is not None:
            logits = torch.cat([logits, sinks.double()[:, None]], dim=1)
            v = torch.cat([v, torch.zeros(1, hq, v.shape[-1], dtype=torch.float64)])
        if logits.shape[1] == 0:
            continue
        lse[:, i] = torch.logsumexp(logits, dim=-1)
        out[i] = torch.einsum("hl,lhd->hd", logits.softmax(-1), v)
    return out, lse


def _args(name, world, single, g):
    """Keyword arguments of ``cascade_attention`` and of the oracle for argument set ``name``."""
    bs = world.batch_size
    kw, ref = {}, {}
    if name in ("sinks", "all"):
        kw["sinks"] = ref["sinks"] = torch.randn(HQ, generator=g) * 2 + 1
    if name in ("softcap", "all"):
        kw["softcap"] = ref["softcap"] = 1.5
    if name in ("window", "all") and single:
        kw["window_size"] = (3, -1)
        ref["left"] = 3
    if name in ("fp8", "all"):
        for d in ("q_descale", "k_descale", "v_descale"):
            kw[d] = ref[d] = torch.rand(bs, HKV, generator=g) * 1.5 + 0.5
    return kw, ref


def _check_case(mode, p, k, tree, name, single):
    world = _world(p, k)
    kc, vc = fill_kv_cache(world, num_kv_heads=HKV, head_dim=DIM)
    fp8 = name in ("fp8", "all")
    if fp8:
        kc, vc = kc.to(FP8), vc.to(FP8)
    g = torch.Generator().manual_seed(1)
    for step in _steps(world, mode):
        md = _metadata(world, mode, step, tree)
        assert isinstance(md, fa3_spec.CascadeMetadata) != single
        q = torch.randn(num_queries(world, mode), HQ, DIM, generator=g)
        if fp8:
            q = q.to(FP8)
        kw, ref_kw = _args(name, world, single, g)
        out, lse = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch",
                                              return_lse=True, **kw)
        slots = expected_key_slots(world, mode, step=step, tree=tree, draft_attention="branch")
        requests = _query_requests(world, mode)
        want, want_lse = oracle(q, kc, vc, slots, requests, **ref_kw)
        assert out.dtype == (torch.bfloat16 if fp8 else torch.float32)
        tol = 2e-2 if fp8 else 2e-5  # bf16 output for FP8 KV
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=2e-5)
        # The argument must matter here, or the comparison proves nothing.
        plain, plain_lse = oracle(q, kc, vc, slots, requests)
        assert not torch.allclose(want_lse, plain_lse, atol=1e-3) or not torch.allclose(want, plain, atol=1e-3)


@pytest.mark.parametrize("name", ["sinks", "softcap", "fp8", "all"])
@pytest.mark.parametrize("case", CASCADES, ids=[c[0] for c in CASCADES])
def test_each_argument_through_cascades_matches_dense_oracle(case, name):
    _, mode, p, k, tree = case
    _check_case(mode, p, k, tree, name, single=False)


@pytest.mark.parametrize("name", ["sinks", "softcap", "fp8", "window", "all"])
@pytest.mark.parametrize("case", SINGLES, ids=[c[0] for c in SINGLES])
def test_each_argument_through_single_calls_matches_dense_oracle(case, name):
    _, mode, p, k, tree = case
    _check_case(mode, p, k, tree, name, single=True)


def test_sink_enters_the_denominator_once_not_once_per_call():
    """Upstream's cascade gives both calls the sink; merged, it counts twice."""
    world = _world(2, 4, bs=3)
    kc, vc = fill_kv_cache(world, num_kv_heads=HKV, head_dim=DIM)
    md = _metadata(world, "draft_decode", 1, True)
    q = torch.randn(num_queries(world, "draft_decode"), HQ, DIM)
    sinks = torch.full((HQ,), 3.0)
    ours = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch", sinks=sinks)
    slots = expected_key_slots(world, "draft_decode", step=1, draft_attention="branch")
    want, _ = oracle(q, kc, vc, slots, _query_requests(world, "draft_decode"), sinks=sinks)
    torch.testing.assert_close(ours.double(), want, atol=2e-5, rtol=2e-5)
    # Each call's own (out, lse) with the sink, then merged: the upstream way.
    parts = []
    for call in md.calls:
        o, l = fa3_spec.cascade_attention(q, kc, vc, call, attention_backend="torch",
                                          return_lse=True)
        parts += list(add_attention_sink(o, l, sinks))
    twice, _ = merge_attention_states(*parts)
    assert (twice.double() - want).abs().max() > 1e-2


def test_query_with_no_key_and_a_sink_gets_zero_output_and_the_sink_as_lse():
    world = _world(2, 4, bs=3)  # last row is padding
    kc, vc = fill_kv_cache(world, num_kv_heads=HKV, head_dim=DIM)
    sinks = torch.tensor([0.5, -1.0, 2.0, 7.0])
    for mode in ("draft_decode", "target_verify", "decode"):
        md = _metadata(world, mode, 0, True)
        q = torch.randn(num_queries(world, mode), HQ, DIM)
        out, lse = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch", sinks=sinks,
                                              return_lse=True)
        pad = torch.tensor(_query_requests(world, mode)) == 2
        assert pad.any()
        assert torch.equal(out[pad], torch.zeros_like(out[pad]))
        assert torch.equal(lse[:, pad], sinks[:, None].expand(-1, int(pad.sum())))
        assert torch.isfinite(out).all()


def test_window_is_refused_on_non_causal_multi_query_rows():
    """A non-causal call with several queries per row: FA3 would align a window as if the
    queries sat at consecutive positions, which fa3_spec's own such calls (cascade
    prefixes) do not. Refused rather than silently wrong."""
    g = torch.Generator().manual_seed(3)
    kc, vc = torch.randn(6, 4, HKV, DIM, generator=g), torch.randn(6, 4, HKV, DIM, generator=g)
    md = fa3_spec.FA3Metadata(
        page_table=torch.tensor([[4, 1, 3], [2, 0, 0], [0, 0, 0]], dtype=torch.int32),
        cache_seqlens=torch.tensor([9, 3, 0], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 3, 6, 6], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 9, 12, 12], dtype=torch.int32),
        max_seqlen_q=3, max_seqlen_k=12, page_size=4, causal=False)
    q = torch.randn(9, HQ, DIM, generator=g)
    for window in [(2, 1), (0, 0), (-1, 1), (1, -1)]:
        with pytest.raises(ValueError, match="non-causal"):
            fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch", window_size=window)
    fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch", window_size=(-1,
                                                                                      -1))  # no window: fine


def test_a_huge_window_size_is_refused_by_name_not_overflowed():
    world = _world(2, 1)
    kc, vc = fill_kv_cache(world, num_kv_heads=HKV, head_dim=DIM)
    md = _metadata(world, "decode", 0, False)
    q = torch.randn(num_queries(world, "decode"), HQ, DIM)
    for window in [(2**64, 0), (2**63, -1), (0, 2**70)]:
        with pytest.raises(ValueError, match="window_size"):
            fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch", window_size=window)
    wide = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch", window_size=(2**62,
                                                                                             0))
    full = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch")
    torch.testing.assert_close(wide, full)


def test_window_on_a_cascade_asks_for_sliding_window_metadata():
    world = _world(2, 4)
    kc, vc = fill_kv_cache(world, num_kv_heads=HKV, head_dim=DIM)
    md = _metadata(world, "draft_decode", 0, True)
    q = torch.randn(num_queries(world, "draft_decode"), HQ, DIM)
    with pytest.raises(ValueError, match="sliding-window metadata"):
        fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch", window_size=(8, -1))


def test_bf16_q_is_quantised_to_fp8_with_its_requests_q_descale():
    world = _world(2, 4)
    kc, vc = fill_kv_cache(world, num_kv_heads=HKV, head_dim=DIM)
    kc, vc = kc.to(FP8), vc.to(FP8)
    g = torch.Generator().manual_seed(5)
    qd = torch.rand(world.batch_size, HKV, generator=g) + 0.5
    for mode in ("draft_decode", "target_verify", "draft_extend"):
        md = _metadata(world, mode, 1, True)
        q = torch.randn(num_queries(world, mode), HQ, DIM, generator=g).to(torch.bfloat16)
        req = torch.tensor(_query_requests(world, mode) + [0] * q.shape[0])[: q.shape[0]]
        manual = (q.float() / qd[req].repeat_interleave(HQ // HKV, 1)[..., None]).to(FP8)
        got = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch", q_descale=qd)
        want = fa3_spec.cascade_attention(manual, kc, vc, md, attention_backend="torch",
                                          q_descale=qd)
        assert got.dtype == torch.bfloat16
        live = torch.zeros(q.shape[0], dtype=torch.bool)
        live[: len(_query_requests(world, mode))] = True  # unowned extend rows are 0 either way
        assert torch.equal(got[live], want[live]) and torch.equal(got[~live], want[~live])


@pytest.mark.parametrize("mode, p, k, fp8, window", [
    ("draft_decode", 2, 4, True, (-1, -1)),
    ("target_verify", 2, 4, False, (-1, -1)),
    ("draft_extend", 2, 4, True, (4, -1)),
], ids=["draft_cascade-fp8", "tree_verify", "extend-window-fp8"])
def test_metadata_and_attention_with_every_argument_compile_fullgraph(mode, p, k, fp8, window):
    """aot_eager, fullgraph, no recompile on new values; equal to eager."""
    worlds = [_world(p, k, seed=s) for s in range(2)]
    g = torch.Generator().manual_seed(2)
    names = [n for n, v in worlds[0].mode_kwargs(mode, draft_attention="branch").items() if v is not None]
    cfg = worlds[0].cfg

    def step(q, kc, vc, sinks, kd, vd, *tensors):
        md = fa3_spec.build_metadata(mode, cfg, step=1, **dict(zip(names, tensors)))
        return fa3_spec.cascade_attention(
            q, kc, vc, md, attention_backend="torch", sinks=sinks, softcap=2.0, window_size=window,
            k_descale=kd, v_descale=vd, return_lse=True)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for w in worlds:
            kc, vc = fill_kv_cache(w, num_kv_heads=HKV, head_dim=DIM, seed=int(w.seq_lens.sum()))
            kd = vd = None
            if fp8:
                kc, vc = kc.to(FP8), vc.to(FP8)
                kd, vd = (torch.rand(w.batch_size, HKV, generator=g) + 0.5 for _ in range(2))
            q = torch.randn(num_queries(w, mode), HQ, DIM, generator=g).to(torch.bfloat16)
            args = [q, kc, vc, torch.randn(HQ, generator=g), kd, vd] + [w.mode_kwargs(mode, draft_attention="branch")[n] for n in names]
            (got, got_lse), (want, want_lse) = compiled(*args), step(*args)
            torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)


def _fake_provider(monkeypatch, features, label="flash_attn_interface (tokenspeed-fa3 3.0.0)"):
    monkeypatch.setattr(providers, "provider_features", lambda: frozenset(features))
    monkeypatch.setattr(providers, "provider_version", lambda: label)


def test_fa3_op_traces_with_the_new_arguments(monkeypatch):
    """make_fx with fake tensors: FP8 + window reach the op, output bf16, num_splits static."""
    _fake_provider(monkeypatch, {"fp8_kv"})
    world = _world(2, 4)
    kc, vc = fill_kv_cache(world, num_kv_heads=HKV, head_dim=64, dtype=torch.bfloat16)
    kc, vc = kc.to(FP8), vc.to(FP8)
    kd = torch.rand(world.batch_size, HKV) + 0.5

    def step(q, kc, vc, kd, sinks, r2t, rpi, seq):
        md = fa3_spec.build_decode_metadata(world.cfg, req_to_token=r2t, req_pool_indices=rpi,
                                            seq_lens=seq)
        return fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="fa3", window_size=(8,
                                                                                               0),
                                          k_descale=kd, v_descale=kd, sinks=sinks)

    q = torch.randn(world.batch_size, HQ, 64, dtype=torch.bfloat16)
    gm = make_fx(step, tracing_mode="fake")(q, kc, vc, kd, torch.zeros(HQ), world.req_to_token,
                                            world.req_pool_indices, world.seq_lens)
    calls = [n for n in gm.graph.nodes if n.target == torch.ops.fa3_spec.fa3_paged_attention.default]
    assert len(calls) == 1
    args = calls[0].args
    assert args[2].meta["val"].dtype == FP8 and args[0].meta["val"].dtype == FP8  # q quantised
    assert args[9] >= 1 and (args[11], args[12]) == (8, 0)  # num_splits, window
    assert args[13] is None and args[14] is not None and args[15] is not None  # descales
    out_node = [n for n in gm.graph.nodes if n.op == "output"][0]
    assert out_node.args[0].meta["val"].dtype == torch.bfloat16


def test_dynamo_traces_the_fa3_path_and_its_capability_check_in_one_graph(monkeypatch):
    """fullgraph dynamo over metadata + FA3 op (fake outputs) with FP8 and a cascade."""
    _fake_provider(monkeypatch, {"fp8_kv"})
    world = _world(2, 4)
    kc, vc = fill_kv_cache(world, num_kv_heads=HKV, head_dim=64, dtype=torch.bfloat16)
    kc, vc = kc.to(FP8), vc.to(FP8)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        outs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        shapes = [(o.meta["example_value"].shape, o.meta["example_value"].dtype) for o in outs]
        return lambda *a: [torch.zeros(s, dtype=d) for s, d in shapes]

    def step(q, kc, vc, kd, r2t, rpi, seq, loc):
        md = fa3_spec.build_draft_decode_metadata(world.cfg, 1, draft_attention="branch",
                                                  req_to_token=r2t, req_pool_indices=rpi,
                                                  seq_lens=seq, out_cache_loc=loc)
        return fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="fa3", k_descale=kd,
                                          v_descale=kd,
                                          sinks=kd.new_ones(HQ), num_splits=1)

    q = torch.randn(num_queries(world, "draft_decode"), HQ, 64, dtype=torch.bfloat16)
    out = torch.compile(step, fullgraph=True, backend=recording)(
        q, kc, vc, torch.ones(world.batch_size, HKV), world.req_to_token, world.req_pool_indices,
        world.seq_lens, world.out_cache_loc)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and len(graphs) == 1
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("fa3_paged_attention" in str(t) for t in ops) == 2  # prefix + expand


def test_softcap_on_a_provider_without_it_is_a_clear_python_error(monkeypatch):
    _fake_provider(monkeypatch, {"fp8_kv"})
    world = _world(1, 1)
    kc, vc = fill_kv_cache(world, num_kv_heads=HKV, head_dim=DIM, dtype=torch.bfloat16)
    md = _metadata(world, "decode", 0, True)
    q = torch.randn(world.batch_size, HQ, DIM, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"softcap=30.0 is not supported by the FA3 provider "
                                                  r"flash_attn_interface \(tokenspeed-fa3"):
        fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="fa3", softcap=30.0)

    def step(q):
        return fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="fa3", softcap=30.0)

    with pytest.raises(Exception, match="softcap=30.0 is not supported by the FA3 provider"):
        torch.compile(step, fullgraph=True, backend="eager")(q)
    # The torch backend implements it.
    assert torch.isfinite(fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch",
                                                     softcap=30.0)).all()


@pytest.mark.skipif(torch.cuda.is_available() and providers.find_provider() is not None,
                    reason="an FA3 provider and a GPU are here")
def test_fa3_features_without_a_provider_say_so():
    """On this CPU machine there is no provider: asking FA3 for softcap or FP8 says so."""
    assert providers.provider_features() == frozenset()
    assert "softcap" not in providers.KNOWN_FEATURES["tokenspeed-fa3"]
    world = _world(1, 1)
    kc, vc = fill_kv_cache(world, num_kv_heads=HKV, head_dim=DIM)
    md = _metadata(world, "decode", 0, True)
    q = torch.randn(world.batch_size, HQ, DIM)
    with pytest.raises(NotImplementedError, match="none is available here"):
        fa3_spec.cascade_attention(q, kc.to(FP8), vc.to(FP8), md, attention_backend="fa3")


def test_out_is_written_in_place_and_returned():
    world = _world(2, 4)
    kc, vc = fill_kv_cache(world, num_kv_heads=HKV, head_dim=DIM)
    md = _metadata(world, "draft_decode", 1, True)
    q = torch.randn(num_queries(world, "draft_decode"), HQ, DIM)
    sinks = torch.randn(HQ)
    want = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch", sinks=sinks)
    buf = torch.full_like(q, float("nan"))
    got = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch", sinks=sinks, out=buf)
    assert got is buf and torch.equal(buf, want)

    def step(q, buf):
        return fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch", sinks=sinks,
                                          out=buf)

    buf2 = torch.full_like(q, float("nan"))
    got2 = torch.compile(step, fullgraph=True, backend="aot_eager")(q, buf2)
    assert got2.data_ptr() == buf2.data_ptr()
    torch.testing.assert_close(buf2, want)


def _decode_setup(p=2, k=4, dtype=torch.float32):
    world = _world(p, k, bs=3)
    kc, vc = fill_kv_cache(world, num_kv_heads=HKV, head_dim=DIM, dtype=dtype)
    return world, kc, vc


@pytest.mark.parametrize("bad, exc, match", [
    (dict(out=torch.zeros(3, HQ, DIM)), ValueError, r"out must be \[total_q, H_q, Dv\]"),
    (dict(out=torch.zeros(12, HQ, DIM, dtype=torch.bfloat16)), TypeError, "out must be torch.float32"),
    (dict(sinks=torch.zeros(HKV)), ValueError, r"sinks must be \[H_q\]"),
    (dict(sinks=torch.zeros(HQ, dtype=torch.int64)), TypeError, "sinks must be floating"),
    (dict(k_descale=torch.ones(3, HKV)), ValueError, "k_descale applies to FP8 KV caches"),
    (dict(softcap=-1.0), ValueError, "softcap must be a finite float >= 0"),
    (dict(softcap=torch.tensor(1.0)), TypeError, "softcap must be a Python float"),
    (dict(window_size=(2,)), ValueError, "window_size must be a pair"),
    (dict(window_size=(-2, 0)), ValueError, "window_size entries"),
    (dict(num_splits=0), ValueError, "num_splits must be a static int >= 1"),
])
def test_argument_errors_name_the_argument(bad, exc, match):
    world, kc, vc = _decode_setup()
    md = _metadata(world, "draft_decode", 0, True)
    q = torch.randn(num_queries(world, "draft_decode"), HQ, DIM)
    with pytest.raises(exc, match=match):
        fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch", **bad)


@pytest.mark.parametrize("q_dtype, cache_dtype, kw, match", [
    (FP8, torch.bfloat16, {}, "an FP8 q needs FP8"),
    (torch.bfloat16, torch.float8_e5m2, {}, "FP8 KV caches must be torch.float8_e4m3fn"),
    (torch.bfloat16, FP8, dict(k_descale=torch.ones(2, HKV)), None),
])
def test_fp8_errors(q_dtype, cache_dtype, kw, match):
    world, kc, vc = _decode_setup()
    md = _metadata(world, "draft_decode", 0, True)
    q = torch.randn(num_queries(world, "draft_decode"), HQ, DIM).to(q_dtype)
    if match is None:  # descale of the wrong batch: a shape error naming it
        with pytest.raises(ValueError, match=r"k_descale must be \[B, H_kv\].*= \[3, 2\], got \[2, 2\]"):
            fa3_spec.cascade_attention(q, kc.to(cache_dtype), vc.to(cache_dtype), md,
                                       attention_backend="torch", **kw)
        return
    with pytest.raises(TypeError, match=match):
        fa3_spec.cascade_attention(q, kc.to(cache_dtype), vc.to(cache_dtype), md,
                                   attention_backend="torch", **kw)


# ---- static checks of q and of the cache view -------------------------------


def test_q_with_fewer_rows_than_the_metadata_bound_is_rejected():
    """The reported case: 5 query rows for metadata of 3 requests x 4 queries.

    Before the check, the torch backend clamped its gathers and returned 5
    rows silently; FA3 would have read 7 rows past ``q``.
    """
    world, kc, vc = _decode_setup(p=2, k=4)
    md = _metadata(world, "draft_decode", 0, True)
    assert md.prefix.num_rows == 3 and md.prefix.max_seqlen_q == 4
    with pytest.raises(ValueError, match=r"q has 5 query rows, but the prefix call has 3 rows of up to "
                                         r"max_seqlen_q=4 .* at least 12 rows"):
        fa3_spec.cascade_attention(torch.randn(5, HQ, DIM), kc, vc, md, attention_backend="torch")
    single = _metadata(world, "target_verify", 0, False)  # 3 requests x N = 5
    with pytest.raises(ValueError, match="the single call has 3 rows"):
        fa3_spec.cascade_attention(torch.randn(14, HQ, DIM), kc, vc, single,
                                   attention_backend="torch")


def test_q_sized_at_the_static_bound_is_accepted_for_draft_extend():
    world, kc, vc = _decode_setup(p=2, k=4)
    md = _metadata(world, "draft_extend", 0, True)
    n = world.cfg.num_draft_tokens
    assert int(md.cu_seqlens_q[-1]) < 3 * n  # packed: fewer real queries than rows of q
    out = fa3_spec.cascade_attention(torch.randn(3 * n, HQ, DIM), kc, vc, md,
                                     attention_backend="torch")
    assert out.shape[0] == 3 * n
    # More rows than the bound: allowed, the extra rows belong to no request and get 0.
    out = fa3_spec.cascade_attention(torch.randn(3 * n + 2, HQ, DIM), kc, vc, md,
                                     attention_backend="torch")
    assert torch.equal(out[3 * n:], torch.zeros_like(out[3 * n:]))


def test_q_must_be_floating_point():
    world, kc, vc = _decode_setup()
    md = _metadata(world, "decode", 0, True)
    with pytest.raises(TypeError, match="q must be a floating-point tensor"):
        fa3_spec.cascade_attention(torch.zeros(3, HQ, DIM, dtype=torch.int32), kc, vc, md,
                                   attention_backend="torch")


def test_a_non_viewable_cache_gets_a_clear_error_on_the_tree_verify_expand_call():
    world, kc, vc = _decode_setup(p=2, k=4)
    md = _metadata(world, "target_verify", 0, True)  # expand reads single-token pages
    q = torch.randn(num_queries(world, "target_verify"), HQ, DIM)
    want = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch")
    # Same values, stored token-major: [P, pages, H, D] permuted to [pages, P, H, D].
    kp = kc.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)
    vp = vc.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)
    assert torch.equal(kp, kc) and not kp.is_contiguous()
    with pytest.raises(ValueError, match=r"k_cache must be contiguous across its page and token dims"):
        fa3_spec.cascade_attention(q, kp, vp, md, attention_backend="torch")
    # The prefix call alone (page size unchanged) needs no view and reads the permuted cache.
    got = fa3_spec.cascade_attention(q, kp, vp, md.prefix, attention_backend="torch")
    torch.testing.assert_close(got, fa3_spec.cascade_attention(q, kc, vc, md.prefix,
                                                               attention_backend="torch"))
    assert want.shape == got.shape
    # A permutation of the head dims is fine: the view only merges pages and tokens.
    kh = kc.permute(0, 1, 3, 2).contiguous().permute(0, 1, 3, 2)
    vh = vc.permute(0, 1, 3, 2).contiguous().permute(0, 1, 3, 2)
    torch.testing.assert_close(fa3_spec.cascade_attention(q, kh, vh, md,
                                                          attention_backend="torch"), want)


# ---- FA3's empty-row LSE, whichever sign, is normalised -----------------------


@pytest.mark.parametrize("empty_lse", [float("inf"), float("-inf"), float("nan")])
def test_fa3_empty_rows_are_normalised_whatever_lse_the_build_returns(monkeypatch, empty_lse):
    """Stand in for the kernel: rows 1 and 3 are empty, query 4 is unowned (garbage out)."""
    lse_raw = torch.tensor([[0.5, empty_lse, 1.0, empty_lse, 123.0]]).expand(HQ, 5).clone()
    out_raw = torch.full((5, HQ, DIM), 7.0)
    out_raw[1] = out_raw[3] = float("nan")

    def fake_kernel(q, *args):
        return out_raw.clone(), lse_raw.clone()

    monkeypatch.setattr(cascade_mod, "fa3_paged_attention", fake_kernel)
    md = fa3_spec.FA3Metadata(
        page_table=torch.zeros(4, 1, dtype=torch.int32),
        cache_seqlens=torch.tensor([3, 0, 2, 0], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 3, 3, 5, 5], dtype=torch.int32),
        max_seqlen_q=1, max_seqlen_k=4, page_size=4, causal=True)
    kc = torch.zeros(2, 4, HKV, DIM)
    q = torch.zeros(5, HQ, DIM)
    out, lse = cascade_mod.attention_call(q, kc, kc, md, softmax_scale=1.0,
                                          attention_backend="fa3", num_splits=1)
    want_lse = torch.tensor([0.5, float("-inf"), 1.0, float("-inf"), float("-inf")])
    assert torch.equal(lse, want_lse.expand(HQ, 5))
    assert torch.equal(out[[0, 2]], out_raw[[0, 2]]) and torch.equal(out[[1, 3, 4]], torch.zeros(3, HQ, DIM))
    # And through a cascade merge plus a sink: still 0 / the sink, never NaN.
    merged, mlse = merge_attention_states(out, lse, out, lse)
    sunk, slse = add_attention_sink(merged, mlse, torch.full((HQ,), 2.0))
    assert torch.isfinite(sunk).all() and torch.equal(slse[:, 1], torch.full((HQ,), 2.0))


def test_same_rows_metadata_dataclass_replace_keeps_checks():
    """An inconsistent hand-made metadata is refused before any call."""
    world, kc, vc = _decode_setup()
    md = _metadata(world, "decode", 0, True)
    bad = dataclasses.replace(md, cu_seqlens_q=md.cu_seqlens_q[:-1])
    with pytest.raises(ValueError, match="inconsistent"):
        fa3_spec.cascade_attention(torch.randn(3, HQ, DIM), kc, vc, bad, attention_backend="torch")


def test_a_sink_of_minus_inf_is_no_sink_and_never_nan():
    world = _world(2, 4, bs=3)  # last row is padding
    kc, vc = fill_kv_cache(world, num_kv_heads=HKV, head_dim=DIM)
    md = _metadata(world, "draft_decode", 0, True)
    q = torch.randn(num_queries(world, "draft_decode"), HQ, DIM)
    want, want_lse = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch",
                                                return_lse=True)
    got, got_lse = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch",
                                              return_lse=True,
                                              sinks=torch.full((HQ,), float("-inf")))
    assert torch.isneginf(want_lse).any()  # the padding row's queries
    torch.testing.assert_close(got, want)
    assert torch.equal(got_lse, want_lse)


def test_a_window_on_a_non_causal_multi_query_call_is_refused():
    cfg = fa3_spec.SpecConfig(page_size=1, topk=4, num_steps=3, num_draft_tokens=4, max_bs=4,
                              max_context_len=16)
    w = make_world(cfg, 1, seq_lens=[10])
    prefix = fa3_spec.build_draft_prefix_metadata(cfg, **w.batch(), draft_attention="branch")
    kv = torch.randn(w.num_pages, 1, 1, 8)
    with pytest.raises(ValueError, match="non-causal"):
        fa3_spec.cascade_attention(torch.randn(4, 1, 8), kv, kv, prefix, attention_backend="torch",
                                   window_size=(3, -1))


def test_sinks_keep_float64():
    cfg = fa3_spec.SpecConfig(page_size=2, topk=1, num_steps=2, num_draft_tokens=1, max_bs=4,
                              max_context_len=16)
    w = make_world(cfg, 2, seq_lens=[7, 3])
    md = fa3_spec.build_decode_metadata(cfg, **w.batch())
    g = torch.Generator().manual_seed(0)
    k = torch.randn(w.num_pages, 2, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(w.num_pages, 2, 2, 8, generator=g, dtype=torch.float64)
    q = torch.randn(2, 2, 8, generator=g, dtype=torch.float64)
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    out, lse = fa3_spec.cascade_attention(q, k, v, md, attention_backend="torch", sinks=sinks,
                                          return_lse=True)
    assert out.dtype == torch.float64
    base, base_lse = fa3_spec.cascade_attention(q, k, v, md, attention_backend="torch",
                                                return_lse=True)
    want = base * torch.sigmoid(base_lse - sinks[:, None]).transpose(0, 1).unsqueeze(-1)
    assert torch.allclose(out, want, atol=1e-12, rtol=1e-12)


# Provider discovery inside a compiled step
def test_provider_discovery_is_a_constant_after_one_eager_call(monkeypatch):
    from fa3_spec.probes import graph_breaks

    monkeypatch.setattr(providers, "_FOUND", {})

    def uses_provider(x):
        return x + (1 if providers.find_provider() is None else 2)

    with pytest.raises(Exception, match="cannot happen inside torch.compile"):
        torch.compile(uses_provider, fullgraph=True, backend="eager")(torch.zeros(2))
    torch._dynamo.reset()
    eager = uses_provider(torch.zeros(2))  # discovers (an import), outside any compiled region
    breaks, reasons = graph_breaks(uses_provider, torch.zeros(2))
    assert breaks == 0, reasons
    assert torch.equal(torch.compile(uses_provider, fullgraph=True, backend="eager")(torch.zeros(2)),
                       eager)


def test_a_window_past_the_key_bound_reaches_fa3_as_unbounded(monkeypatch):
    seen = []

    def fake_kernel(q, k, v, table, seqlens, cu_q, max_q, scale, causal, splits, softcap,
                    left, right, *rest):
        seen.append((left, right))
        return torch.zeros(q.shape[0], q.shape[1], v.shape[-1]), torch.zeros(q.shape[1], q.shape[0])

    monkeypatch.setattr(cascade_mod, "fa3_paged_attention", fake_kernel)
    cfg = fa3_spec.SpecConfig(page_size=2, topk=1, num_steps=3, num_draft_tokens=3, max_bs=4,
                              max_context_len=16)
    w = make_world(cfg, 2, seq_lens=[9, 16], seed=3)
    kv = torch.zeros(w.num_pages, 2, 1, 8)
    q = torch.zeros(2, 1, 8)
    for window, md in [((2**40, 0), fa3_spec.build_decode_metadata(cfg, **w.batch())),
                       (None, fa3_spec.build_metadata("decode", cfg, **w.mode_kwargs("decode", draft_attention="branch"),
                                                      window_left=2**40)),
                       ((3, 0), fa3_spec.build_decode_metadata(cfg, **w.batch()))]:
        kw = {} if window is None else dict(window_size=window)
        cascade_mod.attention_call(q, kv, kv, md, softmax_scale=1.0, attention_backend="fa3",
                                   num_splits=1,
                                   **kw)
    assert seen == [(-1, 0), (-1, 0), (3, 0)]
