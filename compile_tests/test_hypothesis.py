"""Property-based parity on random configurations and worlds."""

import torch
from hypothesis import given, strategies as st

from fa3_spec import CascadeMetadata
from fa3_spec import MODES, build_metadata as build
from helpers import NARROW, assert_builder_matches, worlds


@given(worlds(**NARROW), st.sampled_from(list(MODES)), st.booleans(), st.data())
def test_random_worlds_match_reference_and_spec(world, mode, tree, data):
    step = data.draw(st.integers(0, world.cfg.num_steps - 2))
    assert_builder_matches(world, mode, step, tree)


@given(worlds(**NARROW), st.sampled_from(list(MODES)), st.data())
def test_batch_permutation_permutes_rows(world, mode, data):
    """Permuting requests permutes the metadata rows accordingly."""
    bs = world.batch_size
    perm = torch.tensor(data.draw(st.permutations(list(range(bs)))), dtype=torch.int64)
    cfg = world.cfg
    kwargs = world.mode_kwargs(mode, draft_attention="branch")
    permuted = dict(kwargs)
    for name in ("req_pool_indices", "seq_lens", "extend_seq_lens", "tree_mask"):
        if name in permuted and permuted[name] is not None:
            permuted[name] = permuted[name][perm] if bs else permuted[name]
    if "out_cache_loc" in permuted:
        permuted["out_cache_loc"] = permuted["out_cache_loc"].view(bs, -1)[perm].reshape(-1)
    step = cfg.num_steps - 2
    a = build(mode, cfg, step=step, **kwargs)
    b = build(mode, cfg, step=step, **permuted)
    calls = [(a, b)] if not isinstance(a, CascadeMetadata) else [(a.prefix, b.prefix), (a.expand, b.expand)]
    for x, y in calls:
        per = x.num_rows // bs if bs else 1
        rows = (perm.view(-1, 1) * per + torch.arange(per)).reshape(-1)
        assert torch.equal(x.page_table[rows], y.page_table)
        assert torch.equal(x.cache_seqlens[rows], y.cache_seqlens)
