"""Checked mode: every planted violation sets its bit, valid worlds set none, no sync."""

import pytest
import torch
from hypothesis import given, strategies as st

import fa3_spec
from fa3_spec import ErrorFlag, describe_errors, error_flags
from fa3_spec.probes import RecordingBackend
from fa3_spec import MODES
from fa3_spec.harness.worlds import make_world

CFG = fa3_spec.SpecConfig(page_size=4, topk=3, num_steps=4, num_draft_tokens=5, max_bs=8,
                          max_context_len=40)


def _flags(world, mode, step=2, **over):
    kw = world.mode_kwargs(mode, draft_attention="branch")
    kw.update(over)
    num_pages = kw.pop("num_pages", world.num_pages)
    return int(error_flags(world.cfg, mode, step=step, num_pages=num_pages, **kw))


@pytest.mark.parametrize("mode", MODES)
def test_valid_world_sets_no_flag(mode):
    world = make_world(CFG, 5, num_padding=1, seed=1)
    for step in range(CFG.num_steps - 1):
        assert _flags(world, mode, step=step) == 0


def _world():
    return make_world(CFG, 4, seq_lens=[9, 13, 40, 0], seed=2)


@pytest.mark.parametrize("p, k", [(1, 3), (2, 8), (4, 3), (16, 1)])
def test_draft_positions_is_the_layout_checked_mode_accepts(p, k):
    """One implementation, exported by the library and the EAGLE loop: slots read
    from a page-aligned row at ``draft_positions`` pass the DRAFT_LAYOUT check."""
    from fa3_spec import eagle
    from fa3_spec.harness import worlds

    assert fa3_spec.draft_positions is eagle.draft_positions is worlds.draft_positions
    cfg = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=4, num_draft_tokens=5, max_bs=8,
                              max_context_len=40)
    seq = torch.tensor([1, 7, 40, 0, 13])
    rows = torch.randperm(5, generator=torch.Generator().manual_seed(p * k))
    pages = torch.randperm(cfg.pool_pages(5, "branch") - 1, generator=torch.Generator().manual_seed(k)) + 1
    width = -(-cfg.draft_row_len // p) * p  # whole pages per row: page aligned
    pos = torch.arange(5 * width)
    r2t = (pages[pos // p] * p + pos % p).view(5, width).to(torch.int32)
    loc = r2t[rows.view(5, 1, 1), fa3_spec.draft_positions(cfg, seq, "branch")]
    kw = dict(req_to_token=r2t, req_pool_indices=rows, seq_lens=seq, out_cache_loc=loc)
    for step in range(cfg.num_steps - 1):
        assert int(error_flags(cfg, "draft_decode", step=step, num_pages=cfg.pool_pages(5, "branch"), **kw)) == 0


def test_request_index_out_of_range():
    w = _world()
    rpi = w.req_pool_indices.clone()
    rpi[1] = w.req_to_token.shape[0]
    assert _flags(w, "decode", req_pool_indices=rpi) & ErrorFlag.REQUEST_INDEX_OUT_OF_RANGE
    rpi[1] = -1
    assert _flags(w, "decode", req_pool_indices=rpi) & ErrorFlag.REQUEST_INDEX_OUT_OF_RANGE


@pytest.mark.parametrize("bad", [41, -3])
def test_seq_len_out_of_range(bad):
    w = _world()
    seq = w.seq_lens.clone()
    seq[0] = bad
    assert _flags(w, "decode", seq_lens=seq) & ErrorFlag.SEQ_LEN_OUT_OF_RANGE


def test_draft_layout_violation():
    w = _world()
    loc = w.out_cache_loc.view(4, CFG.topk, CFG.num_steps).clone()
    loc[1, 2, 1] = loc[2, 0, 0]  # a draft slot on another request's page
    assert _flags(w, "draft_decode", step=2, out_cache_loc=loc.reshape(-1)) & ErrorFlag.DRAFT_LAYOUT
    loc = w.out_cache_loc.view(4, CFG.topk, CFG.num_steps).clone()
    loc[0, 1, 0] += 1  # token 0 not at in-page offset seq_len % P
    assert _flags(w, "draft_decode", step=0, out_cache_loc=loc.reshape(-1)) & ErrorFlag.DRAFT_LAYOUT


@pytest.mark.parametrize("how", ["self", "root", "ancestor"])
def test_tree_mask_not_a_tree(how):
    w = _world()
    mask = w.tree_mask.clone()
    n = CFG.num_draft_tokens
    mask[0] = torch.tril(torch.ones(n, n, dtype=torch.bool))  # a valid chain 0-1-2-3-4
    assert _flags(w, "target_verify", tree_mask=mask) == 0
    if how == "self":
        mask[0, 3, 3] = False
    elif how == "root":
        mask[0, 4, 0] = False
    else:  # 3 sees its parent 2, but not 2's parent 1: not closed under ancestors
        mask[0, 3, 1] = False
    assert _flags(w, "target_verify", tree_mask=mask) & ErrorFlag.TREE_MASK_NOT_A_TREE


def test_dropping_only_a_parent_is_another_valid_tree():
    """Without parents, a mask row that skips its parent but keeps the rest is a
    different, valid tree (j hangs from its grandparent): not flagged."""
    w = _world()
    mask = w.tree_mask.clone()
    n = CFG.num_draft_tokens
    mask[0] = torch.tril(torch.ones(n, n, dtype=torch.bool))
    mask[0, 4, 3] = False  # 4's parent becomes 2
    assert _flags(w, "target_verify", tree_mask=mask) == 0


def test_padding_rows_are_exempt_from_tree_checks():
    w = _world()
    mask = w.tree_mask.clone()
    mask[3] = False  # row 3 is padding (seq_len 0)
    assert _flags(w, "target_verify", tree_mask=mask) == 0


@pytest.mark.parametrize("mode", MODES)
def test_page_id_outside_the_pool(mode):
    w = _world()
    assert _flags(w, mode, num_pages=3) & ErrorFlag.PAGE_ID_OUT_OF_RANGE


def test_extend_length_out_of_range():
    w = _world()
    for bad in (6, -1):
        ext = w.extend_seq_lens.clone()
        ext[0] = bad
        assert _flags(w, "draft_extend", extend_seq_lens=ext) & ErrorFlag.EXTEND_LEN_OUT_OF_RANGE


def test_describe_errors_names_each_bit():
    flags = torch.tensor(int(ErrorFlag.SEQ_LEN_OUT_OF_RANGE | ErrorFlag.DRAFT_LAYOUT))
    messages = describe_errors(flags)
    assert len(messages) == 2 and "seq_len" in messages[0] and "docs/semantics.md" in messages[1]
    assert describe_errors(torch.tensor(0)) == []


def test_flags_compile_in_one_graph_without_data_dependent_ops():
    w = _world()
    seq = w.seq_lens.clone()
    seq[0] = 99

    def fn(r2t, rpi, seq, loc):
        return error_flags(CFG, "draft_decode", step=1, num_pages=w.num_pages, req_to_token=r2t,
                           req_pool_indices=rpi, seq_lens=seq, out_cache_loc=loc)

    recorder = RecordingBackend("aot_eager")
    compiled = torch.compile(fn, fullgraph=True, backend=recorder)
    args = (w.req_to_token, w.req_pool_indices, seq, w.out_cache_loc)
    assert int(compiled(*args)) == int(fn(*args)) != 0
    assert recorder.frame_count == 1 and recorder.data_dependent == []


@given(st.integers(1, 8), st.integers(1, 6), st.integers(2, 6), st.integers(1, 8),
       st.integers(0, 9), st.integers(0, 2**16), st.sampled_from(list(MODES)))
def test_random_valid_worlds_never_flag(p, k, s, n, bs, seed, mode):
    cfg = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=s, num_draft_tokens=n, max_bs=16,
                              max_context_len=60)
    world = make_world(cfg, bs, seed=seed, num_padding=min(bs, 1))
    assert _flags(world, mode, step=s - 2) == 0
    if mode == "draft_decode":  # and the draft steps' random trees, ancestor semantics
        kw = world.mode_kwargs(mode, step=s - 2, draft_attention="ancestors")
        assert int(error_flags(cfg, mode, step=s - 2, num_pages=world.num_pages, **kw)) == 0


def test_missing_extend_lengths_is_a_named_error():
    w = _world()
    with pytest.raises(ValueError, match="extend_seq_lens"):
        _flags(w, "draft_extend", extend_seq_lens=None)
    with pytest.raises(ValueError, match="extend_seq_lens"):  # as the builder says it
        fa3_spec.build_draft_extend_metadata(CFG, **w.batch(), extend_seq_lens=None)


def test_custom_ops_register_on_import():
    assert hasattr(torch.ops.fa3_spec, "fa3_paged_attention")
    assert hasattr(torch.ops.fa3_spec, "store_kv")


def _planted():
    """(name, mode, step, overrides, bit): one planted violation each."""
    w = _world()
    n = CFG.num_draft_tokens
    rpi = w.req_pool_indices.clone(); rpi[1] = -1
    seq = w.seq_lens.clone(); seq[0] = CFG.max_context_len + 1
    loc = w.out_cache_loc.view(4, CFG.topk, CFG.num_steps).clone(); loc[0, 1, 0] += 1
    chain = torch.tril(torch.ones(n, n, dtype=torch.bool))
    tree = w.tree_mask.clone(); tree[0] = chain; tree[0, 3, 1] = False
    ext = w.extend_seq_lens.clone(); ext[0] = n + 1
    return w, [
        ("request", "decode", 0, dict(req_pool_indices=rpi), ErrorFlag.REQUEST_INDEX_OUT_OF_RANGE),
        ("seq_len", "decode", 0, dict(seq_lens=seq), ErrorFlag.SEQ_LEN_OUT_OF_RANGE),
        ("layout", "draft_decode", 1, dict(out_cache_loc=loc.reshape(-1)), ErrorFlag.DRAFT_LAYOUT),
        ("tree", "target_verify", 0, dict(tree_mask=tree), ErrorFlag.TREE_MASK_NOT_A_TREE),
        ("extend", "draft_extend", 0, dict(extend_seq_lens=ext), ErrorFlag.EXTEND_LEN_OUT_OF_RANGE),
        ("page", "decode", 0, dict(num_pages=3), ErrorFlag.PAGE_ID_OUT_OF_RANGE),
    ]


@pytest.mark.parametrize("index", range(6), ids=[c[0] for c in _planted()[1]])
def test_each_planted_violation_eager_and_compiled(index):
    w, cases = _planted()
    name, mode, step, over, bit = cases[index]
    kw = w.mode_kwargs(mode, draft_attention="branch")
    num_pages = over.pop("num_pages", w.num_pages)
    kw.update(over)
    names = list(kw)

    def fn(*tensors):
        return error_flags(CFG, mode, step=step, num_pages=num_pages, **dict(zip(names, tensors)))

    eager = int(fn(*kw.values()))
    compiled = int(torch.compile(fn, fullgraph=True, backend="aot_eager")(*kw.values()))
    assert eager & bit and compiled == eager


# Slot values that do not fit in int32
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


# The full draft layout
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


# Exact tree masks
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


# Misaligned req_to_token rows
@pytest.mark.parametrize("mode", list(fa3_spec.MODES))
def test_misaligned_rows_are_flagged(mode):
    w = make_world(CFG, 2, seq_lens=[12, 13], seed=8)
    assert not _flags(w, mode) & ErrorFlag.MISALIGNED_ROW
    r2t = w.req_to_token.clone()
    row = int(w.req_pool_indices[0])
    r2t[row, 4] = r2t[row, 7]  # page 1 of the row now holds slots 43, 41, 42, 43 (say)
    assert _flags(w, mode, req_to_token=r2t) & ErrorFlag.MISALIGNED_ROW


# error_flags validates its arguments as the builders do
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


# Overlaps between branches, and branches on the prefix's pages
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

