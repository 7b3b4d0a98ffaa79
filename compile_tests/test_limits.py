"""Limits: the edge of the context window, large batches and long contexts, determinism."""

import pytest
import torch

import fa3_spec
from fa3_spec import MODES, build_metadata as build
from fa3_spec.harness.oracle import (
    expected_key_slots,
    key_slots_read,
    metadata_mismatches,
    num_queries,
)
from fa3_spec.harness.worlds import make_world


@pytest.mark.parametrize("p, k", [(1, 1), (2, 8), (7, 3), (64, 4)])
def test_seq_lens_at_the_end_of_the_window(p, k):
    cfg = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=4, num_draft_tokens=6, max_bs=8,
                              max_context_len=70)
    seqs = [cfg.max_context_len - j for j in range(cfg.num_draft_tokens + 1)]
    world = make_world(cfg, len(seqs), seq_lens=seqs, seed=p)
    for mode in MODES:
        for step in (range(cfg.num_steps - 1) if mode == "draft_decode" else [0]):
            md = build(mode, cfg, step=step, **world.mode_kwargs(mode, draft_attention="branch"))
            read = key_slots_read(md, num_queries(world, mode))
            want = expected_key_slots(world, mode, step=step, draft_attention="branch")
            assert read == want + [[]] * (len(read) - len(want))


def test_topk_10_with_8_steps():
    cfg = fa3_spec.SpecConfig(page_size=3, topk=10, num_steps=8, num_draft_tokens=40, max_bs=8,
                              max_context_len=50)
    world = make_world(cfg, 5, num_padding=1, seed=3)
    for step in range(cfg.num_steps - 1):
        md = build("draft_decode", cfg, step=step, **world.mode_kwargs("draft_decode", draft_attention="branch"))
        read = key_slots_read(md, num_queries(world, "draft_decode"))
        assert read == expected_key_slots(world, "draft_decode", step=step, draft_attention="branch")


@pytest.mark.parametrize("p", [1, 64])
def test_batch_512_at_128k_context(p):
    cfg = fa3_spec.SpecConfig(page_size=p, topk=4, num_steps=3, num_draft_tokens=4, max_bs=512,
                              max_context_len=128 * 1024)
    bs = 512
    # A pool shared by all requests: every row is its own run of pages.
    pages = fa3_spec.config.cdiv(cfg.min_row_len, p)
    rows = torch.arange(bs + 1, dtype=torch.int64).view(-1, 1) * pages
    pos = torch.arange(cfg.min_row_len)
    r2t = ((1 + rows + pos // p) * p + pos % p).to(torch.int32)
    seq = torch.randint(1, cfg.max_context_len + 1, (bs,), generator=torch.Generator().manual_seed(0))
    seq[-3:] = cfg.max_context_len
    seq[:2] = 0
    batch = dict(req_to_token=r2t, req_pool_indices=torch.arange(bs) + 1, seq_lens=seq)
    md = fa3_spec.build_decode_metadata(cfg, **batch)
    assert md.page_table.shape == (bs, cfg.page_table_width)
    last_row = md.page_table[-1]
    used = (cfg.max_context_len + p - 1) // p
    assert torch.equal(last_row[:used].to(torch.int64), 1 + bs * pages + torch.arange(used))
    assert (last_row[used:] == 0).all() and (md.page_table[:2] == 0).all()
    prefix = fa3_spec.build_draft_prefix_metadata(cfg, **batch, draft_attention="branch")
    assert int(prefix.cache_seqlens.max()) <= cfg.max_context_len


@pytest.mark.parametrize("mode", MODES)
def test_builders_are_bitwise_deterministic(mode):
    cfg = fa3_spec.SpecConfig(page_size=2, topk=8, num_steps=5, num_draft_tokens=6, max_bs=8,
                              max_context_len=64)
    world = make_world(cfg, 6, num_padding=2, seed=4)
    kw = world.mode_kwargs(mode, draft_attention="branch")
    names = list(kw)

    def fn(*tensors):
        return build(mode, cfg, step=2, **dict(zip(names, tensors)))

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    outs = [fn(*kw.values()), fn(*kw.values()), compiled(*kw.values()), compiled(*kw.values())]
    leaves = [torch.utils._pytree.tree_leaves(o) for o in outs]
    for other in leaves[1:]:
        assert all(torch.equal(a, b) for a, b in zip(leaves[0], other))
    assert metadata_mismatches(outs[0], outs[2]) == []
