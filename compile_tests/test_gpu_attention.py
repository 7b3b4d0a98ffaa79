"""Real FA3 on CUDA: cascade vs a float32 dense oracle, compile, capture.

Skipped without CUDA or without an FA3 provider. Run on the H200 (see
compile_tests/GPU_RESULTS.md for the command and the last summary).
"""


import pytest
import torch

import fa3_spec
from fa3_spec.attention import fa3_available
from fa3_spec import MODES, build_metadata as build
from fa3_spec.harness.oracle import dense_attention, expected_key_slots, num_queries
from fa3_spec.harness.worlds import fill_kv_cache, make_world
from fa3_spec.graphs import capture
from gpu_results import ResultsFile, rel_err as _rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not fa3_available(), reason="needs CUDA sm90 and an FA3 provider"),
]

HEADS, KV_HEADS = 8, 2
RESULTS = ResultsFile("FA3_SPEC_GPU_RESULTS")  # (test, case, max rel err) for the summary file


def _record(kind, case, err):
    RESULTS.record(kind, case, rel_err=err)


def _case(p, k, head_dim=128, n=8, steps=5, ctx=300):
    cfg = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=steps, num_draft_tokens=n,
                              max_bs=16, max_context_len=ctx)
    return cfg


GRID = [(p, k) for p in (1, 2, 16, 64) for k in (1, 4, 8)]


@pytest.mark.parametrize("p, k", GRID, ids=[f"P{p}-K{k}" for p, k in GRID])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_fa3_matches_dense_reference(p, k, mode, dtype):
    cfg = _case(p, k)
    world = make_world(cfg, 6, seq_lens=[1, p, 77, 300, 0, 2 * p + 1], seed=p * 31 + k, device="cuda")
    kc, vc = fill_kv_cache(world, num_kv_heads=KV_HEADS, head_dim=128, dtype=dtype, seed=k)
    worst = 0.0
    for tree in ([True, False] if mode == "target_verify" else [True]):
        for step in (range(cfg.num_steps - 1) if mode == "draft_decode" else [0]):
            md = build(mode, cfg, step=step, **world.mode_kwargs(mode, tree=tree, draft_attention="branch"))
            q = torch.randn(num_queries(world, mode), HEADS, 128, device="cuda", dtype=dtype)
            out = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="fa3")
            ref = dense_attention(q, kc, vc, expected_key_slots(world, mode, step=step, tree=tree, draft_attention="branch"))
            assert not torch.isnan(out).any()
            err = _rel_err(out, ref)
            worst = max(worst, err)
            assert err <= 1e-2, (mode, tree, step, err)
    _record("fa3_vs_dense", f"{mode} P={p} K={k}", worst)


@pytest.mark.parametrize("p, k", GRID, ids=[f"P{p}-K{k}" for p, k in GRID])
def test_fa3_ancestor_draft_decode_matches_dense_reference(p, k):
    """``draft_attention="ancestors"``: every draft step's prefix (the whole
    prefix, partial page included) + expand (page-size-1 view over the leaf's
    path) through FA3, against dense attention over the key-set oracle's keys."""
    cfg = _case(p, k)
    world = make_world(cfg, 6, seq_lens=[1, p, 77, 300, 0, 2 * p + 1], seed=p * 37 + k, device="cuda")
    kc, vc = fill_kv_cache(world, num_kv_heads=KV_HEADS, head_dim=128, dtype=torch.bfloat16, seed=k)
    worst = 0.0
    for step in range(cfg.num_steps - 1):
        kw = world.mode_kwargs("draft_decode", step=step, draft_attention="ancestors")
        prefix = fa3_spec.build_draft_prefix_metadata(
            cfg, req_to_token=kw["req_to_token"], req_pool_indices=kw["req_pool_indices"],
            seq_lens=kw["seq_lens"], draft_attention="ancestors")
        md = fa3_spec.build_draft_decode_metadata(cfg, step, draft_attention="ancestors",
                                                   prefix=prefix, **kw)
        q = torch.randn(num_queries(world, "draft_decode"), HEADS, 128, device="cuda",
                        dtype=torch.bfloat16)
        out = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="fa3")
        ref = dense_attention(q, kc, vc, expected_key_slots(world, "draft_decode", step=step,
                                                            draft_attention="ancestors"))
        assert not torch.isnan(out).any()
        err = _rel_err(out, ref)
        worst = max(worst, err)
        assert err <= 1e-2, (step, err)
    _record("fa3_vs_dense", f"draft_decode ancestors P={p} K={k}", worst)


@pytest.mark.parametrize("head_dim, dtype", [(64, torch.float16), (256, torch.bfloat16)])
def test_head_dims_and_fp16(head_dim, dtype):
    cfg = _case(2, 8)
    world = make_world(cfg, 3, seq_lens=[5, 100, 0], seed=1, device="cuda")
    kc, vc = fill_kv_cache(world, num_kv_heads=KV_HEADS, head_dim=head_dim, dtype=dtype)
    md = build("draft_decode", cfg, step=3, **world.mode_kwargs("draft_decode", draft_attention="branch"))
    q = torch.randn(num_queries(world, "draft_decode"), HEADS, head_dim, device="cuda", dtype=dtype)
    out = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="fa3")
    ref = dense_attention(q, kc, vc, expected_key_slots(world, "draft_decode", step=3, draft_attention="branch"))
    err = _rel_err(out, ref)
    _record("head_dim", f"D={head_dim} {dtype}", err)
    assert err <= 1e-2


@pytest.mark.parametrize("mode", MODES)
def test_empty_batch_and_all_padding(mode):
    cfg = _case(2, 8)
    for seqs in ([], [0, 0, 0]):
        world = make_world(cfg, len(seqs), seq_lens=seqs, device="cuda")
        kc, vc = fill_kv_cache(world, num_kv_heads=KV_HEADS, head_dim=128, dtype=torch.bfloat16)
        md = build(mode, cfg, step=1, **world.mode_kwargs(mode, draft_attention="branch"))
        q = torch.randn(num_queries(world, mode), HEADS, 128, device="cuda", dtype=torch.bfloat16)
        out = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="fa3")
        assert out.shape == q.shape and torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("mode", MODES)
def test_whole_step_compiles_captures_and_replays(mode):
    """Metadata + FA3 + merge: fullgraph inductor, one CUDA graph, fresh batches."""
    cfg = _case(2, 8)
    worlds = [make_world(cfg, 5, num_padding=1, seed=s, device="cuda") for s in range(4)]
    kc, vc = fill_kv_cache(worlds[0], num_kv_heads=KV_HEADS, head_dim=128, dtype=torch.bfloat16)
    names = [n for n, v in worlds[0].mode_kwargs(mode, draft_attention="branch").items() if v is not None and n != "req_to_token"]
    r2t = worlds[0].req_to_token  # engine-owned, same pool for every batch

    def step(q, *tensors):
        md = build(mode, cfg, step=3, req_to_token=r2t, **dict(zip(names, tensors)))
        return fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="fa3")

    nq = num_queries(worlds[0], mode)
    qs = [torch.randn(nq, HEADS, 128, device="cuda", dtype=torch.bfloat16) for _ in worlds]
    args = [[qs[i]] + [w.mode_kwargs(mode, draft_attention="branch")[n] for n in names] for i, w in enumerate(worlds)]
    # Same pool for all worlds: rebuild their batches over world 0's req_to_token.
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for a in args[:2]:
            torch.testing.assert_close(compiled(*a), step(*a), atol=2e-2, rtol=2e-2)
    static = [t.clone() for t in args[0]]
    graph, out = capture(compiled, *static, warmup=1)
    ptr = out.data_ptr()
    for a in args[1:]:
        for dst, src in zip(static, a):
            dst.copy_(src)
        graph.replay()
        want = step(*a)
        err = _rel_err(out, want.float())
        assert err <= 1e-2 and out.data_ptr() == ptr
    _record("capture_replay", mode, err)


def test_the_plan_fake_restates_fa3s_layout():
    """`fa3_scheduler_plan`'s fake gives the real plan's size (FA3 refuses
    a plan of another size; inductor asserts custom-op output sizes)."""
    from fa3_spec.attention import fa3_scheduler_plan, plan_entries

    cases = [(nq, causal, splits, d, (-1, -1)) for nq, causal, splits in
             ((1, True, 1), (1, False, 8), (16, True, 4), (16, False, 1)) for d in (64, 128, 256)]
    cases += [(nq, causal, 1, 128, w) for nq in (1, 16) for causal in (False, True)
              for w in ((100, -1), (100, 0), (-1, 3), (319, -1))]
    for rows in (1, 2, 3, 5, 8, 13, 64):
        seqlens = torch.full((rows,), 300, dtype=torch.int32, device="cuda")
        for nq, causal, splits, d, (left, right) in cases:
            cu = torch.arange(0, (rows + 1) * nq, nq, dtype=torch.int32, device="cuda")
            plan = fa3_scheduler_plan(seqlens, cu, nq, 320, HEADS, KV_HEADS, d, d,
                                      torch.bfloat16, 16, causal, splits, False, left, right)
            want = plan_entries(rows, causal=causal, max_seqlen_q=nq, max_seqlen_k=320,
                                head_dim=d, window_left=left, window_right=right)
            assert plan.dtype == torch.int32 and plan.shape == (want,), \
                (rows, nq, causal, splits, d, left, right, plan.shape)


@pytest.mark.parametrize("p, k", [(2, 8), (16, 4), (1, 1)])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_layers_sharing_a_plan_give_each_calls_own_bits(p, k, mode, splits):
    """Three layers' attention over one forward's metadata, sharing the plans
    of `fa3_plans`, eagerly and replayed from one CUDA graph that makes the
    plans too: bit for bit the output and LSE of calls that plan for themselves."""
    from fa3_spec.attention import fa3_plans

    cfg = _case(p, k)
    world = make_world(cfg, 6, seq_lens=[1, p, 77, 300, 0, 2 * p + 1], seed=p + k, device="cuda")
    kc, vc = fill_kv_cache(world, num_kv_heads=KV_HEADS, head_dim=128, dtype=torch.bfloat16, seed=k)
    steps = range(cfg.num_steps - 1) if mode == "draft_decode" else [0]
    for step in steps:
        md = build(mode, cfg, step=step, **world.mode_kwargs(mode, draft_attention="branch"))
        q = torch.randn(num_queries(world, mode), HEADS, 128, device="cuda", dtype=torch.bfloat16)
        kw = dict(attention_backend="fa3", num_splits=splits, return_lse=True)
        want = fa3_spec.cascade_attention(q, kc, vc, md, **kw)

        def layers():
            plans = fa3_plans(md, num_heads=HEADS, head_dim=128, k_cache=kc, v_cache=vc,
                              num_splits=splits)
            return [fa3_spec.cascade_attention(q, kc, vc, md, plans=plans, **kw)
                    for _ in range(3)]

        graph, captured = capture(layers, warmup=1)
        graph.replay()
        torch.cuda.synchronize()
        for got in layers() + captured:
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (mode, step)
    _record("shared_plan_bitwise", f"{mode} P={p} K={k} splits={splits}", 0.0)
