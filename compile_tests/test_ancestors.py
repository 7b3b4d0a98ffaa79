"""Tree drafts that attend their true ancestors (``ancestor_slots``).

For random parent choices at every draft step on shuffled slots
(`make_world`'s ``ancestor_positions``), each leaf must read exactly the
whole prefix plus its own path: checked by what the metadata makes FA3 read
(`key_slots_read`) against the key-set oracle (`expected_key_slots`), and
through `cascade_attention` against a dense float64 attention over those
keys, eagerly and compiled (fullgraph). Then the recurrence helper, memory
safety on garbage, sliding windows, every boundary error, and checked mode.
"""

import dataclasses
import itertools

import pytest
import torch

import fa3_spec
from fa3_spec import ErrorFlag, error_flags
from fa3_spec.harness.oracle import (
    dead_columns_clean,
    dense_attention,
    expected_key_slots,
    key_slots_read,
    num_queries,
)
from fa3_spec.harness.worlds import fill_kv_cache, make_world

HQ, HKV, DIM = 4, 2, 8


def _world(p, k, s=4, seed=0, ctx=40):
    cfg = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=s, num_draft_tokens=5, max_bs=8,
                              max_context_len=ctx)
    seqs = [1, p + 1, 0, ctx, max(p - 1, 1), 2 * p if 2 * p <= ctx else 3]
    return make_world(cfg, len(seqs), seq_lens=seqs, seed=seed + 7 * p + k)


def _build(world, step, **kw):
    return fa3_spec.build_draft_decode_metadata(
        world.cfg, step, draft_attention="ancestors", **world.mode_kwargs("draft_decode",
                                                                          step=step, draft_attention="ancestors"),
        **kw)


@pytest.mark.parametrize("p, k", [(1, 4), (2, 4), (16, 8), (2, 1)])
def test_each_leaf_reads_the_prefix_and_exactly_its_ancestors(p, k):
    world = _world(p, k)
    cfg = world.cfg
    moved = 0
    for step in range(cfg.num_steps - 1):
        md = _build(world, step)
        read = key_slots_read(md, num_queries(world, "draft_decode"))
        assert read == expected_key_slots(world, "draft_decode", step=step,
                                          draft_attention="ancestors")
        assert dead_columns_clean(md)
        assert md.prefix.draft_attention == "ancestors" and md.prefix.page_size == p
        assert md.expand.page_size == 1 and md.expand.page_table.shape == (world.batch_size * k,
                                                                           step + 1)
        branch = expected_key_slots(world, "draft_decode", step=step, draft_attention="branch")  # sglang's semantics
        moved += sum(a != b for a, b in zip(read, branch))
    assert moved > 0  # the two semantics read different keys here


def test_whole_iteration_attention_matches_dense_float64_eager_and_compiled():
    """Metadata + cascade (torch backend) in float64 against dense attention over
    the oracle's keys at every step; the last step also compiled fullgraph
    (aot_eager), with no recompile when only values change."""
    worlds = [_world(2, 4, seed=s) for s in range(2)]
    cfg = worlds[0].cfg
    g = torch.Generator().manual_seed(5)

    def step_fn(q, kc, vc, r2t, rpi, seq, anc, step):
        prefix = fa3_spec.build_draft_prefix_metadata(cfg, req_to_token=r2t, req_pool_indices=rpi,
                                                      seq_lens=seq, draft_attention="ancestors")
        md = fa3_spec.build_draft_decode_metadata(cfg, step, draft_attention="ancestors",
                                                  req_to_token=r2t, req_pool_indices=rpi,
                                                  seq_lens=seq, ancestor_slots=anc, prefix=prefix)
        return fa3_spec.cascade_attention(q, kc, vc, md, attention_backend="torch")

    compiled = torch.compile(step_fn, fullgraph=True, backend="aot_eager")
    for w in worlds:
        kc, vc = fill_kv_cache(w, num_kv_heads=HKV, head_dim=DIM, dtype=torch.float64,
                               seed=int(w.seq_lens.sum()))
        for step in range(cfg.num_steps - 1):
            q = torch.randn(num_queries(w, "draft_decode"), HQ, DIM, generator=g,
                            dtype=torch.float64)
            args = (q, kc, vc, w.req_to_token, w.req_pool_indices, w.seq_lens,
                    w.ancestor_slots(step), step)
            want = dense_attention(q, kc, vc, expected_key_slots(
                w, "draft_decode", step=step, draft_attention="ancestors"))
            eager = step_fn(*args)
            torch.testing.assert_close(eager, want, atol=1e-12, rtol=1e-12)
            if step < cfg.num_steps - 2:
                continue
            with torch._dynamo.config.patch(error_on_recompile=w is worlds[1]):
                torch.testing.assert_close(compiled(*args), eager, atol=1e-12, rtol=1e-12)


def test_draft_ancestor_slots_is_the_parent_gather():
    g = torch.Generator().manual_seed(0)
    bs, k, steps = 3, 4, 4
    own = torch.randint(0, 1000, (steps, bs, k), generator=g)
    parents = torch.randint(0, k, (steps, bs, k), generator=g)
    paths = [[[int(own[0, b, t])] for t in range(k)] for b in range(bs)]
    anc = fa3_spec.draft_ancestor_slots(torch.zeros(bs, k, 0, dtype=torch.int64), parents[0], own[0])
    for i in range(1, steps):
        paths = [[paths[b][int(parents[i, b, t])] + [int(own[i, b, t])] for t in range(k)]
                 for b in range(bs)]
        anc = fa3_spec.draft_ancestor_slots(anc, parents[i], own[i])
        assert anc.tolist() == paths
    garbage = torch.tensor([[-5, 99, 3, 1]] * bs)  # clamped into [0, K-1]: never out of range
    assert fa3_spec.draft_ancestor_slots(anc, garbage, own[0]).shape == (bs, k, steps + 1)
    bad = [((anc.int(), parents[0], own[0]), TypeError, "prev"),
           ((anc, parents[0].int(), own[0]), TypeError, "parent_branch"),
           ((anc, parents[0][:, :2], own[0]), ValueError, "parent_branch"),
           ((anc, parents[0], own[0][:2]), ValueError, "own_slots"),
           ((anc[0], parents[0], own[0]), ValueError, "prev")]
    for args, error, name in bad:
        with pytest.raises(error, match=name):
            fa3_spec.draft_ancestor_slots(*args)


def test_only_the_first_d_columns_are_read_and_padding_reads_nothing():
    world = _world(2, 4)
    for step in range(world.cfg.num_steps - 1):
        wide = world.ancestor_slots(step)  # later columns hold other leaves' slots
        narrow = fa3_spec.build_draft_decode_metadata(
            world.cfg, step, draft_attention="ancestors", **world.batch(), ancestor_slots=wide[:,
                                                                                               :, : step + 1].reshape(-1, step + 1))
        md = _build(world, step)
        for a, b in zip(md.calls, narrow.calls):
            assert torch.equal(a.page_table, b.page_table) and torch.equal(a.cache_seqlens, b.cache_seqlens)
        pad = (world.seq_lens == 0).repeat_interleave(world.cfg.topk)
        assert (md.expand.cache_seqlens[pad] == 0).all() and (md.expand.page_table[pad] == 0).all()
        assert (md.prefix.cache_seqlens[world.seq_lens == 0] == 0).all()


@pytest.mark.parametrize("seed", range(3))
def test_garbage_ancestor_slots_stay_inside_the_pool(seed):
    world = _world(2, 4)
    cfg = dataclasses.replace(world.cfg, num_pages=world.num_pages)
    g = torch.Generator().manual_seed(seed)
    info = torch.iinfo(torch.int64)
    anc = torch.randint(info.min, info.max, (world.batch_size, cfg.topk, 3), generator=g)
    md = fa3_spec.build_draft_decode_metadata(cfg, 2, draft_attention="ancestors", **world.batch(),
                                              ancestor_slots=anc)
    assert int(md.expand.page_table.min()) >= 0
    assert int(md.expand.page_table.max()) < world.num_pages * cfg.page_size
    assert int(md.expand.cache_seqlens.max()) <= md.expand.max_seqlen_k == 3
    assert int(md.prefix.page_table.max()) < world.num_pages


@pytest.mark.parametrize("p, k", [(1, 4), (16, 8), (2, 1)])
def test_a_window_keeps_the_last_keys_of_each_leafs_path(p, k):
    """``window_left`` works in this mode: the ancestors are the newest keys."""
    world = _world(p, k)
    for step, w in itertools.product(range(world.cfg.num_steps - 1), (0, 2, 9, 1000)):
        md = fa3_spec.build_metadata("draft_decode", world.cfg, step=step, window_left=w,
                                     **world.mode_kwargs("draft_decode", step=step,
                                                         draft_attention="ancestors"))
        read = key_slots_read(md, num_queries(world, "draft_decode"))
        full = expected_key_slots(world, "draft_decode", step=step, draft_attention="ancestors")
        assert [sorted(r) for r in read] == [sorted(f[max(0, len(f) - 1 - w):]) for f in full]


def test_every_boundary_error_names_its_argument():
    world = _world(2, 4)
    cfg, kw = world.cfg, world.batch()
    anc = world.ancestor_slots(2)
    cases = [
        (dict(ancestor_slots=anc.int()), TypeError, "ancestor_slots must have dtype"),
        (dict(ancestor_slots=anc[:, :2]), ValueError, r"ancestor_slots must be \[B, K, d'\]"),
        (dict(ancestor_slots=anc[:, :, :0]), ValueError, "d' >= 1"),
        (dict(ancestor_slots=anc.reshape(-1)), ValueError, "ancestor_slots must be"),
        (dict(ancestor_slots=anc[:, :, :2]), ValueError, "fewer than the 3 depths"),
        (dict(ancestor_slots=anc, out_cache_loc=world.out_cache_loc), ValueError, "not both"),
        ({}, ValueError, "needs out_cache_loc .* or ancestor_slots"),
        (dict(ancestor_slots=anc, prefix=fa3_spec.build_draft_prefix_metadata(cfg, **kw, draft_attention="branch")),
         ValueError, "prefix was built for draft_attention='branch'"),
        (dict(out_cache_loc=world.out_cache_loc, prefix=fa3_spec.build_draft_prefix_metadata(
            cfg, **kw, draft_attention="ancestors")), ValueError, "built for draft_attention='ancestors'"),
    ]
    # The free builder is told the semantics, so it names the input that
    # semantics does or does not read where the batch-level checks cannot.
    stated = {"not both": "out_cache_loc is not read with draft_attention='ancestors'",
              "needs out_cache_loc .* or ancestor_slots": "out_cache_loc is required"}
    for extra, error, match in cases:
        attention = "ancestors" if "ancestor_slots" in extra else "branch"
        with pytest.raises(error, match=stated.get(match, match)):
            fa3_spec.build_draft_decode_metadata(cfg, 2, **kw, **extra, draft_attention=attention)
        if "prefix" not in extra:  # the mode table and checked mode validate the same way
            with pytest.raises(error, match=match):
                fa3_spec.build_metadata("draft_decode", cfg, step=2, **kw, **extra)
            with pytest.raises(error, match=match):
                error_flags(cfg, "draft_decode", step=2, **kw, **extra)
    with pytest.raises(ValueError, match="draft_attention must be one of"):
        fa3_spec.build_draft_prefix_metadata(cfg, **kw, draft_attention="tree")
    with pytest.raises(ValueError, match="draft_attention must be one of"):
        fa3_spec.draft_positions(cfg, world.seq_lens, "tree")
    batch = fa3_spec.SpecBatch.create(cfg, **kw, ancestor_slots=anc)
    assert batch.ancestor_slots.shape == (world.batch_size * cfg.topk, cfg.num_steps - 1)
    with pytest.raises(ValueError, match="cannot prebuild ancestor steps"):
        fa3_spec.builders.draft.draft_iteration_metadata(batch)
    with pytest.raises(TypeError, match="takes no"):
        fa3_spec.build_metadata("target_verify", cfg, **kw, ancestor_slots=anc)
    # topk = 1: a chain over the row without either, or over any slots with ancestor_slots.
    chain = _world(2, 1)
    assert isinstance(fa3_spec.build_metadata("draft_decode", chain.cfg, step=1, **chain.batch()),
                      fa3_spec.FA3Metadata)
    assert isinstance(_build(chain, 1), fa3_spec.CascadeMetadata)



def test_the_free_step_builder_takes_the_semantics_it_is_told():
    """`build_draft_decode_metadata` never reads the semantics off the tensor
    it was given: ``draft_attention`` is required, and a slot tensor the
    stated semantics does not read is refused by name."""
    world = _world(2, 4)
    cfg, kw, anc = world.cfg, world.batch(), world.ancestor_slots(1)
    with pytest.raises(TypeError, match="draft_attention"):
        fa3_spec.build_draft_decode_metadata(cfg, 1, **kw, ancestor_slots=anc)
    with pytest.raises(ValueError,
                       match="ancestor_slots is not read with draft_attention='branch'"):
        fa3_spec.build_draft_decode_metadata(cfg, 1, **kw, ancestor_slots=anc,
                                             draft_attention="branch")
    with pytest.raises(ValueError, match="ancestor_slots is required"):
        fa3_spec.build_draft_decode_metadata(cfg, 1, **kw, draft_attention="ancestors")
    with pytest.raises(ValueError, match="draft_attention must be one of"):
        fa3_spec.build_draft_decode_metadata(cfg, 1, **kw, out_cache_loc=world.out_cache_loc,
                                             draft_attention="tree")
    stated = fa3_spec.build_draft_decode_metadata(cfg, 1, **kw, ancestor_slots=anc,
                                                  draft_attention="ancestors")
    bound = fa3_spec.MetadataBuilder(cfg, draft_attention="ancestors").build(
        "draft_decode", step=1, **kw, ancestor_slots=anc)
    assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(stated),
                                                 torch.utils._pytree.tree_leaves(bound)))

def _anc_flags(world, step, anc, num_pages=None):
    return int(error_flags(world.cfg, "draft_decode", step=step, **world.batch(),
                           ancestor_slots=anc, num_pages=num_pages or world.num_pages))


def test_checked_mode_flags_each_broken_tree_and_no_valid_one():
    world = _world(2, 4)
    cfg = world.cfg
    for step in range(cfg.num_steps - 1):
        assert _anc_flags(world, step, world.ancestor_slots(step)) == 0
    step, b = 2, 1  # request 1 is live (seq_len P + 1)
    anc = world.ancestor_slots(step)
    row = world.req_to_token[world.req_pool_indices[b]]
    planted = {
        "negative": lambda a: a[b, 0, 0].fill_(-1),
        "outside the pool": lambda a: a[b, 0, 1].fill_(world.num_pages * cfg.page_size),
        "a prefix token": lambda a: a[b, 2, 2].fill_(int(row[int(world.seq_lens[b]) - 1])),
        "two depths": lambda a: a[b, 3, 2].copy_(a[b, 0, 1]),
        "shared own slot": lambda a: a[b, 1, 2].copy_(a[b, 0, 2]),
    }
    # Fresh slots: leaves 0 and 1 share their depth-1 node but not its parent.
    f = row[int(world.seq_lens[b]):][: cfg.ancestor_draft_slots].to(torch.int64)
    tree = torch.stack([f[[0, 2, 4]], f[[0, 2, 5]], f[[0, 3, 6]], f[[0, 3, 7]]])
    two_parents = tree.clone()
    two_parents[1, 0] = f[1]
    for name, paths in (("valid tree", tree), ("two parents", two_parents)):
        planted[name] = lambda a, paths=paths: a[b].copy_(paths)
    for name, plant in planted.items():
        bad = anc.clone()
        plant(bad)
        flags = _anc_flags(world, step, bad)
        assert bool(flags & ErrorFlag.ANCESTOR_SLOTS) == (name != "valid tree"), name
        pad = anc.clone()
        pad[2] = bad[1]  # the same values on a padding row: exempt
        assert _anc_flags(world, step, pad) == 0, name
    # Past the pool is also a page id FA3 would read out of range.
    bad = anc.clone()
    bad[b, 0, 1] = world.num_pages * cfg.page_size
    assert _anc_flags(world, step, bad) & ErrorFlag.PAGE_ID_OUT_OF_RANGE
    messages = fa3_spec.describe_errors(torch.tensor(int(ErrorFlag.ANCESTOR_SLOTS)))
    assert len(messages) == 1 and "ancestor_slots" in messages[0]


def test_the_prefix_call_reads_the_whole_prefix_and_is_a_labelled_pytree():
    import torch.utils._pytree as pytree

    world = _world(16, 4)
    prefix = fa3_spec.build_draft_prefix_metadata(world.cfg, **world.batch(),
                                                  draft_attention="ancestors")
    branch = fa3_spec.build_draft_prefix_metadata(world.cfg, **world.batch(), draft_attention="branch")
    assert torch.equal(prefix.cache_seqlens.long(), world.seq_lens)
    assert torch.equal(branch.cache_seqlens.long(), world.seq_lens - world.seq_lens % 16)
    leaves, spec = pytree.tree_flatten(prefix)
    back = pytree.tree_unflatten(leaves, spec)
    assert type(back) is fa3_spec.DraftPrefixMetadata and back.draft_attention == "ancestors"
    assert len(leaves) == 4  # tensors only; the label is static
