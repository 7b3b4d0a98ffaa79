"""The expand page table and the #27360 bug (docs/semantics.md, "The #27360 bug")."""

import pytest
import torch

from fa3_spec import SpecConfig, draft_expand_page_table
from fa3_spec.harness.worlds import make_world
from fa3_spec.harness.upstream import UpstreamStyleBuilder

SEED_CFG = SpecConfig(page_size=2, topk=8, num_steps=5, num_draft_tokens=6, max_bs=8,
                      max_context_len=64)


def _unique_consecutive_rows(cache_loc, d, p, width):
    rows = []
    for row in (cache_loc[:, :d] // p).tolist():
        distinct = [x for i, x in enumerate(row) if i == 0 or x != row[i - 1]]
        rows.append(distinct + [0] * (width - len(distinct)))
    return rows


@pytest.mark.parametrize("p", [2, 3, 16])
@pytest.mark.parametrize("d", [1, 2, 4, 7])
def test_matches_unique_consecutive(p, d):
    g = torch.Generator().manual_seed(p * 10 + d)
    # Random non-decreasing slots: runs of equal pages of random length.
    cache_loc = torch.cumsum(torch.randint(0, 3, (12, 8), generator=g), dim=1) + 40
    last = torch.randint(0, p, (3,), generator=g)
    csl, table = draft_expand_page_table(cache_loc, last, decode_length=d, topk=4, page_size=p)
    assert table.shape == (12, d + 1) and table.dtype == torch.int32
    assert table.tolist() == _unique_consecutive_rows(cache_loc, d, p, d + 1)
    assert csl.tolist() == (last.repeat_interleave(4) + d).tolist()


@pytest.mark.parametrize("width", [1, 3, 5, 40])
def test_any_cache_loc_width_is_safe(width):
    """Only the first decode_length columns are read, however wide cache_loc is."""
    d = 1
    g = torch.Generator().manual_seed(width)
    base = torch.randint(0, 1000, (6, 1), generator=g)
    cache_loc = torch.cat([base, torch.randint(0, 10**6, (6, width - 1), generator=g)], dim=1)
    csl, table = draft_expand_page_table(cache_loc, torch.ones(3, dtype=torch.int64),
                                         decode_length=d, topk=2, page_size=2)
    assert table.shape == (6, 2)
    assert table[:, 0].tolist() == (base[:, 0] // 2).tolist()
    assert (table[:, 1] == 0).all()


def test_page_size_one_copies_slots():
    cache_loc = torch.arange(20).view(4, 5)
    csl, table = draft_expand_page_table(cache_loc, torch.zeros(2, dtype=torch.int64),
                                         decode_length=3, topk=2, page_size=1)
    assert table.tolist() == [r[:3] + [0] for r in cache_loc.tolist()]
    assert csl.tolist() == [3] * 4


def test_fa3_never_reads_past_the_row_whatever_last_page_lens_holds():
    cache_loc = torch.arange(8).view(2, 4) * 5
    garbage_last = torch.tensor([-(2**40), 2**40])
    for d in range(1, 5):
        csl, table = draft_expand_page_table(cache_loc, garbage_last, decode_length=d,
                                             topk=1, page_size=4)
        pages_read = (csl + 3) // 4
        assert (csl >= 0).all() and (pages_read <= table.shape[1] - 1).all()


def test_validation_names_arguments():
    loc, last = torch.zeros(4, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="cache_loc has 3 columns"):
        draft_expand_page_table(loc, last, decode_length=4, topk=2, page_size=2)
    with pytest.raises(ValueError, match="last_page_lens"):
        draft_expand_page_table(loc, last, decode_length=2, topk=3, page_size=2)
    with pytest.raises(TypeError, match="cache_loc"):
        draft_expand_page_table(loc.float(), last, decode_length=2, topk=2, page_size=2)
    with pytest.raises(ValueError, match="decode_length"):
        draft_expand_page_table(loc, last, decode_length=0, topk=2, page_size=2)


def test_pre_fix_switch_reproduces_the_overflow_and_the_fix_does_not():
    world = make_world(SEED_CFG, 4, seq_lens=[5, 9, 31, 2], seed=3)
    kwargs = world.mode_kwargs("draft_decode", draft_attention="branch")
    broken = UpstreamStyleBuilder(SEED_CFG, revert_pr_27360=True)
    with pytest.raises(RuntimeError, match="out of bounds"):
        broken.draft_decode(0, **kwargs)
    fixed = UpstreamStyleBuilder(SEED_CFG)
    for step in range(SEED_CFG.num_steps - 1):
        fixed.draft_decode(step, **kwargs)  # no error at any step


def test_pre_fix_switch_only_affects_page_size_above_one():
    cfg = SpecConfig(page_size=1, topk=8, num_steps=5, num_draft_tokens=6, max_bs=4,
                     max_context_len=32)
    world = make_world(cfg, 3, seed=1)
    UpstreamStyleBuilder(cfg, revert_pr_27360=True).draft_decode(0, **world.mode_kwargs("draft_decode", draft_attention="branch"))
