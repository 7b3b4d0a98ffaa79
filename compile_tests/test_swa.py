"""Sliding-window (SWA) metadata, ``build_metadata(mode, ..., window_left=W)``.

The oracle is written here from docs/semantics.md: each query's full key set
(`expected_key_slots`, listed in position order, the last key at the
query's own position) keeps its last ``W + 1`` entries. The metadata is
compared by what FA3 reads (`key_slots_read`, which applies the carried
``window_left``), as multisets, in every mode x page size {1, 2, 16, 64} x
topk {1, 4, 8} for windows that cut the prefix, the drafts, or nothing;
then through `cascade_attention(attention_backend="torch")` against the float32 dense
oracle, compiled fullgraph (aot_eager). CPU cost: about 20 s on 2 cores.
The GPU test at the end compares FA3 with the torch backend (skips on CPU).
"""

import itertools

import pytest
import torch

import fa3_spec
from fa3_spec.attention import fa3_available
from fa3_spec.config import cdiv
from fa3_spec.harness.oracle import (
    dead_columns_clean,
    dense_attention,
    expected_key_slots,
    key_slots_read,
    num_queries,
)
from fa3_spec.harness.worlds import fill_kv_cache, make_world

HQ, HKV, DIM = 4, 2, 16
WINDOWS = (0, 3, 9, 40, 1000)  # own key only; cuts drafts; cuts the prefix; none


def _world(p, k, seed=0, device="cpu", ctx=150):
    cfg = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=4, num_draft_tokens=5, max_bs=8,
                              max_context_len=ctx)
    seqs = [1, p, p + 1, ctx, 0, 2 * p + 3 if 2 * p + 3 <= ctx else ctx - 1, 37]
    return make_world(cfg, len(seqs), seq_lens=seqs, seed=seed + 13 * p + k, device=device)


def _cases(world):
    """``(mode, step, tree)`` of every call a step of the world makes."""
    for mode in fa3_spec.MODES:
        for tree in ((True, False) if mode == "target_verify" else (True,)):
            steps = range(world.cfg.num_steps - 1) if mode == "draft_decode" else (0,)
            for step in steps:
                yield mode, step, tree


def windowed_slots(world, mode, step, tree, w):
    """Per query, the slots of its key set at positions ``>= pos - w``."""
    return [keys[max(0, len(keys) - 1 - w):]
            for keys in expected_key_slots(world, mode, step=step, tree=tree, draft_attention="branch")]


def _same_tokens(world, slots):
    """Slots -> (request row, position) of the token they hold, so that a tail
    copy (topk > 1, P > 1) and the prefix token it copies compare equal."""
    where = {}
    r2t = world.req_to_token.cpu()
    for b, row in enumerate(world.req_pool_indices.tolist()):
        s = int(world.seq_lens[b])
        for pos in range(s):
            where.setdefault(int(r2t[row, pos]), ("prefix", row, pos))
        if world.cfg.topk > 1 and world.cfg.page_size > 1:
            last = s % world.cfg.page_size
            for t in range(world.cfg.topk):
                start = int(world.draft_positions[b, t, 0]) - last
                for o in range(last):
                    where[int(r2t[row, start + o])] = ("prefix", row, s - last + o)
    return [sorted(where.get(x, ("slot", x)) for x in q) for q in slots]


def _build(world, mode, step, tree, w):
    return fa3_spec.build_metadata(mode, world.cfg, step=step, window_left=w,
                                   **world.mode_kwargs(mode, tree=tree, draft_attention="branch"))


@pytest.mark.parametrize("p, k", list(itertools.product((1, 2, 16, 64), (1, 4, 8))))
def test_swa_metadata_reads_exactly_the_window_in_every_mode(p, k):
    world = _world(p, k)
    cfg = world.cfg
    for (mode, step, tree), w in itertools.product(list(_cases(world)), WINDOWS):
        md = _build(world, mode, step, tree, w)
        read = key_slots_read(md, num_queries(world, mode))
        want = windowed_slots(world, mode, step, tree, w)
        want = want + [[]] * (len(read) - len(want))
        assert _same_tokens(world, read) == _same_tokens(world, want), (mode, step, tree, w)
        assert dead_columns_clean(md)
        for call in md.calls:  # narrow, static, and bounds hold
            assert call.page_table.shape[1] <= cdiv(w + cfg.tokens_past_seq_len, call.page_size) + 1
            assert int(call.cache_seqlens.max()) <= call.max_seqlen_k
            assert call.page_table.shape[1] * call.page_size >= call.max_seqlen_k or \
                call.page_table.shape[1] == cfg.page_table_width
        if isinstance(md, fa3_spec.CascadeMetadata):
            assert all(c.window_left == -1 for c in md.calls)  # trimmed, no window needed
        else:
            assert md.window_left == w and md.causal


def test_swa_width_does_not_grow_with_the_context():
    small, big = _world(16, 4, ctx=150), _world(16, 4, ctx=1500)
    for mode, step, tree in _cases(small):
        a, b = (_build(x, mode, step, tree, 40) for x in (small, big))
        assert [c.page_table.shape for c in a.calls] == [c.page_table.shape for c in b.calls]


def test_a_window_past_the_context_reads_the_full_key_sets():
    world = _world(2, 4)
    for mode, step, tree in _cases(world):
        md = _build(world, mode, step, tree, 10_000)
        read = key_slots_read(md, num_queries(world, mode))
        full = expected_key_slots(world, mode, step=step, tree=tree, draft_attention="branch")
        assert _same_tokens(world, read) == _same_tokens(world, full + [[]] * (len(read) - len(full)))


@pytest.mark.parametrize("p, k", [(1, 4), (2, 8), (16, 4), (64, 1)])
def test_swa_attention_matches_the_dense_oracle(p, k):
    world = _world(p, k)
    kc, vc = fill_kv_cache(world, num_kv_heads=HKV, head_dim=DIM)
    g = torch.Generator().manual_seed(p + k)
    for (mode, step, tree), w in itertools.product(list(_cases(world)), (3, 40)):
        md = _build(world, mode, step, tree, w)
        q = torch.randn(num_queries(world, mode), HQ, DIM, generator=g)
        out = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch")
        slots = windowed_slots(world, mode, step, tree, w)
        torch.testing.assert_close(out, dense_attention(q, kc, vc, slots), atol=2e-5, rtol=2e-5)
        # The window must matter here, or the comparison proves nothing.
        full = expected_key_slots(world, mode, step=step, tree=tree, draft_attention="branch")
        assert not torch.allclose(out, dense_attention(q, kc, vc, full), atol=1e-3)


@pytest.mark.parametrize("mode, p, k, tree", [
    ("draft_decode", 2, 8, True), ("target_verify", 16, 4, True), ("target_verify", 2, 4, False),
    ("draft_extend", 2, 4, True),
], ids=["draft_cascade", "tree_verify", "chain_verify", "draft_extend"])
def test_swa_metadata_and_attention_compile_fullgraph(mode, p, k, tree):
    """aot_eager, fullgraph (no host sync, no data-dependent shape), no recompile, equal to eager."""
    worlds = [_world(p, k, seed=s) for s in range(2)]
    names = [n for n, v in worlds[0].mode_kwargs(mode, tree=tree, draft_attention="branch").items() if v is not None]
    cfg = worlds[0].cfg
    g = torch.Generator().manual_seed(3)

    def step(q, kc, vc, *tensors):
        md = fa3_spec.build_metadata(mode, cfg, step=1, window_left=9, **dict(zip(names, tensors)))
        return fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch",
                                          return_lse=True), md

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for w in worlds:
            kc, vc = fill_kv_cache(w, num_kv_heads=HKV, head_dim=DIM, seed=int(w.seq_lens.sum()))
            q = torch.randn(num_queries(w, mode), HQ, DIM, generator=g)
            args = [q, kc, vc] + [w.mode_kwargs(mode, tree=tree, draft_attention="branch")[n] for n in names]
            ((got, got_lse), got_md), ((want, want_lse), want_md) = compiled(*args), step(*args)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(got_lse, want_lse)
            for a, b in zip(got_md.calls, want_md.calls):
                assert torch.equal(a.page_table, b.page_table)
                assert torch.equal(a.cache_seqlens, b.cache_seqlens)


def test_window_left_errors_name_the_argument():
    world = _world(2, 4)
    kw = world.mode_kwargs("decode", draft_attention="branch")
    with pytest.raises(ValueError, match="window_left"):
        fa3_spec.build_metadata("decode", world.cfg, window_left=-1, **kw)
    with pytest.raises(TypeError, match="window_left"):
        fa3_spec.build_metadata("decode", world.cfg, window_left=2.0, **kw)
    md = fa3_spec.build_metadata("decode", world.cfg, window_left=4, **kw)
    kc, vc = fill_kv_cache(world, num_kv_heads=HKV, head_dim=DIM)
    q = torch.randn(world.batch_size, HQ, DIM)
    with pytest.raises(ValueError, match="already carries its window"):
        fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch", window_size=(4, -1))


@pytest.mark.parametrize("w", [2**62 + 1, 2**63, 2**64, 10**30])
def test_a_huge_window_left_is_refused_by_name_in_every_mode(w):
    """Past 2**62 (already far past any context) a window is refused at the boundary,
    never an OverflowError from inside a torch op; up to it, every value works."""
    world = _world(2, 4)
    for mode, step, tree in _cases(world):
        with pytest.raises(ValueError, match="window_left"):
            _build(world, mode, step, tree, w)
        full = _build(world, mode, step, tree, 2**62)
        wide = _build(world, mode, step, tree, 10_000)
        assert all(torch.equal(a.page_table, b.page_table) and torch.equal(a.cache_seqlens, b.cache_seqlens)
                   for a, b in zip(full.calls, wide.calls))


def test_full_attention_metadata_is_unchanged_by_the_hook():
    """No ``window_left``: the builders' metadata, with ``window_left = -1`` everywhere."""
    world = _world(2, 4)
    for mode, step, tree in _cases(world):
        md = fa3_spec.build_metadata(mode, world.cfg, step=step, **world.mode_kwargs(mode, tree=tree, draft_attention="branch"))
        assert all(c.window_left == -1 for c in md.calls)


@pytest.mark.gpu
@pytest.mark.skipif(not fa3_available(), reason="needs CUDA sm90 and an FA3 provider")
@pytest.mark.parametrize("p, k", list(itertools.product((1, 2, 16, 64), (1, 4, 8))))
def test_gpu_fa3_swa_matches_the_torch_reference(p, k):
    """Real FA3 on SWA metadata of every mode vs the torch backend (float32 over the same bf16 KV)."""
    hq, hkv, dim = 8, 2, 128
    world = _world(p, k, device="cuda", ctx=300)
    kc, vc = fill_kv_cache(world, num_kv_heads=hkv, head_dim=dim, dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(p + k)
    for (mode, step, tree), w in itertools.product(list(_cases(world)), (0, 9, 128)):
        md = _build(world, mode, step, tree, w)
        q = torch.randn(num_queries(world, mode), hq, dim, generator=g, device="cuda",
                        dtype=torch.bfloat16)
        got, got_lse = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="fa3",
                                                  return_lse=True)
        want, want_lse = fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch",
                                                    return_lse=True)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got_lse, want_lse, atol=2e-2, rtol=2e-2)
