"""`metadata_views`: what sglang's FA3 calls read, as views of its buffers, filled by its code.

For random worlds, sglang 0.5.23's own replay functions (obtained at test
time, ``fa3_spec.harness.sglang_upstream``; skipped when unavailable) fill a
backend's buffers; the views over them must read, query by query, the same
keys as fa3_spec's builders on the same inputs, with the same static ints,
and hold no copy (every tensor a slice of a buffer). This is what lets
``benchmarks/loop.py compare`` variant (b) drive attention from sglang's own
buffers.
"""

import os
import random

import pytest
import torch

from fa3_spec import (
    build_draft_decode_metadata, build_draft_extend_metadata, build_target_verify_metadata,
)
from fa3_spec.harness.oracle import key_slots_read
from fa3_spec.harness.sglang_upstream import (
    make_req_to_token, sglang_batch,
)
from fa3_spec.checks import ErrorFlag
from fa3_spec.integrations import sglang as sgl
from fa3_spec.metadata import CascadeMetadata
from fa3_spec.tree import tree_mask_from_flat
from helpers import symbol_recorder

WORLDS = int(os.environ.get("FA3_SPEC_SGLANG_VIEW_WORLDS", "6"))
from conftest import SGLANG_DEVICE as DEVICE  # noqa: E402
STATICS = ("max_seqlen_q", "max_seqlen_k", "page_size", "causal", "window_left")



def _calls(md):
    return md.calls if isinstance(md, CascadeMetadata) else (md,)


def _check(view, want, buffers, real_queries: int, where: str):
    assert type(view) is type(want), where
    for got, exp in zip(_calls(view), _calls(want)):
        assert [getattr(got, s) for s in STATICS] == [getattr(exp, s) for s in STATICS], where
        owners = {t.untyped_storage().data_ptr() for g in buffers.values() for t in g.values()}
        for t in (got.page_table, got.cache_seqlens, got.cu_seqlens_q, got.cu_seqlens_k):
            assert t.untyped_storage().data_ptr() in owners, where + ": a copy, not a view"
    got_keys = key_slots_read(view, real_queries)
    want_keys = key_slots_read(want, real_queries)
    assert got_keys == want_keys, where
    assert any(got_keys), where + ": vacuous (no query reads a key)"


def _world(rng, topk):
    p = rng.choice([1, 2, 4, 16])
    k = topk(rng)
    cfg = sgl.SglangConfig(page_size=p, topk=k, num_steps=rng.randint(2, 4),
                           num_draft_tokens=rng.randint(2, 6), max_bs=4,
                           context_len=rng.randint(12, 3 * max(p, 8)))
    return cfg


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_views_read_what_builders_read(upstream, shape):
    topk = (lambda r: 1) if shape == "chain" else (lambda r: r.randint(2, 4))
    for world in range(WORLDS):
        rng = random.Random(f"views-{shape}-{world}")
        g = torch.Generator().manual_seed(world)
        cfg = _world(rng, topk)
        spec, k, n = cfg.spec_config(), cfg.topk, cfg.num_draft_tokens
        r2t = make_req_to_token(cfg, cfg.max_bs + 2, g, device=DEVICE)
        raw = rng.randint(1, cfg.max_bs)
        bucket = rng.randint(raw, cfg.max_bs)
        # The loop's domain: every draft and verify position inside the context
        # (sglang's request tables are ceil(context_len / P) pages wide).
        top = cfg.context_len - cfg.spec_config().tokens_past_seq_len
        lens = [rng.randint(1, top) for _ in range(raw)]
        batch = sglang_batch(cfg, r2t, raw, bucket, g, seq_lens=lens)
        where = f"world {world} {cfg} raw {raw} bucket {bucket}"
        real = dict(req_to_token=r2t, req_pool_indices=batch.req_pool_indices[:raw],
                    seq_lens=batch.seq_lens[:raw])
        loc = batch.out_cache_loc.view(bucket, k * cfg.num_steps)[:raw].reshape(-1)

        for step in range(cfg.num_steps - 1):
            up = upstream.backend(cfg, r2t, step=step)
            up.draft_decode(**batch.inputs("draft_decode"))
            view = sgl.metadata_views(cfg, up.buffers, "draft_decode", step=step, bs=bucket)
            want = build_draft_decode_metadata(spec, step, draft_attention="branch", **real,
                                               out_cache_loc=loc if k > 1 else None)
            _check(view, want, up.buffers, raw * k, f"{where} draft step {step}")

        up = upstream.backend(cfg, r2t, is_draft_runner=False)
        up.target_verify(num_real_rows=raw, **batch.inputs("target_verify"))
        view = sgl.metadata_views(cfg, up.buffers, "target_verify", bs=bucket)
        tree = None if k == 1 else tree_mask_from_flat(
            batch.custom_mask, batch.seq_lens[:raw], n)
        want = build_target_verify_metadata(spec, **real, tree_mask=tree)
        _check(view, want, up.buffers, raw * n, f"{where} verify")

        up = upstream.backend(cfg, r2t)
        up.draft_extend(**batch.inputs("draft_extend"))
        view = sgl.metadata_views(cfg, up.buffers, "draft_extend", bs=bucket)
        ext = batch.extend_seq_lens[:raw]
        want = build_draft_extend_metadata(spec, **real, extend_seq_lens=ext)
        _check(view, want, up.buffers, int(ext.sum()), f"{where} extend")


def test_views_follow_refills(upstream):
    """The views are bound once; a later fill is what they read (as in a captured graph)."""
    cfg = sgl.SglangConfig(page_size=2, topk=4, num_steps=3, num_draft_tokens=5, max_bs=3,
                           context_len=24)
    g = torch.Generator().manual_seed(1)
    r2t = make_req_to_token(cfg, cfg.max_bs + 2, g, device=DEVICE)
    up = upstream.backend(cfg, r2t, step=1)
    view = sgl.metadata_views(cfg, up.buffers, "draft_decode", step=1)
    for lens in ([3, 10, 17], [20, 1, 6]):
        batch = sglang_batch(cfg, r2t, 3, 3, g, seq_lens=lens)
        up.draft_decode(**batch.inputs("draft_decode"))
        want = build_draft_decode_metadata(
            cfg.spec_config(), 1, draft_attention="branch", req_to_token=r2t, req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens, out_cache_loc=batch.out_cache_loc)
        assert key_slots_read(view, 12) == key_slots_read(want, 12), lens


def test_views_validate():
    cfg = sgl.SglangConfig(page_size=2, topk=1, num_steps=3, num_draft_tokens=4, max_bs=2,
                           context_len=16)
    buffers = sgl.allocate_buffers(cfg)
    with pytest.raises(ValueError, match="mode"):
        sgl.metadata_views(cfg, buffers, "decode")
    with pytest.raises(ValueError, match="bs"):
        sgl.metadata_views(cfg, buffers, "draft_extend", bs=3)
    with pytest.raises(ValueError, match="step"):
        sgl.metadata_views(cfg, buffers, "draft_decode", step=2)
    md = sgl.metadata_views(cfg, buffers, "target_verify", bs=1)
    assert md.page_table.shape == (1, cfg.max_num_pages) and md.max_seqlen_q == 4


@pytest.mark.parametrize("p, given, used", [(2, 0, 3), (1, 3, 0), (16, 2, 1)])
def test_buffers_of_another_draft_step_are_refused_by_name(p, given, used):
    """Found in review: step ``given``'s buffers filled or read for step ``used``.
    P = 2 (0 -> 3): the expand rows need 5 columns, the table has 2, and FA3's read
    runs into the next row; P = 1 (3 -> 0): cache_seqlens keeps 4 where d = 1."""
    cfg = sgl.SglangConfig(page_size=p, topk=4, num_steps=6, num_draft_tokens=5, max_bs=3,
                           context_len=40)
    g = torch.Generator().manual_seed(p)
    r2t = make_req_to_token(cfg, 4, g)
    kw = dict(req_to_token=r2t, **sglang_batch(cfg, r2t, 2, 3, g).inputs("draft_decode"))
    wrong = sgl.allocate_buffers(cfg, step=given)
    before = {k: v.clone() for k, v in wrong[sgl.DRAFT_TOPK_EXPAND].items()}
    with pytest.raises(ValueError, match=rf"\['page_table'\].*width {used + 2}"):
        sgl.draft_decode(cfg, wrong, used, **kw)
    assert all(torch.equal(before[k], v) for k, v in wrong[sgl.DRAFT_TOPK_EXPAND].items())
    with pytest.raises(ValueError, match=rf"draft_decode_metadata_topk_expand.*width {used + 2}"):
        sgl.metadata_views(cfg, wrong, "draft_decode", step=used)
    steps = [sgl.allocate_buffers(cfg, step=s) for s in range(cfg.num_steps - 1)]
    steps[given], steps[used] = steps[used], steps[given]
    with pytest.raises(ValueError, match="page_table"):
        sgl.draft_iteration(cfg, steps, **kw)
    sgl.draft_decode(cfg, sgl.allocate_buffers(cfg, step=used), used, **kw)  # its own step: fine


def test_buffers_of_the_wrong_dtype_or_set_are_refused_by_name():
    """int64 buffers used to be filled through a casting copy_ and read back as int64
    tables; a missing set raised a bare KeyError."""
    cfg = sgl.SglangConfig(page_size=2, topk=4, num_steps=3, num_draft_tokens=5, max_bs=2,
                           context_len=24)
    g = torch.Generator().manual_seed(0)
    r2t = make_req_to_token(cfg, 3, g)
    batch = sglang_batch(cfg, r2t, 2, 2, g)
    for mode, name in [("draft_decode", sgl.DRAFT_TOPK_NORMAL), ("draft_extend", sgl.DRAFT_EXTEND),
                       ("target_verify", sgl.TARGET_VERIFY_TOPK_EXPAND)]:
        step = [0] if mode == "draft_decode" else []

        def fill(buffers):
            getattr(sgl, mode)(cfg, buffers, *step, req_to_token=r2t, **batch.inputs(mode))

        wide = sgl.allocate_buffers(cfg)
        wide[name] = {k: v.to(torch.int64) if v.dtype == torch.int32 else v for k, v in wide[name].items()}
        with pytest.raises(TypeError, match=rf"{name}.*must have dtype torch.int32"):
            fill(wide)
        with pytest.raises(TypeError, match=name):
            sgl.metadata_views(cfg, wide, mode)
        missing = sgl.allocate_buffers(cfg)
        del missing[name]
        with pytest.raises(ValueError, match=rf"no '{name}' set"):
            fill(missing)


def test_two_sglang_configs_compile_in_one_process():
    """SglangConfig's ints stay compile-time constants too (a fa3_spec.frozen.FrozenModule):
    one compiled fill serves two configurations, each in its own graph."""
    record = []
    fill = torch.compile(sgl.draft_iteration, fullgraph=True, backend=symbol_recorder(record))
    for steps in (3, 2):
        cfg = sgl.SglangConfig(page_size=2, topk=2, num_steps=steps, num_draft_tokens=3,
                               max_bs=2, context_len=16)
        g = torch.Generator().manual_seed(steps)
        r2t = make_req_to_token(cfg, 3, g)
        kw = dict(req_to_token=r2t, **sglang_batch(cfg, r2t, 2, 2, g).inputs("draft_decode"))
        got = [sgl.allocate_buffers(cfg, step=s) for s in range(steps - 1)]
        want = [sgl.allocate_buffers(cfg, step=s) for s in range(steps - 1)]
        fill(cfg, got, **kw)
        sgl.draft_iteration(cfg, want, **kw)
        assert all(torch.equal(a[n][k], b[n][k]) for a, b in zip(got, want) for n in a for k in a[n])
    assert record == [set(), set()]


def test_error_flags_flag_chain_rows_past_sglangs_table():
    """Found in review: sglang's tables are ceil(context_len / P) pages wide, so a chain
    verify of seq_len + N keys can pass them; the adapter's checked mode says so."""
    cfg = sgl.SglangConfig(page_size=2, topk=1, num_steps=3, num_draft_tokens=4, max_bs=2,
                           context_len=40)
    r2t = make_req_to_token(cfg, 4, torch.Generator().manual_seed(0))
    kw = dict(req_to_token=r2t, req_pool_indices=torch.tensor([1, 2]))
    ok = sgl.error_flags(cfg, "target_verify", seq_lens=torch.tensor([36, 5]), **kw)
    bad = sgl.error_flags(cfg, "target_verify", seq_lens=torch.tensor([40, 5]), **kw)
    assert int(ok) == 0
    assert int(bad) & int(ErrorFlag.SEQ_LEN_OUT_OF_RANGE)
