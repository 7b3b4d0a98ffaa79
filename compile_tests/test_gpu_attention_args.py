"""Real FA3 with its per-layer arguments: FA3 vs the torch reference backend.

Sinks (every cascade shape and single call, and against FA3's own ``sinks``
on single calls), FP8 KV with per-request descales (both calls of a
cascade), ``window_size`` on single calls, softcap refused in Python, the
capability table checked against a probe of the build, the empty-row LSE
this build returns (recorded, for the docs), and a compiled + captured step
with the new arguments.

Skipped without CUDA sm90 and an FA3 provider. On the H200::

    FA3_SPEC_ATTN_ARGS_RESULTS=attn_args.json python3 -m pytest -v -s \\
        compile_tests/test_gpu_attention_args.py
"""

import dataclasses

import pytest
import torch

import fa3_spec
from fa3_spec.attention import fa3_available, fa3_paged_attention, providers, provider_version
from fa3_spec.harness.worlds import fill_kv_cache, make_world, rebase_world
from fa3_spec.harness.oracle import num_queries
from fa3_spec.graphs import capture
from gpu_results import ResultsFile, rel_err as _rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not fa3_available(), reason="needs CUDA sm90 and an FA3 provider"),
]

FP8 = torch.float8_e4m3fn
HEADS, KV_HEADS, DIM = 8, 2, 128
_record = ResultsFile("FA3_SPEC_ATTN_ARGS_RESULTS").record


def _world(p, k, seq_lens=(1, 77, 300, 0, 19), seed=0):
    cfg = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=5, num_draft_tokens=8, max_bs=16,
                              max_context_len=300)
    return make_world(cfg, len(seq_lens), seq_lens=[max(s, 0) for s in seq_lens],
                      seed=seed + 31 * p + k, device="cuda")


CASCADES = ([("draft_decode", p, k, True) for p in (1, 2, 16, 64) for k in (4, 8)]
            + [("target_verify", p, 8, True) for p in (1, 2, 16, 64)])
SINGLES = ([("decode", p, 1, True) for p in (1, 16)] + [("draft_decode", p, 1, True) for p in (1, 16)]
           + [("target_verify", p, 1, False) for p in (1, 16)] + [("draft_extend", p, 1, True) for p in (1, 16)])


def _ids(cases):
    return [f"{m}{'' if tree else '-chain'}-P{p}-K{k}" for m, p, k, tree in cases]


def _compare(mode, p, k, tree, *, fp8=False, tol=1e-2, **kw):
    """FA3 vs torch backend for every step of ``mode``; returns the worst relative error."""
    world = _world(p, k)
    kc, vc = fill_kv_cache(world, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=torch.bfloat16, seed=k)
    g = torch.Generator(device="cuda").manual_seed(p * 7 + k)
    if fp8:
        kc, vc = kc.to(FP8), vc.to(FP8)
        for name in ("q_descale", "k_descale", "v_descale"):
            kw[name] = torch.rand(world.batch_size, KV_HEADS, device="cuda", generator=g) * 1.5 + 0.5
    worst = 0.0
    steps = range(world.cfg.num_steps - 1) if mode == "draft_decode" else [0]
    for step in steps:
        md = fa3_spec.build_metadata(mode, world.cfg, step=step, **world.mode_kwargs(mode, tree=tree, draft_attention="branch"))
        q = torch.randn(num_queries(world, mode), HEADS, DIM, device="cuda", generator=g,
                        dtype=torch.bfloat16)
        out, lse = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="fa3",
                                              return_lse=True, **kw)
        ref, ref_lse = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch",
                                                  return_lse=True, **kw)
        assert torch.isfinite(out).all(), (mode, step)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), (mode, step)
        finite = torch.isfinite(ref_lse)
        lse_err = float((lse[finite] - ref_lse[finite]).abs().max()) if finite.any() else 0.0
        err = _rel_err(out, ref)
        worst = max(worst, err)
        assert err <= tol and lse_err <= 5 * tol, (mode, step, err, lse_err)
    return worst


def _sinks(seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # bf16-representable values, as FA3's own sinks argument takes them.
    return (torch.randn(HEADS, device="cuda", generator=g) * 2 + 2).to(torch.bfloat16).float()


@pytest.mark.parametrize("mode, p, k, tree", CASCADES + SINGLES, ids=_ids(CASCADES + SINGLES))
def test_sinks_fa3_matches_reference(mode, p, k, tree):
    err = _compare(mode, p, k, tree, sinks=_sinks(p + k))
    _record("sinks", f"{mode} P={p} K={k}", rel_err=err)


@pytest.mark.parametrize("mode, p, k, tree", CASCADES + SINGLES, ids=_ids(CASCADES + SINGLES))
def test_fp8_kv_with_per_request_descales_fa3_matches_reference(mode, p, k, tree):
    """q bf16, quantised by fa3_spec with q_descale; both backends read the same FP8 values."""
    err = _compare(mode, p, k, tree, fp8=True, tol=6e-2, sinks=_sinks(1))
    _record("fp8_kv", f"{mode} P={p} K={k}", rel_err=err)


WINDOWS = [(0, -1), (5, -1), (64, -1), (299, -1), (16, 0)]


@pytest.mark.parametrize("window", WINDOWS, ids=[f"W{w[0]}_{w[1]}" for w in WINDOWS])
@pytest.mark.parametrize("mode, p, k, tree", SINGLES, ids=_ids(SINGLES))
def test_window_on_single_calls_fa3_matches_reference(mode, p, k, tree, window):
    err = _compare(mode, p, k, tree, window_size=window)
    _record("window", f"{mode} P={p} W={window}", rel_err=err)


@pytest.mark.parametrize("window", [(3, 2), (0, 0), (-1, 1), (6, -1)])
def test_window_on_non_causal_multi_query_rows_is_refused_on_both_backends(window):
    """Chain-verify metadata made non-causal: N queries per row. FA3 would align a window
    as if the queries were consecutive; fa3_spec's non-causal multi-query calls (cascade
    prefixes) are not, so both backends refuse instead of computing it."""
    world = _world(16, 1)
    kc, vc = fill_kv_cache(world, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=torch.bfloat16)
    md = fa3_spec.build_metadata("target_verify", world.cfg, **world.mode_kwargs("target_verify", tree=False, draft_attention="branch"))
    md = dataclasses.replace(md, causal=False)
    q = torch.randn(num_queries(world, "target_verify"), HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    for backend in ("fa3", "torch"):
        with pytest.raises(ValueError, match="non-causal"):
            fa3_spec.cascade_attention(q, kc, vc, md, attention_backend=backend, window_size=window)

@pytest.mark.parametrize("mode, tree", [("decode", True), ("target_verify", False)])
def test_our_sink_equals_fa3s_own_sinks_argument_on_a_single_call(mode, tree):
    """Pins the sink's units and that FA3's LSE includes it (live rows only)."""
    world = _world(16, 1, seq_lens=(1, 77, 300, 19))
    kc, vc = fill_kv_cache(world, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=torch.bfloat16)
    md = fa3_spec.build_metadata(mode, world.cfg, **world.mode_kwargs(mode, tree=tree, draft_attention="branch"))
    q = torch.randn(num_queries(world, mode), HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    sinks = _sinks(3)
    ours, ours_lse = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="fa3",
                                                sinks=sinks, return_lse=True)
    native, native_lse, *_ = providers.kvcache_forward()(
        q, kc, vc, cache_seqlens=md.cache_seqlens, page_table=md.page_table, cu_seqlens_q=md.cu_seqlens_q,
        max_seqlen_q=md.max_seqlen_q, softmax_scale=DIM ** -0.5, causal=md.causal, num_splits=1,
        sinks=sinks.to(torch.bfloat16), return_softmax_lse=True)
    err = _rel_err(ours, native)
    lse_err = float((ours_lse - native_lse).abs().max())
    _record("sink_vs_native", mode, rel_err=err, lse_abs_err=lse_err)
    assert err <= 1e-2 and lse_err <= 1e-2


def test_softcap_is_refused_in_python_naming_the_provider():
    if providers.provider_supports("softcap"):
        pytest.skip(f"{provider_version()} supports softcap")
    world = _world(2, 1)
    kc, vc = fill_kv_cache(world, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=torch.bfloat16)
    md = fa3_spec.build_metadata("decode", world.cfg, **world.mode_kwargs("decode", draft_attention="branch"))
    q = torch.randn(world.batch_size, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="softcap=30.0 is not supported by the FA3 provider"):
        fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="fa3", softcap=30.0)
    ref = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch", softcap=30.0)
    assert torch.isfinite(ref).all()
    _record("softcap", "refused", provider=provider_version())


def test_capability_table_agrees_with_a_probe_of_the_build():
    probed = {f: providers._probe(f) for f in providers.FEATURES}
    table = providers.provider_features()
    _record("capabilities", providers.provider_distribution() or "unknown", probed=probed,
            table=sorted(table))
    assert probed == {f: f in table for f in providers.FEATURES}


def test_record_the_lse_fa3_returns_for_empty_rows():
    """Which non-finite LSE this build gives a row with cache_seqlens = 0 (pins the docs)."""
    k = torch.randn(8, 2, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(4, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    table = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32, device="cuda")
    seqlens = torch.tensor([3, 0, 2], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device="cuda")  # query 3 unowned
    seen = {}
    for splits in (1, 4, 16):
        for causal in (False, True):
            _, lse = fa3_paged_attention(q, k, v, table, seqlens, cu, 1, DIM ** -0.5, causal, splits)
            empty = lse[:, 1]
            assert not torch.isfinite(empty).any(), empty
            assert torch.isfinite(lse[:, [0, 2]]).all()
            seen[f"splits={splits} causal={causal}"] = sorted({str(x) for x in empty.tolist()})
    _record("empty_row_lse", "cache_seqlens=0", values=seen)
    assert all(set(v) <= {"inf", "-inf"} for v in seen.values()), seen
    md = fa3_spec.FA3Metadata(table, seqlens, cu, torch.tensor([0, 3, 3, 5], dtype=torch.int32, device="cuda"),
                              1, 4, 2, False)
    out, lse = fa3_spec.cascade_attention(q, k, v, md, attention_backend="fa3", return_lse=True)
    assert torch.isneginf(lse[:, 1:2]).all() and torch.isneginf(lse[:, 3]).all()
    assert torch.equal(out[[1, 3]], torch.zeros_like(out[[1, 3]]))


def test_step_with_sinks_and_fp8_compiles_captures_and_replays():
    """Draft cascade (P = 2, topk = 8): metadata + FA3 (FP8) + merge + sink + ``out=``, one CUDA graph."""
    worlds = [_world(2, 8, seq_lens=s, seed=i) for i, s in enumerate([(5, 77, 300, 0), (1, 2, 3, 250),
                                                                        (299, 0, 0, 64)])]
    r2t = worlds[0].req_to_token
    kc, vc = fill_kv_cache(worlds[0], num_kv_heads=KV_HEADS, head_dim=DIM, dtype=torch.bfloat16)
    kc, vc = kc.to(FP8), vc.to(FP8)
    cfg = worlds[0].cfg

    def step(q, sinks, kd, vd, rpi, seq, loc, buf=None):
        md = fa3_spec.build_draft_decode_metadata(cfg, 3, draft_attention="branch",
                                                  req_to_token=r2t, req_pool_indices=rpi,
                                                  seq_lens=seq, out_cache_loc=loc)
        return fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="fa3", sinks=sinks,
                                          k_descale=kd,
                                          v_descale=vd, out=buf)

    def args(w, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        w = rebase_world(w, r2t)
        q = torch.randn(num_queries(w, "draft_decode"), HEADS, DIM, device="cuda", generator=g,
                        dtype=torch.bfloat16)
        kd, vd = (torch.rand(w.batch_size, KV_HEADS, device="cuda", generator=g) + 0.5 for _ in range(2))
        return [q, _sinks(seed), kd, vd, w.req_pool_indices, w.seq_lens, w.out_cache_loc]

    batches = [args(w, i) for i, w in enumerate(worlds)]
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(compiled(*batches[0]), step(*batches[0]), atol=2e-2, rtol=2e-2)
    static = [t.clone() for t in batches[0]]
    buf = torch.full_like(static[0], float("nan"))  # the caller's output buffer
    static.append(buf)
    graph, out = capture(compiled, *static, warmup=1)
    worst = 0.0
    for batch in batches[1:]:
        for dst, src in zip(static, batch):
            dst.copy_(src)
        buf.fill_(float("nan"))
        graph.replay()
        want = step(*batch)
        assert torch.equal(buf, out)  # written in place by the replay
        ref = fa3_spec.cascade_attention(batch[0], kc, vc, fa3_spec.build_draft_decode_metadata(
            cfg, 3, draft_attention="branch", req_to_token=r2t, req_pool_indices=batch[4], seq_lens=batch[5], out_cache_loc=batch[6]),
            attention_backend="torch", sinks=batch[1], k_descale=batch[2], v_descale=batch[3])
        worst = max(worst, _rel_err(out, want))
        assert _rel_err(out, want) <= 1e-2 and _rel_err(out, ref) <= 6e-2
    _record("capture_replay", "draft P=2 K=8 fp8+sinks", rel_err_vs_eager=worst)
