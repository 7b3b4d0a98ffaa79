"""The value invariants of checked mode, as device-side bit tests.

Each function tests one invariant of the inputs with plain torch ops (no
host sync, static shapes) and returns an int32 scalar holding its
`ErrorFlag` bit when some live row violates it. Every test reads the *raw*
inputs (int64, before any clamp or int32 cast) over exactly the token
positions the FA3 calls read (``docs/semantics.md``), and exempts padding
rows (``seq_len == 0``). A mode's `fa3_spec.builders.interface.Mode.flags` picks
the tests its inputs need; `fa3_spec.error_flags` adds the ones every mode
shares.
"""

from __future__ import annotations

import enum
from typing import Optional

import torch

from .offsets import repeat_rows
from .config import SpecConfig
from .paged import BatchView

#: Largest page id an int32 page table can hold.
INT32_MAX = 2**31 - 1


class ErrorFlag(enum.IntFlag):
    """Bits of the error mask."""

    REQUEST_INDEX_OUT_OF_RANGE = 1 << 0  # req_pool_indices outside req_to_token's rows
    SEQ_LEN_OUT_OF_RANGE = 1 << 1  # seq_len < 0 or > max_context_len (window past the row)
    DRAFT_LAYOUT = 1 << 2  # draft slots not in the documented topk > 1 layout
    TREE_MASK_NOT_A_TREE = 1 << 3  # not the ancestor-or-self relation of a parent array
    PAGE_ID_OUT_OF_RANGE = 1 << 4  # a page id FA3 will read outside the pool or int32
    EXTEND_LEN_OUT_OF_RANGE = 1 << 5  # extend_seq_len < 0, > N or > seq_len
    MISALIGNED_ROW = 1 << 6  # req_to_token row not page aligned where FA3 reads it
    ANCESTOR_SLOTS = 1 << 7  # ancestor slots outside the pool, in the prefix, or not one tree


#: What each bit means, in words (`fa3_spec.describe_errors`).
MESSAGES = {
    ErrorFlag.REQUEST_INDEX_OUT_OF_RANGE: "a req_pool_indices entry is outside req_to_token's rows",
    ErrorFlag.SEQ_LEN_OUT_OF_RANGE: "a seq_len is negative or above max_context_len "
    "(its window would run past the req_to_token row)",
    ErrorFlag.DRAFT_LAYOUT: "draft slots are not in the topk > 1 layout of docs/semantics.md: "
    "draft token s of a branch must sit at in-page offset (seq_len % P + s) % P, on consecutive "
    "slots within a page, on a new page exactly at each page boundary, with no page shared "
    "between branches or with the prefix's whole pages, and branch 0 (only) starting on the "
    "prefix's partial last page",
    ErrorFlag.TREE_MASK_NOT_A_TREE: "tree_mask is not the ancestor-or-self relation of a tree: "
    "row 0 must be {0}, and every other row must be its parent's row plus itself, its parent "
    "being its largest earlier attended token (no later token attended)",
    ErrorFlag.PAGE_ID_OUT_OF_RANGE: "a page id FA3 will read is outside the KV pool "
    "(or does not fit in int32)",
    ErrorFlag.EXTEND_LEN_OUT_OF_RANGE: "an extend_seq_len is negative, above num_draft_tokens "
    "or above its seq_len",
    ErrorFlag.MISALIGNED_ROW: "a req_to_token row is not page aligned where FA3 reads it: "
    "positions jP .. jP+P-1 must be the consecutive slots of one page",
    ErrorFlag.ANCESTOR_SLOTS: "ancestor_slots do not describe one draft tree in fresh slots: "
    "a slot is outside the KV pool, or also holds a token of the request's prefix, or "
    "appears at two different depths of one request, or two leaves of one request share "
    "their own (deepest) slot, or two leaves that share a slot at some depth disagree "
    "at a depth above it",
}


def flag(violated: torch.Tensor, bit: ErrorFlag) -> torch.Tensor:
    return violated.any().to(torch.int32) * int(bit)


def page_flags(slots: torch.Tensor, page_size: int, num_pages: Optional[int],
                live_rows: torch.Tensor, read: Optional[torch.Tensor] = None) -> torch.Tensor:
    """PAGE_ID bit: a read slot whose page is negative, past int32, or past the pool."""
    pages = torch.div(slots, page_size, rounding_mode="floor")
    bad = (pages < 0) | (pages > INT32_MAX)
    if num_pages is not None:
        bad = bad | (pages >= num_pages)
    mask = live_rows.view(-1, *([1] * (slots.dim() - 1)))
    if read is not None:
        mask = mask & read
    return flag(bad & mask, ErrorFlag.PAGE_ID_OUT_OF_RANGE)


def row_flags(cfg: SpecConfig, view: BatchView, length: torch.Tensor,
               num_pages: Optional[int]) -> torch.Tensor:
    """Page ids and page alignment of positions ``t < length[b]`` of each row.

    FA3 reads key ``t`` at page ``slot(P * (t // P)) // P``, offset ``t % P``;
    that is slot ``slot(t)`` only when the row is page aligned there.
    """
    p = cfg.page_size
    width = view.req_to_token.shape[1]
    t = torch.arange(min(width, cfg.min_row_len), device=length.device)
    read = t.unsqueeze(0) < length.unsqueeze(1)  # [B, T]
    positions = t.unsqueeze(0).expand(view.batch_size, -1)
    slots = view.raw_slots(positions)
    flags = page_flags(slots, p, num_pages, view.live, read)
    if p > 1:
        page_start = view.raw_slots(positions - positions % p)
        aligned = slots == page_start + positions % p
        aligned = aligned & (torch.remainder(page_start, p) == 0)
        flags = flags | flag(read & ~aligned & view.live.unsqueeze(1), ErrorFlag.MISALIGNED_ROW)
    return flags


def draft_layout_flags(cfg: SpecConfig, view: BatchView, loc: torch.Tensor) -> torch.Tensor:
    """DRAFT_LAYOUT bit for live draft slots ``loc`` (int64 ``[B*K, d]``).

    Draft token ``s`` of a branch sits at in-page offset ``(last + s) % P``;
    within a page the slots are consecutive; at each page boundary a new page
    starts that no earlier token of the branch used; no page is shared by two
    branches of a request, nor with the prefix's whole pages; and (``last >
    0``) branch 0's first page is the prefix's partial last page, which no
    other branch touches.
    """
    p, k = cfg.page_size, cfg.topk
    rows, d = loc.shape
    bs = view.batch_size
    s = torch.arange(d, device=loc.device)
    last = repeat_rows(view.last_page_lens, k).unsqueeze(1)  # [B*K, 1]
    offset = last + s  # position of token s counted from the branch's first page start
    pages = torch.div(loc, p, rounding_mode="floor")
    bad = torch.remainder(loc, p) != torch.remainder(offset, p)
    if d > 1:
        same_page = torch.div(offset[:, 1:], p, rounding_mode="floor") == torch.div(
            offset[:, :-1], p, rounding_mode="floor")
        step_ok = torch.where(same_page, loc[:, 1:] == loc[:, :-1] + 1, True)
        bad = bad | _pad_left(~step_ok)
    # Tokens on different pages of the layout must not share a physical page.
    page_index = torch.div(offset, p, rounding_mode="floor")  # [B*K, d]
    other_page = page_index.unsqueeze(2) != page_index.unsqueeze(1)
    clash = (pages.unsqueeze(2) == pages.unsqueeze(1)) & other_page
    bad = bad | clash.any(dim=2)
    # No page shared between the branches of one request (a shared page would
    # let one branch's drafts or tail copy overwrite keys another reads).
    per_request = pages.reshape(bs, k * d)
    branch = torch.arange(k * d, device=loc.device) // d
    dup = (per_request.unsqueeze(2) == per_request.unsqueeze(1)) & (
        branch.unsqueeze(1) != branch.unsqueeze(0))
    bad = bad | dup.any(dim=2).reshape(rows, d)
    # No draft on a page of the prefix's whole pages (the prefix call reads them).
    j = torch.arange(cfg.page_table_width, device=loc.device)
    prefix_pages = torch.div(view.raw_slots((j * p).unsqueeze(0).expand(bs, -1)), p,
                             rounding_mode="floor")  # [B, page_table_width]
    whole = j.unsqueeze(0) < torch.div(view.seq_lens - view.last_page_lens, p,
                                       rounding_mode="floor").unsqueeze(1)
    on_prefix = (per_request.unsqueeze(2) == prefix_pages.unsqueeze(1)) & whole.unsqueeze(1)
    bad = bad | on_prefix.any(dim=2).reshape(rows, d)
    # Branch 0 begins on the prefix's partial last page; no other branch touches it.
    tail_pos = (view.seq_lens - 1).clamp(min=0).unsqueeze(1)
    tail_page = torch.div(view.raw_slots(tail_pos), p, rounding_mode="floor")  # [B, 1]
    on_tail = pages.reshape(bs, k, d) == tail_page.unsqueeze(2)  # [B, K, d]
    is_branch0 = (torch.arange(k, device=loc.device) == 0).view(1, k)
    has_tail = (view.last_page_lens > 0).view(bs, 1)
    first_bad = has_tail & (on_tail[:, :, 0] != is_branch0)
    others_bad = has_tail.unsqueeze(2) & on_tail & ~is_branch0.unsqueeze(2)
    bad = bad.any(dim=1) | first_bad.reshape(rows) | others_bad.any(dim=2).reshape(rows)
    return flag(bad & repeat_rows(view.live, k), ErrorFlag.DRAFT_LAYOUT)


def ancestor_flags(cfg: SpecConfig, view: BatchView, slots: torch.Tensor,
                   num_pages: Optional[int]) -> torch.Tensor:
    """ANCESTOR_SLOTS bit for the live ancestor slots ``slots`` (int64 ``[B*K, d]``,
    depth ``i`` at column ``i``, the leaf's own slot last).

    Per request (a slot shared between two requests is not flagged): every slot is ``>= 0`` (and ``< num_pages * P`` when the pool
    size is known); none holds a prefix token (a slot on the page at column
    ``j`` of the row at offset ``o`` holds position ``j*P + o``, prefix iff
    ``< seq_len``: exact on page-aligned rows, which ``MISALIGNED_ROW``
    checks); no slot sits at two depths; no two leaves share their own slot;
    and leaves that share the slot at depth ``i`` share every depth above it
    (one node, one parent: the slots form a tree).
    """
    p, k = cfg.page_size, cfg.topk
    bs, d = view.batch_size, slots.shape[1]
    per_leaf = slots.view(bs, k, d)
    bad = per_leaf < 0
    if num_pages is not None:
        bad = bad | (per_leaf >= num_pages * p)
    bad = bad.any(dim=2)  # [B, K]
    # A prefix token's slot: on the row's page at column j, at offset o, it holds
    # position j*P + o, a prefix token iff j < ceil((seq_len - o) / P). Only bool
    # [B, K*d, W] temporaries (the table width W is the whole context at P = 1).
    j = torch.arange(cfg.page_table_width, device=slots.device)
    row_pages = torch.div(view.raw_slots((j * p).unsqueeze(0).expand(bs, -1)), p,
                          rounding_mode="floor")  # [B, W]
    flat = per_leaf.reshape(bs, k * d)
    page, offset = torch.div(flat, p, rounding_mode="floor"), flat % p
    columns = -torch.div(offset - view.seq_lens.view(bs, 1), p, rounding_mode="floor")  # [B, K*d]
    in_prefix = ((page.unsqueeze(2) == row_pages.unsqueeze(1))
                 & (j.view(1, 1, -1) < columns.unsqueeze(2)))
    bad = bad | in_prefix.any(dim=2).view(bs, k, d).any(dim=2)
    # One slot, one depth.
    depth = torch.arange(k * d, device=slots.device) % d
    same = flat.unsqueeze(2) == flat.unsqueeze(1)  # [B, K*d, K*d]
    two_depths = (same & (depth.unsqueeze(1) != depth.unsqueeze(0))).any(dim=2)
    bad = bad | two_depths.view(bs, k, d).any(dim=2)
    # Leaves own distinct slots, and agree above any depth where they agree.
    agree = per_leaf.unsqueeze(2) == per_leaf.unsqueeze(1)  # [B, K, K, d]
    leaf = torch.arange(k, device=slots.device)
    other = (leaf.unsqueeze(1) != leaf.unsqueeze(0)).unsqueeze(0)
    bad = bad | (agree[..., -1] & other).any(dim=2)
    differ = (~agree).to(torch.int32)
    differed_above = (torch.cumsum(differ, dim=-1) - differ) > 0
    bad = bad | (agree & differed_above).any(dim=3).any(dim=2)
    return flag(bad & view.live.unsqueeze(1), ErrorFlag.ANCESTOR_SLOTS)


def _pad_left(x: torch.Tensor) -> torch.Tensor:
    """``[n, d-1]`` bool -> ``[n, d]`` with a False column prepended."""
    return torch.cat([torch.zeros_like(x[:, :1]), x], dim=1)


def tree_mask_flags(tree_mask: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """TREE_MASK bit: ``tree_mask[b]`` must be the ancestor-or-self relation of a tree.

    Exactly: row 0 is ``{0}``; no row attends a later token; every row
    ``j > 0`` attends some earlier token, and equals ``row[parent] | {j}``
    where ``parent`` is its largest earlier attended token. By induction this
    holds iff the mask is ``tree_mask_from_parents`` of a parent array with
    ``parent[j] < j``.
    """
    mask = tree_mask.to(torch.bool)
    bs, n = mask.shape[0], mask.shape[-1]
    if n == 0:
        return torch.zeros((), dtype=torch.int32, device=mask.device)
    c = torch.arange(n, device=mask.device)
    eye = c.unsqueeze(1) == c.unsqueeze(0)
    later = c.unsqueeze(0) > c.unsqueeze(1)  # [j, c]: c > j
    earlier = c.unsqueeze(0) < c.unsqueeze(1)
    bad = (mask & later).flatten(1).any(dim=1) | (~mask & eye).flatten(1).any(dim=1)
    attended_earlier = mask & earlier
    parent = torch.where(attended_earlier, c, -1).amax(dim=2)  # [B, N]; -1 if none
    orphan = (parent[:, 1:] < 0).any(dim=1)
    parent_rows = torch.gather(mask, 1, parent.clamp(min=0).unsqueeze(2).expand(bs, n, n))
    expected = (parent_rows & (parent >= 0).unsqueeze(2)) | eye
    wrong = (mask != expected).flatten(1).any(dim=1)
    return flag((bad | orphan | wrong) & live, ErrorFlag.TREE_MASK_NOT_A_TREE)
