import torch
from hypothesis import given, strategies as st

from fa3_spec import tree_mask_from_flat, tree_mask_from_parents
from fa3_spec.tree import flat_from_tree_mask, mask_block_starts


def _parents(draw_parents, n):
    return torch.tensor([[-1] + [draw_parents[c - 1] % c for c in range(1, n)]])


@given(st.integers(1, 12), st.lists(st.integers(0, 1000), min_size=11, max_size=11))
def test_parents_to_ancestor_mask(n, raw):
    parents = _parents(raw, n)
    mask = tree_mask_from_parents(parents)[0]
    for j in range(n):
        ancestors, node = {j}, j
        while parents[0, node] >= 0:
            node = int(parents[0, node])
            ancestors.add(node)
        assert {c for c in range(n) if mask[j, c]} == ancestors


@given(st.lists(st.integers(0, 20), min_size=0, max_size=6), st.integers(1, 6), st.integers(0, 99))
def test_flat_roundtrip(seq_lens, n, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.randint(0, 2, (len(seq_lens), n, n), generator=g).bool()
    sl = torch.tensor(seq_lens, dtype=torch.int64)
    flat = flat_from_tree_mask(mask, sl)
    assert flat.numel() == int(((sl + n) * n).sum())
    assert torch.equal(tree_mask_from_flat(flat, sl, n), mask)


def test_flat_extraction_compiles():
    mask = torch.tril(torch.ones(3, 4, 4, dtype=torch.bool))
    sl = torch.tensor([2, 0, 5])
    flat = flat_from_tree_mask(mask, sl)
    fn = torch.compile(tree_mask_from_flat, fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(flat, sl, 4), mask)


# int64 offsets into the flat custom mask
def test_flat_mask_block_offsets_do_not_wrap_at_int32():
    starts = mask_block_starts(torch.tensor([2**30, 3]), 2)
    assert starts.dtype == torch.int64
    assert starts.tolist() == [0, 2 * (2**30 + 2)]  # > 2^31: wrapped negative in int32


def test_flat_mask_past_two_gib_decodes_the_second_request():
    """Full size: a 2.1 GB flat mask (one request of 2^30 tokens)."""
    seq = torch.tensor([2**30, 3])
    n = 2
    flat = torch.zeros(n * (2**30 + n) + n * (3 + n), dtype=torch.bool)
    second = n * (2**30 + n)
    rows = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    for j in range(n):
        flat[second + j * (3 + n) + 3: second + j * (3 + n) + 3 + n] = rows[j]
    mask = tree_mask_from_flat(flat, seq, n)
    assert torch.equal(mask[1], rows)

