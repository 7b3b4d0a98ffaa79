"""Attention on CPU: the torch backend vs the dense SPEC oracle, the merge, the FA3 op's fake."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fa3_spec
from fa3_spec.attention import merge_attention_states
from fa3_spec import MODES, build_metadata as build
from fa3_spec.harness.oracle import dense_attention, expected_key_slots, num_queries
from fa3_spec.harness.worlds import fill_kv_cache, make_world

CONFIGS = [(1, 1), (2, 8), (3, 3), (16, 4)]


@pytest.mark.parametrize("p, k", CONFIGS, ids=[f"P{p}K{k}" for p, k in CONFIGS])
@pytest.mark.parametrize("mode", MODES)
def test_torch_backend_matches_dense_oracle(p, k, mode):
    cfg = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=4, num_draft_tokens=5, max_bs=8,
                              max_context_len=40)
    world = make_world(cfg, 4, num_padding=1, seed=p + k)
    kc, vc = fill_kv_cache(world, num_kv_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(0)
    for tree in ([True, False] if mode == "target_verify" else [True]):
        for step in (range(cfg.num_steps - 1) if mode == "draft_decode" else [0]):
            md = build(mode, cfg, step=step, **world.mode_kwargs(mode, tree=tree, draft_attention="branch"))
            q = torch.randn(num_queries(world, mode), 4, 16, generator=g)
            out = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch")
            ref = dense_attention(q, kc, vc, expected_key_slots(world, mode, step=step, tree=tree, draft_attention="branch"))
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_merge_of_two_empty_sides_is_zero_not_nan():
    out = torch.randn(3, 2, 4)
    empty = torch.full((2, 3), float("-inf"))
    merged, lse = merge_attention_states(out, empty, out * 2, empty)
    assert torch.equal(merged, torch.zeros_like(merged)) and torch.isneginf(lse).all()


def test_merge_with_one_empty_side_returns_the_other():
    a, b = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    la, lb = torch.randn(2, 3), torch.full((2, 3), float("-inf"))
    merged, lse = merge_attention_states(a, la, b, lb)
    torch.testing.assert_close(merged, a)
    torch.testing.assert_close(lse, la)


def test_merge_equals_attention_over_the_union():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(5, 2, 8, generator=g) for _ in range(3))
    scores = torch.einsum("qhd,khd->hqk", q, k)
    full = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    parts = []
    for sl in (slice(0, 2), slice(2, 5)):
        s = scores[..., sl]
        parts += [torch.einsum("hqk,khd->qhd", s.softmax(-1), v[sl]), torch.logsumexp(s, -1)]
    merged, _ = merge_attention_states(*parts)
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-5)


def test_fa3_op_fake_gives_shapes_and_a_step_traces_with_it():
    """On CPU, FA3 cannot run, but its fake lets a whole step trace into one graph."""
    cfg = fa3_spec.SpecConfig(page_size=2, topk=8, num_steps=3, num_draft_tokens=4, max_bs=4,
                              max_context_len=32)
    world = make_world(cfg, 3, seed=2)
    kc, vc = fill_kv_cache(world, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    q = torch.randn(num_queries(world, "draft_decode"), 8, 64, dtype=torch.bfloat16)

    def step(q, kc, vc, r2t, rpi, seq, loc):
        md = fa3_spec.build_draft_decode_metadata(cfg, 1, draft_attention="branch",
                                                  req_to_token=r2t, req_pool_indices=rpi,
                                                  seq_lens=seq, out_cache_loc=loc)
        return fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="fa3", num_splits=1)

    gm = make_fx(step, tracing_mode="fake")(q, kc, vc, world.req_to_token, world.req_pool_indices,
                                            world.seq_lens, world.out_cache_loc)
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.fa3_spec.fa3_paged_attention.default) == 2  # prefix + expand
    out_node = [n for n in gm.graph.nodes if n.op == "output"][0]
    assert out_node.args[0].meta["val"].shape == q.shape


def test_auto_backend_is_torch_without_cuda():
    cfg = fa3_spec.SpecConfig(page_size=1, topk=1, num_steps=2, num_draft_tokens=1, max_bs=2,
                              max_context_len=8)
    world = make_world(cfg, 2)
    kc, vc = fill_kv_cache(world, num_kv_heads=1, head_dim=8)
    md = build("decode", cfg, **world.mode_kwargs("decode", draft_attention="branch"))
    q = torch.randn(2, 2, 8)
    torch.testing.assert_close(fa3_spec.cascade_attention(q, kc, vc, md),
                               fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch"))


@pytest.mark.parametrize("bad, match", [
    (dict(q=torch.zeros(2, 3, 8)), "multiple"),
    (dict(q=torch.zeros(2, 2)), "q must be"),
    (dict(attention_backend="cuda"), "attention_backend"),
])
def test_attention_boundary_errors(bad, match):
    cfg = fa3_spec.SpecConfig(page_size=1, topk=1, num_steps=2, num_draft_tokens=1, max_bs=2,
                              max_context_len=8)
    world = make_world(cfg, 2)
    kc, vc = fill_kv_cache(world, num_kv_heads=2, head_dim=8)
    md = build("decode", cfg, **world.mode_kwargs("decode", draft_attention="branch"))
    kw = dict(q=torch.zeros(2, 4, 8), attention_backend="torch")
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        fa3_spec.cascade_attention(kw.pop("q"), kc, vc, md, **kw)
