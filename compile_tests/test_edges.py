"""Edge shapes, padding rows, garbage values and boundary errors."""

import pytest
import torch

import fa3_spec
from fa3_spec import SpecConfig
from fa3_spec import MODES, build_metadata as build
from fa3_spec.harness.worlds import make_world

CFG = SpecConfig(page_size=4, topk=4, num_steps=4, num_draft_tokens=5, max_bs=8, max_context_len=40)


def _leaves(md):
    return torch.utils._pytree.tree_leaves(md)


@pytest.mark.parametrize("mode", MODES)
def test_empty_batch_is_an_ordinary_shape(mode):
    world = make_world(CFG, 0)
    md = build(mode, CFG, step=2, **world.mode_kwargs(mode, draft_attention="branch"))
    for leaf in _leaves(md):
        if leaf.dim() == 2:
            assert leaf.shape[0] == 0
    assert all(leaf.numel() == 1 for leaf in _leaves(md) if leaf.dim() == 1 and leaf.shape[0] == 1)


@pytest.mark.parametrize("mode", MODES)
def test_padding_rows_read_nothing_and_leave_live_rows_alone(mode):
    world = make_world(CFG, 6, seq_lens=[7, 0, 40, 0, 1, 0], seed=4)
    md = build(mode, CFG, step=2, **world.mode_kwargs(mode, draft_attention="branch"))
    calls = md.calls
    for call in calls:
        per_req = call.num_rows // 6
        csl = call.cache_seqlens.view(6, per_req)
        table = call.page_table.view(6, per_req, -1)
        for b in (1, 3, 5):
            assert (csl[b] == 0).all() and (table[b] == 0).all()
    # Live rows are unchanged when padding rows are replaced by live ones.
    dense = make_world(CFG, 6, seq_lens=[7, 3, 40, 9, 1, 2], seed=4)
    md2 = build(mode, CFG, step=2, **dense.mode_kwargs(mode, draft_attention="branch"))
    calls2 = md2.calls
    for call, call2 in zip(calls, calls2):
        per_req = call.num_rows // 6
        for b in (0, 2, 4):
            rows = slice(b * per_req, (b + 1) * per_req)
            assert torch.equal(call.page_table[rows], call2.page_table[rows])
            assert torch.equal(call.cache_seqlens[rows], call2.cache_seqlens[rows])


@pytest.mark.parametrize("mode", MODES)
def test_max_context_fits_every_window(mode):
    world = make_world(CFG, 3, seq_lens=[CFG.max_context_len] * 3, seed=2)
    for step in range(CFG.num_steps - 1):
        md = build(mode, CFG, step=step, **world.mode_kwargs(mode, draft_attention="branch"))
        for call in md.calls:
            pages = (call.cache_seqlens + call.page_size - 1) // call.page_size
            assert int(pages.max()) <= call.page_table.shape[1]
            assert int(call.cache_seqlens.max()) <= call.max_seqlen_k


def _garbage(shape, dtype, g):
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=dtype, generator=g)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("mode", MODES)
def test_garbage_index_values_never_index_out_of_range(mode, seed):
    """Any values (within dtype) in every index tensor: no error, bounded reads."""
    g = torch.Generator().manual_seed(seed)
    bs, n = 5, CFG.num_draft_tokens
    kwargs = dict(
        req_to_token=_garbage((3, CFG.draft_row_len), torch.int32, g),
        req_pool_indices=_garbage((bs,), torch.int64, g),
        seq_lens=_garbage((bs,), torch.int64, g),
    )
    if mode == "draft_decode":
        kwargs["out_cache_loc"] = _garbage((bs * CFG.topk * CFG.num_steps,), torch.int64, g)
    if mode == "target_verify":
        kwargs["tree_mask"] = torch.randint(0, 2, (bs, n, n), generator=g).bool()
    if mode == "draft_extend":
        kwargs["extend_seq_lens"] = _garbage((bs,), torch.int64, g)
    for step in range(CFG.num_steps - 1):
        md = build(mode, CFG, step=step, **kwargs)
        for call in md.calls:
            csl = call.cache_seqlens.to(torch.int64)
            assert (csl >= 0).all() and (csl <= call.max_seqlen_k).all()
            assert ((csl + call.page_size - 1) // call.page_size <= call.page_table.shape[1]).all()
            cu = call.cu_seqlens_q.to(torch.int64)
            assert (cu.diff() >= 0).all() and (cu.diff() <= call.max_seqlen_q).all()


def test_builders_do_not_mutate_inputs():
    world = make_world(CFG, 4, num_padding=1, seed=9)
    for mode in MODES:
        kwargs = world.mode_kwargs(mode, draft_attention="branch")
        before = {k: v.clone() for k, v in kwargs.items()}
        build(mode, CFG, step=1, **kwargs)
        assert all(torch.equal(before[k], kwargs[k]) for k in kwargs)


# ----------------------------------------------------------- boundary errors
def _kw(mode="decode", **over):
    world = make_world(CFG, 3, seed=1)
    kw = world.mode_kwargs(mode, draft_attention="branch")
    kw.update(over)
    return kw


@pytest.mark.parametrize(
    "mode, over, exc, match",
    [
        ("decode", dict(seq_lens=torch.ones(3)), TypeError, "seq_lens"),
        ("decode", dict(seq_lens=torch.ones(4, dtype=torch.int64)), ValueError, "seq_lens"),
        ("decode", dict(req_pool_indices=torch.zeros(3, 1, dtype=torch.int64)), ValueError, "req_pool_indices"),
        ("decode", dict(req_to_token=torch.zeros(3, 10, dtype=torch.int32)), ValueError, "req_to_token"),
        ("decode", dict(req_to_token=[[0]]), TypeError, "req_to_token"),
        ("draft_decode", dict(out_cache_loc=torch.zeros(7, dtype=torch.int64)), ValueError, "out_cache_loc"),
        ("draft_decode", dict(out_cache_loc=None), ValueError, "out_cache_loc"),
        ("target_verify", dict(tree_mask=torch.ones(3, 5, 4, dtype=torch.bool)), ValueError, "tree_mask"),
        ("target_verify", dict(tree_mask=torch.ones(3, 5, 5)), TypeError, "tree_mask"),
        ("draft_extend", dict(extend_seq_lens=torch.ones(2, dtype=torch.int64)), ValueError, "extend_seq_lens"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(mode, over, exc, match):
    with pytest.raises(exc, match=match):
        build(mode, CFG, step=0, **_kw(mode, **over))


def test_batch_above_max_bs():
    world = make_world(CFG, CFG.max_bs + 1)
    with pytest.raises(ValueError, match="max_bs"):
        build("decode", CFG, **world.batch())


@pytest.mark.parametrize("step", [-1, CFG.num_steps - 1])
def test_step_outside_range(step):
    with pytest.raises(ValueError, match="step"):
        build("draft_decode", CFG, step=step, **_kw("draft_decode"))


def test_tail_copies_of_padding_rows_touch_only_slot_zero():
    cfg = fa3_spec.SpecConfig(page_size=4, topk=2, num_steps=3, num_draft_tokens=3, max_bs=4,
                              max_context_len=16)
    src, dst = fa3_spec.draft_tail_copy_slots(cfg, seq_lens=torch.tensor([0]),
                                              out_cache_loc=torch.full((1, 2, 3), 10**9))
    assert src.tolist() == dst.tolist() == [0] * 6
