"""Builders vs the upstream-style reference and vs the key sets of docs/semantics.md."""

import pytest

from fa3_spec import SpecConfig
from fa3_spec import MODES, build_metadata as build
from fa3_spec.harness.worlds import make_world
from fa3_spec.harness.oracle import metadata_mismatches
from helpers import assert_builder_matches

# Named workloads: the seed's case first.
WORKLOADS = {
    "seed_p2_k8": (SpecConfig(page_size=2, topk=8, num_steps=5, num_draft_tokens=6,
                              max_bs=16, max_context_len=96), [5, 1, 2, 64, 95, 96, 0]),
    "chain_p1": (SpecConfig(page_size=1, topk=1, num_steps=4, num_draft_tokens=4,
                            max_bs=8, max_context_len=64), [1, 7, 64, 0]),
    "chain_p16": (SpecConfig(page_size=16, topk=1, num_steps=3, num_draft_tokens=4,
                             max_bs=8, max_context_len=200), [15, 16, 17, 200]),
    "tree_p1_k4": (SpecConfig(page_size=1, topk=4, num_steps=5, num_draft_tokens=8,
                              max_bs=8, max_context_len=64), [1, 33, 64, 0, 2]),
    "tree_p64_k8": (SpecConfig(page_size=64, topk=8, num_steps=6, num_draft_tokens=16,
                               max_bs=8, max_context_len=300), [63, 64, 65, 1, 300]),
    "odd_page_p3_k3": (SpecConfig(page_size=3, topk=3, num_steps=4, num_draft_tokens=5,
                                  max_bs=8, max_context_len=50), [2, 3, 4, 49, 50]),
}


def _cases():
    for name, (cfg, seqs) in WORKLOADS.items():
        for mode in MODES:
            steps = range(cfg.num_steps - 1) if mode == "draft_decode" else [0]
            trees = [True, False] if mode == "target_verify" else [True]
            for step in steps:
                for tree in trees:
                    yield pytest.param(name, mode, step, tree, id=f"{name}-{mode}-s{step}-t{int(tree)}")


@pytest.mark.parametrize("name, mode, step, tree", list(_cases()))
def test_builder_matches_reference_and_spec(name, mode, step, tree):
    cfg, seqs = WORKLOADS[name]
    world = make_world(cfg, len(seqs), seq_lens=seqs, seed=7)
    assert_builder_matches(world, mode, step, tree)


def test_seed_example_expand_rows():
    """docs/semantics.md, the #27360 example: P=2, S=4, seq_len=5: branch 0's S slots span 3 pages."""
    cfg = SpecConfig(page_size=2, topk=2, num_steps=4, num_draft_tokens=4, max_bs=1,
                     max_context_len=16)
    world = make_world(cfg, 1, seq_lens=[5])
    assert world.draft_positions[0, 0].tolist() == [5, 6, 7, 8]
    r2t = world.req_to_token[world.req_pool_indices[0]]
    page = lambda pos: int(r2t[pos]) // 2  # noqa: E731
    expected_rows = {0: [page(5)], 1: [page(5), page(6)], 2: [page(5), page(6)]}
    # All S slots span 3 distinct pages: more than step 0's 2-column row.
    assert len({page(p) for p in (5, 6, 7, 8)}) == 3
    for step, pages in expected_rows.items():
        md = build("draft_decode", cfg, step=step, **world.mode_kwargs("draft_decode", draft_attention="branch"))
        row = md.expand.page_table[0].tolist()
        assert row == pages + [0] * (step + 2 - len(pages))
        assert int(md.expand.cache_seqlens[0]) == step + 1 + 1  # d + last


def test_prefix_reuse_gives_identical_steps():
    cfg, seqs = WORKLOADS["seed_p2_k8"]
    world = make_world(cfg, len(seqs), seq_lens=seqs)
    from fa3_spec import build_draft_decode_metadata, build_draft_prefix_metadata

    prefix = build_draft_prefix_metadata(cfg, **world.batch(), draft_attention="branch")
    for step in range(cfg.num_steps - 1):
        a = build_draft_decode_metadata(cfg, step, draft_attention="branch",
                                        **world.mode_kwargs("draft_decode",
                                                            draft_attention="branch"))
        b = build_draft_decode_metadata(cfg, step, draft_attention="branch", prefix=prefix,
                                        **world.mode_kwargs("draft_decode",
                                                            draft_attention="branch"))
        assert metadata_mismatches(a, b) == []
