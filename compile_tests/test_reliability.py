"""Regression tests for the defects found by trying to break the library.

Each test failed on the code before its fix (issue: "Reliability: nine
defects found by trying to break the library").
"""

import pytest
import torch

import fa3_spec
from fa3_spec import ErrorFlag, SpecBatch, error_flags
from fa3_spec.graphs import CUDAGraphRunner
from fa3_spec.harness.worlds import make_world
from fa3_spec.tree import mask_block_starts, tree_mask_from_flat

CFG = fa3_spec.SpecConfig(page_size=4, topk=3, num_steps=4, num_draft_tokens=5, max_bs=8,
                          max_context_len=40)


def _flags(world, mode, step=2, **over):
    kw = world.mode_kwargs(mode)
    kw.update(over)
    num_pages = kw.pop("num_pages", world.num_pages)
    return int(error_flags(world.cfg, mode, step=step, num_pages=num_pages, **kw))


# 1. int64 offsets into the flat custom mask -------------------------------------------
def test_flat_mask_block_offsets_do_not_wrap_at_int32():
    starts = mask_block_starts(torch.tensor([2**30, 3]), 2)
    assert starts.dtype == torch.int64
    assert starts.tolist() == [0, 2 * (2**30 + 2)]  # > 2^31: wrapped negative in int32


@pytest.mark.slow
def test_flat_mask_past_two_gib_decodes_the_second_request():
    """The issue's repro, full size: a 2.1 GB flat mask (one request of 2^30 tokens)."""
    seq = torch.tensor([2**30, 3])
    n = 2
    flat = torch.zeros(n * (2**30 + n) + n * (3 + n), dtype=torch.bool)
    second = n * (2**30 + n)
    rows = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    for j in range(n):
        flat[second + j * (3 + n) + 3: second + j * (3 + n) + 3 + n] = rows[j]
    mask = tree_mask_from_flat(flat, seq, n)
    assert torch.equal(mask[1], rows)


# 2. the runner checks what it copies in -------------------------------------------------
def _runner(step, example, buckets=(2, 4)):
    runner = CUDAGraphRunner(step, example=example, buckets=list(buckets), strategy="eager")
    runner.capture()
    return runner


def _draft_example(cfg):
    def example(bs):
        return dict(req_pool_indices=torch.zeros(bs, dtype=torch.int64),
                    seq_lens=torch.zeros(bs, dtype=torch.int64),
                    out_cache_loc=torch.zeros(bs, cfg.topk, cfg.num_steps, dtype=torch.int64))
    return example


def test_runner_refuses_a_broadcastable_out_cache_loc_and_float_seq_lens():
    world = make_world(CFG, 3, seed=1)

    def step(req_pool_indices, seq_lens, out_cache_loc):
        return fa3_spec.build_draft_decode_metadata(
            CFG, 1, req_to_token=world.req_to_token, req_pool_indices=req_pool_indices,
            seq_lens=seq_lens, out_cache_loc=out_cache_loc).expand.cache_seqlens

    runner = _runner(step, _draft_example(CFG))
    loc = world.out_cache_loc.view(3, CFG.topk, CFG.num_steps)
    good = dict(req_pool_indices=world.req_pool_indices, seq_lens=world.seq_lens, out_cache_loc=loc)
    assert torch.equal(runner(**good), step(**good))
    with pytest.raises(ValueError, match="out_cache_loc"):
        runner(**{**good, "out_cache_loc": loc[:, :1]})  # [B, 1, S] would broadcast over K
    with pytest.raises(TypeError, match="seq_lens"):
        runner(**{**good, "seq_lens": world.seq_lens.double()})
    with pytest.raises(ValueError, match="seq_lens"):
        runner(**{**good, "seq_lens": world.seq_lens[:2]})


# 3. outputs that are not one row per request --------------------------------------------
def test_runner_returns_expand_rows_and_cu_seqlens_whole():
    world = make_world(CFG, 3, seed=2)

    def step(req_pool_indices, seq_lens, out_cache_loc):
        md = fa3_spec.build_draft_decode_metadata(
            CFG, 2, req_to_token=world.req_to_token, req_pool_indices=req_pool_indices,
            seq_lens=seq_lens, out_cache_loc=out_cache_loc)
        return md.expand.page_table, md.expand.cu_seqlens_q, md.prefix.cu_seqlens_k, md.prefix.page_table

    runner = _runner(step, _draft_example(CFG))
    batch = dict(req_pool_indices=world.req_pool_indices, seq_lens=world.seq_lens,
                 out_cache_loc=world.out_cache_loc.view(3, CFG.topk, CFG.num_steps))
    got, want = runner(**batch), step(**batch)
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want]
    assert got[0].shape[0] == 3 * CFG.topk and got[1].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_runner_refuses_outputs_with_the_batch_in_another_dimension():
    def step(x):
        return x.t()  # [D, B]

    with pytest.raises(ValueError, match="batch-major"):
        _runner(step, lambda bs: dict(x=torch.zeros(bs, 3)))


# 4. slot values that do not fit in int32 --------------------------------------------------
@pytest.mark.parametrize("num_pages", [None, "pool"])
def test_slots_past_int32_are_flagged_not_wrapped(num_pages):
    world = make_world(CFG, 2, seq_lens=[9, 13], seed=3)
    r2t = world.req_to_token.to(torch.int64)
    row = int(world.req_pool_indices[0])
    r2t[row, 0:4] = 2**32 * 4 + 7 * 4 + torch.arange(4)  # page 2^32 + 7, page aligned
    md = fa3_spec.build_decode_metadata(CFG, req_to_token=r2t, **{
        k: v for k, v in world.batch().items() if k != "req_to_token"})
    assert int(md.page_table[0, 0]) == 7  # what FA3 would read: the wrap
    pages = world.num_pages if num_pages == "pool" else None
    flags = int(error_flags(CFG, "decode", num_pages=pages, req_to_token=r2t,
                            req_pool_indices=world.req_pool_indices, seq_lens=world.seq_lens))
    assert flags & ErrorFlag.PAGE_ID_OUT_OF_RANGE


# 5. the full draft layout -----------------------------------------------------------------
def _layout_world():
    cfg = fa3_spec.SpecConfig(page_size=4, topk=3, num_steps=4, num_draft_tokens=5, max_bs=8,
                              max_context_len=40)
    return cfg, make_world(cfg, 2, seq_lens=[9, 14], seed=4)  # last = 1 and 2


def test_draft_token_at_the_wrong_in_page_offset_is_flagged():
    cfg, w = _layout_world()
    loc = w.out_cache_loc.view(2, cfg.topk, cfg.num_steps).clone()
    assert _flags(w, "draft_decode", out_cache_loc=loc.reshape(-1)) == 0
    loc[0, 0, 1] += 1  # token 1 of branch 0: offset 2 -> 3, same page, same page count
    assert _flags(w, "draft_decode", out_cache_loc=loc.reshape(-1)) & ErrorFlag.DRAFT_LAYOUT


def test_duplicate_draft_slots_are_flagged():
    cfg, w = _layout_world()
    loc = w.out_cache_loc.view(2, cfg.topk, cfg.num_steps).clone()
    loc[1, 2] = loc[1, 1]  # branch 2 reuses branch 1's slots: a valid shape on its own
    assert _flags(w, "draft_decode", out_cache_loc=loc.reshape(-1)) & ErrorFlag.DRAFT_LAYOUT


def test_branch_pages_must_be_fresh_at_each_boundary():
    cfg = fa3_spec.SpecConfig(page_size=2, topk=2, num_steps=6, num_draft_tokens=5, max_bs=4,
                              max_context_len=40)
    w = make_world(cfg, 1, seq_lens=[9], seed=5)  # last = 1: pages hold (tail,d0) (d1,d2) (d3,d4)
    loc = w.out_cache_loc.view(1, 2, 6).clone()
    assert _flags(w, "draft_decode", step=4, out_cache_loc=loc.reshape(-1)) == 0
    loc[0, 1, 3:5] = loc[0, 1, 1:3]  # third page of branch 1 = its second page again
    assert _flags(w, "draft_decode", step=4, out_cache_loc=loc.reshape(-1)) & ErrorFlag.DRAFT_LAYOUT


# 6. exact tree masks ------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["cycle", "two_parents", "own_child"])
def test_non_trees_are_flagged(how):
    w = make_world(CFG, 2, seq_lens=[9, 13], seed=6)
    n = CFG.num_draft_tokens
    mask = torch.eye(n, dtype=torch.bool).unsqueeze(0).repeat(2, 1, 1)
    mask[:, :, 0] = True  # a star: every token hangs from the root
    assert _flags(w, "target_verify", tree_mask=mask) == 0
    if how == "cycle":
        mask[0, 0, 1] = True  # root <-> 1
    elif how == "two_parents":
        mask[0, 3, 1] = mask[0, 3, 2] = True  # 3 under both 1 and 2 (siblings)
    else:
        mask[0, 2, 4] = True  # 2 attends its own (later) child 4
        mask[0, 4, 2] = True
    assert _flags(w, "target_verify", tree_mask=mask) & ErrorFlag.TREE_MASK_NOT_A_TREE


def test_every_parent_array_gives_an_unflagged_mask():
    w = make_world(CFG, 2, seq_lens=[9, 13], seed=7)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        parents = torch.full((2, CFG.num_draft_tokens), -1, dtype=torch.int64)
        for c in range(1, CFG.num_draft_tokens):
            parents[:, c] = torch.randint(0, c, (2,), generator=g)
        mask = fa3_spec.tree_mask_from_parents(parents)
        assert _flags(w, "target_verify", tree_mask=mask) == 0


# 7. misaligned req_to_token rows --------------------------------------------------------------
@pytest.mark.parametrize("mode", list(fa3_spec.MODES))
def test_misaligned_rows_are_flagged(mode):
    w = make_world(CFG, 2, seq_lens=[12, 13], seed=8)
    assert not _flags(w, mode) & ErrorFlag.MISALIGNED_ROW
    r2t = w.req_to_token.clone()
    row = int(w.req_pool_indices[0])
    r2t[row, 4] = r2t[row, 7]  # page 1 of the row now holds slots 43, 41, 42, 43 (say)
    assert _flags(w, mode, req_to_token=r2t) & ErrorFlag.MISALIGNED_ROW


# 9. error contracts ------------------------------------------------------------------------------
def test_compiled_callers_see_dynamo_wrapping_and_specbatch_keeps_the_type():
    world = make_world(CFG, 2, seed=9)
    bad_seq = world.seq_lens.float()

    def fn(seq_lens):
        return fa3_spec.build_decode_metadata(CFG, req_to_token=world.req_to_token,
                                              req_pool_indices=world.req_pool_indices,
                                              seq_lens=seq_lens)

    with pytest.raises(torch._dynamo.exc.Unsupported, match="seq_lens must have dtype"):
        torch.compile(fn, fullgraph=True, backend="eager")(bad_seq)
    torch._dynamo.reset()
    with pytest.raises(TypeError, match="seq_lens"):  # validated outside the compiled region
        SpecBatch.create(CFG, req_to_token=world.req_to_token,
                         req_pool_indices=world.req_pool_indices, seq_lens=bad_seq)
    batch = SpecBatch.create(CFG, req_to_token=world.req_to_token,
                             req_pool_indices=world.req_pool_indices, seq_lens=world.seq_lens)
    compiled = torch.compile(lambda b: fa3_spec.build_metadata("decode", b), fullgraph=True,
                             backend="eager")
    assert torch.equal(compiled(batch).page_table, fn(world.seq_lens).page_table)


@pytest.mark.parametrize("over, error, match", [
    (dict(out_cache_loc="float"), TypeError, "out_cache_loc"),
    (dict(out_cache_loc=None), ValueError, "out_cache_loc"),
    (dict(num_pages=0), ValueError, "num_pages"),
    (dict(num_pages=-5), ValueError, "num_pages"),
    (dict(num_pages=3.5), TypeError, "num_pages"),
])
def test_error_flags_validates_like_the_builders(over, error, match):
    w = make_world(CFG, 2, seed=10)
    if over.get("out_cache_loc") == "float":
        over = dict(out_cache_loc=w.out_cache_loc.float())
    with pytest.raises(error, match=match):
        _flags(w, "draft_decode", **over)


def test_error_flags_refuses_an_integer_tree_mask():
    w = make_world(CFG, 2, seed=11)
    with pytest.raises(TypeError, match="tree_mask"):
        _flags(w, "target_verify", tree_mask=w.tree_mask.to(torch.int32))


def test_padding_rows_with_a_negative_request_index_are_exempt():
    w = make_world(CFG, 3, seq_lens=[9, 13, 0], seed=12)
    rpi = w.req_pool_indices.clone()
    rpi[2] = -1  # a padding row (seq_len 0)
    for mode in fa3_spec.MODES:
        assert _flags(w, mode, req_pool_indices=rpi) == 0, mode
    rpi[1] = -1  # a live row: flagged
    assert _flags(w, "decode", req_pool_indices=rpi) & ErrorFlag.REQUEST_INDEX_OUT_OF_RANGE


# Found by review: overlaps the first version of the layout check missed -----------------------
def _one_request(loc_rows, *, p=4, k=2, s=5, seq=5):
    cfg = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=s, num_draft_tokens=4, max_bs=4,
                              max_context_len=16, num_pages=64)
    r2t = (torch.arange(cfg.draft_row_len) + p).view(1, -1).to(torch.int32)  # identity, page + 1
    loc = torch.tensor(loc_rows).view(1, k, s)
    return [int(error_flags(cfg, "draft_decode", step=step, req_to_token=r2t,
                            req_pool_indices=torch.tensor([0]), seq_lens=torch.tensor([seq]),
                            out_cache_loc=loc)) for step in range(s - 1)]


def test_branches_sharing_a_page_or_landing_on_the_prefix_are_flagged():
    # seq 5, P 4: prefix slots 4..8 (page 1 whole, page 2 holds token 4 = slot 8); last = 1.
    assert _one_request([[9, 10, 11, 12, 13], [21, 22, 23, 24, 25]]) == [0, 0, 0, 0]
    # Branch 1's region starts on branch 0's second page: from step 3 on they share page 3
    # (branch 0's d3 lands on the slot holding branch 1's tail copy).
    flags = _one_request([[9, 10, 11, 12, 13], [13, 14, 15, 16, 17]])
    assert flags[3] & ErrorFlag.DRAFT_LAYOUT
    # Branch 1's drafts on the prefix's whole page 1 (slots 5..7 are prefix positions 1..3).
    flags = _one_request([[9, 10, 11, 12, 13], [5, 6, 7, 8, 9]])
    assert all(f & ErrorFlag.DRAFT_LAYOUT for f in flags)


def test_tail_copies_of_padding_rows_touch_only_slot_zero():
    cfg = fa3_spec.SpecConfig(page_size=4, topk=2, num_steps=3, num_draft_tokens=3, max_bs=4,
                              max_context_len=16)
    src, dst = fa3_spec.draft_tail_copy_slots(cfg, seq_lens=torch.tensor([0]),
                                              out_cache_loc=torch.full((1, 2, 3), 10**9))
    assert src.tolist() == dst.tolist() == [0] * 6


def test_a_window_on_a_non_causal_multi_query_call_is_refused():
    cfg = fa3_spec.SpecConfig(page_size=1, topk=4, num_steps=3, num_draft_tokens=4, max_bs=4,
                              max_context_len=16)
    w = make_world(cfg, 1, seq_lens=[10])
    prefix = fa3_spec.build_draft_prefix_metadata(cfg, **w.batch())
    kv = torch.randn(w.num_pages, 1, 1, 8)
    with pytest.raises(ValueError, match="non-causal"):
        fa3_spec.cascade_attention(torch.randn(4, 1, 8), kv, kv, prefix, backend="torch",
                                   window_size=(3, -1))


def test_runner_never_returns_a_negative_slice():
    def step(x):
        return (x[1:] - x[:-1],)  # B - 1 rows

    runner = _runner(step, lambda bs: dict(x=torch.zeros(bs)), buckets=(4, 8))
    assert runner(x=torch.zeros(0))[0].shape == (0,)
    assert runner(x=torch.arange(3.0))[0].tolist() == [1.0, 1.0]


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
    out, lse = fa3_spec.cascade_attention(q, k, v, md, backend="torch", sinks=sinks,
                                          return_lse=True)
    assert out.dtype == torch.float64
    base, base_lse = fa3_spec.cascade_attention(q, k, v, md, backend="torch", return_lse=True)
    want = base * torch.sigmoid(base_lse - sinks[:, None]).transpose(0, 1).unsqueeze(-1)
    assert torch.allclose(out, want, atol=1e-12, rtol=1e-12)


# Found on the H200 by the loop audit rows: provider discovery inside a compiled step -----------
def test_provider_discovery_is_a_constant_after_one_eager_call(monkeypatch):
    from fa3_spec.attention import providers
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


def test_extend_query_positions_checks_its_arguments():
    cfg = fa3_spec.SpecConfig(page_size=2, topk=1, num_steps=2, num_draft_tokens=2, max_bs=4,
                              max_context_len=16)
    w = make_world(cfg, 3, seed=1)
    md = fa3_spec.build_prefill_metadata(cfg, **w.batch(), extend_seq_lens=w.seq_lens,
                                         max_seqlen_q=16)
    with pytest.raises(ValueError, match="seq_lens"):
        fa3_spec.extend_query_positions(md, w.seq_lens[:2], 48)
    with pytest.raises(TypeError, match="metadata"):
        fa3_spec.extend_query_positions(fa3_spec.CascadeMetadata(md, None), w.seq_lens, 48)


def test_a_window_past_the_key_bound_reaches_fa3_as_unbounded(monkeypatch):
    import fa3_spec.attention.cascade as cascade_mod

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
                       (None, fa3_spec.build_metadata("decode", cfg, **w.mode_kwargs("decode"),
                                                      window_left=2**40)),
                       ((3, 0), fa3_spec.build_decode_metadata(cfg, **w.batch()))]:
        kw = {} if window is None else dict(window_size=window)
        cascade_mod.attention_call(q, kv, kv, md, softmax_scale=1.0, backend="fa3", num_splits=1,
                                   **kw)
    assert seen == [(-1, 0), (-1, 0), (3, 0)]
