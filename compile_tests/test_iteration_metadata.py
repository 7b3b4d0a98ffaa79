"""All draft steps' metadata built together equals the per-step builders, bit for bit."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fa3_spec
from fa3_spec import draft_expand_page_table, draft_expand_tables
from fa3_spec.probes import RecordingBackend
from fa3_spec.harness.worlds import make_world
from helpers import FUZZ_EXAMPLES, NARROW, WIDE, configs, garbage_inputs, symbol_recorder, worlds


def _assert_same_as_per_step(cfg, kwargs):
    together = fa3_spec.build_draft_iteration_metadata(cfg, **kwargs)
    assert len(together) == cfg.num_steps - 1
    for step, got in enumerate(together):
        want = fa3_spec.build_draft_decode_metadata(cfg, step, draft_attention="branch", **kwargs)
        a, spec_a = torch.utils._pytree.tree_flatten(got)
        b, spec_b = torch.utils._pytree.tree_flatten(want)
        assert spec_a == spec_b  # same static ints (max_seqlen_k, page size, causal)
        for x, y in zip(a, b):
            assert x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
            assert x.numel() == 0 or x.stride(-1) == 1  # what FA3 needs of index tensors
    return together


@settings(max_examples=max(FUZZ_EXAMPLES // 4, 50), deadline=None)
@given(worlds(**WIDE))
def test_equals_per_step_builders(world):
    _assert_same_as_per_step(world.cfg, world.mode_kwargs("draft_decode", draft_attention="branch"))


@settings(max_examples=max(FUZZ_EXAMPLES // 4, 50), deadline=None)
@given(configs(**NARROW), st.integers(0, 12), st.integers(0, 2**20))
def test_equals_per_step_builders_on_garbage(cfg, bs, seed):
    _assert_same_as_per_step(cfg, garbage_inputs(cfg, bs, "draft_decode", seed))


def test_seed_example_of_the_docstring():
    loc = torch.tensor([[5, 6, 7, 8]])
    csl, tables = draft_expand_tables(loc, torch.tensor([1]), num_draft_steps=3, topk=1,
                                      page_size=2)
    assert tables.tolist() == [[[2, 0, 0, 0]], [[2, 3, 0, 0]], [[2, 3, 0, 0]]]
    assert csl.tolist() == [[2], [3], [4]]
    for i in range(3):
        one = draft_expand_page_table(loc, torch.tensor([1]), decode_length=i + 1, topk=1,
                                      page_size=2)
        assert torch.equal(one[0], csl[i]) and torch.equal(one[1], tables[i, :, : i + 2])


def test_validation_names_arguments():
    loc, last = torch.zeros(4, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="num_draft_steps=4"):
        draft_expand_tables(loc, last, num_draft_steps=4, topk=2, page_size=2)
    with pytest.raises(ValueError, match="num_draft_steps"):
        draft_expand_tables(loc, last, num_draft_steps=0, topk=2, page_size=2)
    with pytest.raises(TypeError, match="page_size"):
        draft_expand_tables(loc, last, num_draft_steps=2, topk=2, page_size=2.0)
    with pytest.raises(ValueError, match="out_cache_loc is required"):
        cfg = fa3_spec.SpecConfig(page_size=2, topk=2, num_steps=3, num_draft_tokens=2,
                                  max_bs=2, max_context_len=8)
        w = make_world(cfg, 2)
        fa3_spec.build_draft_iteration_metadata(cfg, **w.batch())


@pytest.mark.parametrize("p, k", [(1, 1), (16, 1), (1, 4), (2, 8), (64, 4)])
def test_compiles_fullgraph_without_data_dependent_ops(p, k):
    cfg = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=5, num_draft_tokens=8, max_bs=8,
                              max_context_len=256)
    world = make_world(cfg, 6, num_padding=2, seed=p + k)
    kwargs = world.mode_kwargs("draft_decode", draft_attention="branch")
    counter = RecordingBackend("aot_eager")
    fn = torch.compile(lambda **kw: fa3_spec.build_draft_iteration_metadata(cfg, **kw),
                       fullgraph=True, backend=counter)
    got = fn(**kwargs)
    other = make_world(cfg, 6, seed=p + k + 1).mode_kwargs("draft_decode", draft_attention="branch")
    fn(**other)  # new values, same shapes: no recompile
    assert counter.frame_count == 1 and counter.data_dependent == []
    for a, b in zip(got, fa3_spec.build_draft_iteration_metadata(cfg, **kwargs)):
        assert all(torch.equal(x, y) for x, y in zip(torch.utils._pytree.tree_leaves(a),
                                                     torch.utils._pytree.tree_leaves(b)))


def test_two_configs_in_one_process_keep_every_config_field_static():
    """A user's compiled function takes a MetadataBuilder as an argument and is called
    with three configurations: each compiles its own graph whose only symbolic size is
    the batch dimension the caller marked dynamic (a bare SpecConfig argument would get
    symbolic page sizes and step counts from dynamo's automatic dynamic shapes), and a
    new builder of an equal configuration, or new values, compile nothing."""
    record = []
    fn = torch.compile(lambda builder, kw: builder.draft_iteration(**kw),
                       fullgraph=True, backend=symbol_recorder(record))
    base = make_world(fa3_spec.SpecConfig(page_size=2, topk=4, num_steps=5, num_draft_tokens=6,
                                          max_bs=8, max_context_len=40), 3, seed=1)
    for steps, page_size in [(5, 2), (4, 2), (4, 1), (5, 2)]:
        cfg = fa3_spec.SpecConfig(page_size=page_size, topk=4, num_steps=steps,
                                  num_draft_tokens=6, max_bs=8, max_context_len=40)
        builder = fa3_spec.MetadataBuilder(cfg, draft_attention="branch")
        rows = base.req_pool_indices.view(-1, 1, 1)
        loc = base.req_to_token[rows, builder.draft_positions(base.seq_lens)].long()
        kw = dict(base.batch(), out_cache_loc=loc)
        for t in (kw["req_pool_indices"], kw["seq_lens"], loc):
            torch._dynamo.mark_dynamic(t, 0)
        got = fn(builder, kw)
        want = fa3_spec.build_draft_iteration_metadata(cfg, **kw)
        assert torch.utils._pytree.tree_flatten(got)[1] == torch.utils._pytree.tree_flatten(want)[1]
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
            assert torch.equal(a, b)
    assert len(record) == 3  # one graph per config; the fourth call reuses the first
    assert all(found == {"L['kw']['req_pool_indices'].size()[0]"} for found in record), record


def test_a_bare_config_argument_is_what_the_builder_exists_for():
    """The premise of MetadataBuilder, checked on this torch: the same function taking a
    bare SpecConfig gets its second configuration's ints as symbols."""
    record = []
    fn = torch.compile(lambda cfg, seq_lens: fa3_spec.draft_positions(cfg, seq_lens, "branch"),
                       fullgraph=True, backend=symbol_recorder(record))
    for page_size in (2, 4):
        cfg = fa3_spec.SpecConfig(page_size=page_size, topk=4, num_steps=3, num_draft_tokens=6,
                                  max_bs=8, max_context_len=40)
        fn(cfg, torch.tensor([5, 7]))
    assert record[0] == set() and any("page_size" in s for s in record[1]), record
