"""MetadataBuilder: one deployment's static choices, bound once, equal to the free builders."""

import pytest
import torch
import torch.utils._pytree as pytree

import fa3_spec
from fa3_spec.harness.worlds import make_world
from fa3_spec.metadata_builder import shared_pool_pages
from helpers import symbol_recorder

CFG = fa3_spec.SpecConfig(page_size=2, topk=4, num_steps=4, num_draft_tokens=6, max_bs=8,
                          max_context_len=40)


def same(a, b) -> bool:
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    return sa == sb and all(torch.equal(x, y) for x, y in zip(la, lb))


@pytest.mark.parametrize("mode, attention, step", [
    ("decode", "ancestors", 0), ("target_verify", "ancestors", 0),
    ("draft_extend", "ancestors", 0), ("draft_decode", "ancestors", 2),
    ("draft_decode", "branch", 1)])
def test_every_mode_equals_the_free_builder(mode, attention, step):
    world = make_world(CFG, 5, num_padding=1, seed=3)
    kw = world.mode_kwargs(mode, step=step, draft_attention=attention)
    builder = fa3_spec.MetadataBuilder(CFG, draft_attention=attention)
    assert same(builder.build(mode, step=step, **kw),
                fa3_spec.build_metadata(mode, CFG, step=step, **kw))


def test_the_default_draft_attention_is_ancestors_and_the_other_slots_are_refused():
    world = make_world(CFG, 3, seed=1)
    ancestors = fa3_spec.MetadataBuilder(CFG)
    branch = fa3_spec.MetadataBuilder(CFG, draft_attention="branch")
    assert ancestors.draft_attention == "ancestors"
    with pytest.raises(ValueError, match="out_cache_loc is not read"):
        ancestors.build("draft_decode", step=0, **world.mode_kwargs("draft_decode", draft_attention="branch"))
    with pytest.raises(ValueError, match="ancestor_slots is not read"):
        branch.build("draft_decode", step=0,
                     **world.mode_kwargs("draft_decode", draft_attention="ancestors"))
    with pytest.raises(ValueError, match="ancestor_slots is required"):
        ancestors.build("draft_decode", step=0, **world.batch())
    with pytest.raises(ValueError, match="draft_iteration builds branch steps"):
        ancestors.draft_iteration(**world.mode_kwargs("draft_decode", draft_attention="branch"))
    with pytest.raises(ValueError, match="draft_attention must be one of"):
        fa3_spec.MetadataBuilder(CFG, draft_attention="leaf")


def test_the_builder_is_immutable_and_checks_its_arguments():
    builder = fa3_spec.MetadataBuilder(CFG, num_pages=500)
    with pytest.raises(AttributeError, match="immutable"):
        builder.draft_attention = "branch"
    builder.eval()  # training may still be switched
    assert builder.num_pages == 500 and builder.cfg.num_pages == 500
    with pytest.raises(TypeError, match="cfg must be a SpecConfig"):
        fa3_spec.MetadataBuilder({"page_size": 2})
    with pytest.raises(ValueError, match="num_pages=7 differs"):
        fa3_spec.MetadataBuilder(fa3_spec.SpecConfig(**{**_fields(CFG), "num_pages": 9}),
                                 num_pages=7)
    with pytest.raises(ValueError, match="num_pages"):
        fa3_spec.MetadataBuilder(CFG, num_pages=0)


def _fields(cfg):
    return {k: getattr(cfg, k) for k in ("page_size", "topk", "num_steps", "num_draft_tokens",
                                         "max_bs", "max_context_len")}


def test_sizes_follow_the_draft_semantics_and_shapes_share_one_pool():
    branch = fa3_spec.MetadataBuilder(CFG, draft_attention="branch")
    ancestors = fa3_spec.MetadataBuilder(CFG)
    assert branch.row_len == CFG.draft_row_len_for("branch")
    assert ancestors.row_len == CFG.draft_row_len_for("ancestors")
    assert ancestors.pool_pages(3) == CFG.pool_pages(3, "ancestors")
    chain = ancestors.with_shape(topk=1, num_steps=6, num_draft_tokens=7)
    assert (chain.cfg.page_size, chain.cfg.max_context_len, chain.draft_attention) == (
        CFG.page_size, CFG.max_context_len, "ancestors")
    pages = shared_pool_pages([ancestors, chain], 3)
    assert pages == max(ancestors.pool_pages(3), chain.pool_pages(3))
    pooled = fa3_spec.MetadataBuilder(CFG, num_pages=pages)
    assert pooled.with_shape(topk=1, num_steps=6, num_draft_tokens=7).num_pages == pages
    with pytest.raises(ValueError, match="builders must not be empty"):
        shared_pool_pages([], 3)


def test_a_step_closing_over_two_builders_keeps_both_configs_static():
    """Two shapes over one pool, compiled in one process through one function that
    closes over whichever builder it is given: no symbolic page size or step count."""
    record = []
    pages = 400
    big = fa3_spec.MetadataBuilder(CFG, num_pages=pages)
    small = big.with_shape(topk=2, num_steps=3, num_draft_tokens=4)
    world = make_world(CFG, 4, seed=2)

    def make(builder):
        return torch.compile(lambda kw: builder.build("target_verify", **kw), fullgraph=True,
                             backend=symbol_recorder(record))

    for builder in (big, small):
        kw = {**world.batch(), "tree_mask": None}
        got = make(builder)(kw)
        assert same(got, builder.build("target_verify", **kw))
    assert record == [set(), set()]
