"""Property-based fuzzing over wide configurations (the ranges docs/semantics.md allows).

Page sizes are any int in 1..128 (powers of two are not required anywhere in
the builders). Example counts: FA3_SPEC_FUZZ_EXAMPLES (default 250 per
property, in CI; 1000 or more, with the "dev" hypothesis profile, for a long run).
"""

import dataclasses

import torch
from hypothesis import given, settings, strategies as st

import fa3_spec
from fa3_spec import MODES, build_metadata as build
from helpers import FUZZ_EXAMPLES, WIDE, assert_builder_matches, configs, garbage_inputs, worlds

fuzz = settings(max_examples=FUZZ_EXAMPLES, deadline=None)


@fuzz
@given(worlds(**WIDE), st.sampled_from(list(MODES)), st.booleans(), st.data())
def test_parity_and_page_ids_in_pool(world, mode, tree, data):
    cfg = world.cfg
    step = data.draw(st.integers(0, cfg.num_steps - 2))
    kwargs = world.mode_kwargs(mode, tree=tree, draft_attention="branch")
    got = assert_builder_matches(world, mode, step, tree, spec_slots=False)
    for call in got.calls:
        pool = world.num_pages * (cfg.page_size if call.page_size == 1 else 1)
        assert ((call.page_table >= 0) & (call.page_table.to(torch.int64) < pool)).all()
    assert int(fa3_spec.error_flags(cfg, mode, step=step, num_pages=world.num_pages, **kwargs)) == 0


@fuzz
@given(configs(**WIDE), st.integers(0, 24), st.sampled_from(list(MODES)), st.integers(0, 2**20), st.data())
def test_garbage_values_never_index_out_of_range(cfg, bs, mode, seed, data):
    kwargs = garbage_inputs(cfg, bs, mode, seed, pool_rows=data.draw(st.integers(1, 4)),
                            r2t_dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))
    n = cfg.num_draft_tokens
    step = data.draw(st.integers(0, cfg.num_steps - 2))
    for call in build(mode, cfg, step=step, **kwargs).calls:
        csl = call.cache_seqlens.to(torch.int64)
        assert (csl >= 0).all() and (csl <= call.max_seqlen_k).all()
        assert ((csl + call.page_size - 1) // call.page_size <= call.page_table.shape[1]).all()
        assert int(call.cu_seqlens_q[-1]) <= max(bs, 1) * call.max_seqlen_q * max(cfg.topk, n)


@fuzz
@given(worlds(**WIDE), st.sampled_from(list(MODES)), st.data())
def test_padding_rows_never_change_live_rows(world, mode, data):
    bs = world.batch_size
    pad = torch.tensor(data.draw(st.lists(st.booleans(), min_size=bs, max_size=bs)), dtype=torch.bool)
    cfg = world.cfg
    step = cfg.num_steps - 2
    a = build(mode, cfg, step=step, **world.mode_kwargs(mode, draft_attention="branch"))
    padded = world.mode_kwargs(mode, draft_attention="branch")
    padded["seq_lens"] = torch.where(pad, 0, world.seq_lens) if bs else world.seq_lens
    b = build(mode, cfg, step=step, **padded)
    for x, y in zip(a.calls, b.calls):
        per = x.num_rows // bs if bs else 1
        live_rows = (~pad).repeat_interleave(per) if bs else torch.zeros(0, dtype=torch.bool)
        assert torch.equal(x.page_table[live_rows], y.page_table[live_rows])
        assert torch.equal(x.cache_seqlens[live_rows], y.cache_seqlens[live_rows])
        assert (y.cache_seqlens[~live_rows] == 0).all() and (y.page_table[~live_rows] == 0).all()


@fuzz
@given(configs(**WIDE), st.integers(0, 24), st.sampled_from(list(MODES)), st.integers(1, 10**6),
       st.integers(0, 2**20), st.data())
def test_pool_size_keeps_every_page_id_in_the_pool_whatever_the_inputs(cfg, bs, mode, num_pages,
                                                                        seed, data):
    """With ``cfg.num_pages`` set, garbage slots in req_to_token and out_cache_loc
    still give page ids inside the pool: FA3 cannot be pointed outside it (the
    memcheck run on the H200 found FA3 reading wild addresses without it)."""
    cfg = dataclasses.replace(cfg, num_pages=num_pages)
    kwargs = garbage_inputs(cfg, bs, mode, seed)
    step = data.draw(st.integers(0, cfg.num_steps - 2))
    for call in build(mode, cfg, step=step, **kwargs).calls:
        pool = num_pages * cfg.page_size // call.page_size
        ids = call.page_table.to(torch.int64)
        assert ((ids >= 0) & (ids < pool)).all()
    if mode == "draft_decode" and bs:
        src, dst = fa3_spec.draft_tail_copy_slots(cfg, seq_lens=kwargs["seq_lens"],
                                                  out_cache_loc=kwargs["out_cache_loc"])
        for slots in (src, dst):
            assert ((slots >= 0) & (slots < num_pages * cfg.page_size)).all()
    if mode == "draft_decode" and cfg.topk > 1:
        for call in fa3_spec.build_draft_iteration_metadata(cfg, **kwargs):
            ids = call.expand.page_table.to(torch.int64)
            assert ((ids >= 0) & (ids < num_pages)).all()
