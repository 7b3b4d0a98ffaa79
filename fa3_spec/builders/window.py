"""Sliding-window (SWA) metadata for every mode (docs/semantics.md, "Sliding-window layers").

A layer with left window ``W`` lets a query at position ``pos`` read only the
keys of its own key set at positions ``>= pos - W``: the last ``W + 1``
positions of its path, itself included. Every mode's key set is a path of
consecutive positions ``0 .. pos``: the prefix ``0 .. s-1`` of the request's
row, then the query's draft path. Positions, per mode (``s = seq_len``)::

    decode                 pos = s - 1
    draft topk = 1, step i pos = s + i           (drafts follow in the row)
    draft topk > 1, step i pos = s + i           (every branch at depth i)
    verify chain, token j  pos = s + j
    verify tree, token j   pos = s + depth(j)    depth = attended drafts - 1
    draft extend, query j  pos = s - e + j

**Single calls** (decode, draft topk = 1 on ``out_cache_loc``, chain verify, draft extend;
with ``ancestor_slots`` a draft step is a cascade at any topk). A row's
queries are consecutive positions ending at its last key, so FA3's
bottom-right alignment is the true position, and FA3's own window cuts
exactly. The table starts at the page of the first query's window start,
``start = floor(max(L - n - W, 0) / P)``, and every key index shifts by
``start * P``, queries included, so ``window_left = W`` (carried by the
metadata) still cuts at ``pos - W``. Keys read ``<= W + n + P - 1``, so the
width is ``min(page_table_width, ceil((W + n - 1) / P) + 1)``.

**Cascades** (draft topk > 1, tree verify). The prefix call's queries share
no bottom-right position, so no window may be applied there; instead both
calls are trimmed so that together they read exactly ``[lo, pos]``, no
window at all. With ``D`` the static largest depth (``S - 2`` draft, ``N - 1``
verify), every query's window starts at or before ``lo_max = s + D - W``:

    prefix call  one row per request, keys [split, s), split = the first page
                 boundary >= max(lo_max, 0) (clamped to s): inside every
                 query's window, page-aligned, the same for every draft step
    expand call  one row per query, page size 1 (slot ids): the prefix
                 positions [lo, split) before the split (< P + D - depth),
                 then the path positions s .. pos that are >= lo

Expand width ``min(P + D, W + 1)``, prefix width ``ceil(max(W - D, 0) / P)``:
both narrow, independent of the context. The expand call reads the prefix
tail from the request's own row, so SWA layers need no tail copy. With
``W`` small against ``D`` the split sits at ``s`` and the prefix call is empty.

Each mode's `Mode.window` (in its own module) says which of the two shapes
its calls take and with which positions; this module builds them.
``fa3_spec.build_metadata(mode, ..., window_left=W)`` validates ``W`` and
dispatches through the mode table.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..offsets import cdiv_tensor, cu_seqlens, repeat_rows, uniform_cu_seqlens
from ..config import cdiv
from ..metadata import PAGE_SENTINEL, CascadeMetadata, FA3Metadata
from ..paged import BatchView
from ._common import slot_call


def _rows_from(view: BatchView, start_page: torch.Tensor, keys: torch.Tensor, width: int) -> torch.Tensor:
    """int32 ``[B, width]``: the row's pages from ``start_page`` on, over ``keys`` tokens."""
    p = view.cfg.page_size
    cols = torch.arange(width, device=keys.device)
    pages = torch.div(view.slots((start_page.unsqueeze(1) + cols) * p), p, rounding_mode="floor")
    used = cols < cdiv_tensor(keys, p).unsqueeze(1)
    return torch.where(used, pages, PAGE_SENTINEL).to(torch.int32)


def window_call(view: BatchView, lengths: torch.Tensor, n: int, w: int, max_seqlen_k: int,
                queries: Optional[torch.Tensor] = None) -> FA3Metadata:
    """One causal call whose row ``b`` has ``queries[b]`` (default ``n``) queries at
    positions ending at ``lengths[b] - 1``, trimmed to the window's first page."""
    cfg, p = view.cfg, view.cfg.page_size
    lengths = torch.where(view.live, lengths, 0)
    count = lengths.new_full(lengths.shape, n) if queries is None else queries
    start = torch.div((lengths - count - w).clamp(min=0), p, rounding_mode="floor")
    keys = (lengths - start * p).clamp(min=0)
    width = min(cfg.page_table_width, cdiv(w + n - 1, p) + 1)
    cache_seqlens = keys.to(torch.int32)
    cu_q = (uniform_cu_seqlens(view.batch_size, n, lengths.device) if queries is None
            else cu_seqlens(queries))
    return FA3Metadata(
        page_table=_rows_from(view, start, keys, width),
        cache_seqlens=cache_seqlens,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_seqlens(cache_seqlens),
        max_seqlen_q=n,
        max_seqlen_k=min(max_seqlen_k, w + n + p - 1),
        page_size=p,
        causal=True,
        window_left=w,
    )


def window_cascade(view: BatchView, path: torch.Tensor, depth: torch.Tensor, q: int,
                   max_depth: int, w: int) -> CascadeMetadata:
    """Exactly trimmed cascade. ``path`` int64 ``[B*q, M]``: slots of each query's
    draft path (position ``s + k`` at column ``k``); ``depth`` int64 ``[B*q]``:
    the query's own index in it (position ``s + depth``)."""
    cfg, p = view.cfg, view.cfg.page_size
    bs, rows = view.batch_size, path.shape[0]
    s = torch.where(view.live, view.seq_lens, 0)
    lo_max = (s + max_depth - w).clamp(min=0)
    split = torch.minimum(cdiv_tensor(lo_max, p) * p, s)  # [B], page aligned or s
    prefix_keys = torch.where(view.live, s - split, 0)
    prefix_width = min(cfg.page_table_width, max(1, cdiv(max(w - max_depth, 0), p)))
    prefix_len = prefix_keys.to(torch.int32)
    prefix = FA3Metadata(
        page_table=_rows_from(view, torch.div(split, p, rounding_mode="floor"), prefix_keys,
                              prefix_width),
        cache_seqlens=prefix_len,
        cu_seqlens_q=uniform_cu_seqlens(bs, q, s.device),
        cu_seqlens_k=cu_seqlens(prefix_len),
        max_seqlen_q=q,
        max_seqlen_k=max(1, min(cfg.max_context_len, w - max_depth)),
        page_size=p,
        causal=False,
    )

    live = repeat_rows(view.live, q)
    s_r, split_r = repeat_rows(s, q), repeat_rows(split, q)
    lo = (s_r + depth - w).clamp(min=0)
    before = (split_r - lo).clamp(min=0)  # prefix positions lo .. split-1
    first = (lo - s_r).clamp(min=0)  # first path index inside the window
    keys = torch.where(live, before + (depth + 1 - first).clamp(min=0), 0)
    width = min(p + max_depth, w + 1)
    cols = torch.arange(width, device=s.device)
    prefix_slots = view.slots((lo.unsqueeze(1) + cols).view(bs, q * width)).view(rows, width)
    k = (first.unsqueeze(1) + cols - before.unsqueeze(1)).clamp(0, path.shape[1] - 1)
    path_slots = torch.gather(path.to(torch.int64), 1, k)
    table = torch.where(cols < before.unsqueeze(1), prefix_slots, path_slots)
    table = torch.where(cols < keys.unsqueeze(1), table, PAGE_SENTINEL).to(torch.int32)
    cache_seqlens = keys.to(torch.int32)
    return CascadeMetadata(prefix=prefix, expand=slot_call(table, cache_seqlens, max_seqlen_k=width))
