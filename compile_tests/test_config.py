import pytest

from fa3_spec import SpecConfig


def cfg(**over):
    base = dict(page_size=2, topk=8, num_steps=5, num_draft_tokens=6, max_bs=64,
                max_context_len=8192)
    base.update(over)
    return SpecConfig(**base)


def test_static_bounds_of_the_spec_example():
    c = cfg()
    assert c.tokens_past_seq_len == 6  # max(S - 1, N)
    assert c.min_row_len == 8198
    assert c.page_table_width == 4099  # ceil(8198 / 2)
    assert c.pages_per_branch == 3  # ceil((P - 1 + S) / P)
    assert c.draft_row_len == 8192 + 8 * 3 * 2
    assert [c.decode_length(s) for s in range(4)] == [1, 2, 3, 4]
    assert [c.expand_width(s) for s in range(4)] == [2, 3, 4, 5]


@pytest.mark.parametrize("p, k", [(1, 1), (1, 8), (2, 8), (16, 4), (64, 1)])
def test_pool_pages_gives_every_request_its_whole_row_plus_the_sentinel_page(p, k):
    c = cfg(page_size=p, topk=k)
    for reqs in (1, 3, 64):
        assert c.pool_pages(reqs, "branch") == 1 + reqs * -(-c.draft_row_len // p)
        assert (c.pool_pages(reqs, "branch") - 1) * p >= reqs * c.draft_row_len
    with pytest.raises(ValueError, match="max_reqs"):
        c.pool_pages(0, "branch")


@pytest.mark.parametrize("p", [1, 2, 3, 16, 64, 128])
def test_expand_bound_is_tight_and_never_exceeds_decode_length(p):
    c = cfg(page_size=p, num_steps=9)
    for d in range(1, 9):
        worst = max(-(-(last + d) // p) for last in range(p))  # brute force over last
        assert c.expand_pages_bound(d) == worst <= d


@pytest.mark.parametrize(
    "field, value, exc",
    [
        ("page_size", 0, ValueError),
        ("topk", 0, ValueError),
        ("num_steps", 0, ValueError),
        ("num_draft_tokens", 0, ValueError),
        ("max_bs", 0, ValueError),
        ("max_context_len", 0, ValueError),
        ("page_size", 2.0, TypeError),
        ("topk", True, TypeError),
    ],
)
def test_invalid_config_names_the_field(field, value, exc):
    with pytest.raises(exc, match=field):
        cfg(**{field: value})


def test_config_is_immutable_and_hashable():
    c = cfg()
    with pytest.raises(Exception):
        c.page_size = 4
    assert hash(c) == hash(cfg())


@pytest.mark.parametrize("step", [-1, 4, 10])
def test_step_out_of_range(step):
    with pytest.raises(ValueError, match="step"):
        cfg().decode_length(step)
