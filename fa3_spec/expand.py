"""The draft "expand" page table for topk > 1 (the code path of sglang #27360).

In a topk > 1 draft step every branch attends the shared prefix (prefix call)
plus its own draft tokens (expand call). The expand call has one row per
branch; its page table lists the distinct pages, in order, of the branch's
first ``decode_length`` draft slots.

Worked example: ``P = 2``, ``S = 4``, ``seq_len = 5`` so
``last = seq_len % P = 1``. Branch 0's draft tokens sit at row positions
5, 6, 7, 8 (identity slots here, so page = position // 2)::

    position   4    5  | 6    7  | 8    9
    page       --- 2 --- | --- 3 --- | --- 4 ---
    holds      tail d0   | d1   d2   | d3   .
               (copy of prefix token 4; for branch 0 it *is* token 4)

    step  d   live slots   distinct pages  cache_seqlens  page_table (d+1 cols)
    0     1   5            2               1 + 1 = 2      [2, 0]
    1     2   5 6          2 3             2 + 1 = 3      [2, 3, 0]
    2     3   5 6 7        2 3             3 + 1 = 4      [2, 3, 0, 0]
    (all S)   5 6 7 8      2 3 4           -- what the pre-fix code read at every step

The pre-fix upstream code scattered pages of all ``S = 4`` slots (3 distinct
pages) into the 2-column row of step 0: column 2 does not exist, and the write
landed in the next row of the CUDA-graph buffer. Here only ``cache_loc[:, :d]``
is ever read, and the table is built by comparison and reduction, with no
indexed write at all: column ``c`` is the page of the first slot whose
run-index equals ``c``, and run-indices are ``< d`` by construction.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import _validate
from .offsets import repeat_rows
from .paged import in_pool
from .metadata import PAGE_SENTINEL


def draft_expand_page_table(
    cache_loc: torch.Tensor,
    last_page_lens: torch.Tensor,
    *,
    decode_length: int,
    topk: int,
    page_size: int,
    num_pages: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand-call ``cache_seqlens`` and ``page_table`` of one draft step.

    Args:
        cache_loc: int ``[B * topk, >= decode_length]`` draft slots of each
            branch, request-major (``out_cache_loc`` viewed ``[B*K, S]``). Any
            width is safe: only the first ``decode_length`` columns are read.
        last_page_lens: int ``[B]`` ``seq_len % page_size`` per request
            (ignored when ``page_size == 1``); clamped to ``[0, page_size-1]``.
        decode_length: live draft tokens per branch, ``d = step + 1``.
        topk: branches per request.
        page_size: KV page size ``P``.
        num_pages: KV pool size in pages; when given, page ids are clamped
            into ``[0, num_pages)`` (valid slots are unchanged).

    Returns:
        ``(cache_seqlens, page_table)``: int32 ``[B * topk]`` and int32
        ``[B * topk, decode_length + 1]``.

        * ``P == 1``: ``cache_seqlens = d``; the row is the ``d`` slots.
        * ``P > 1``: ``cache_seqlens = d + last``; the row is the distinct
          consecutive pages of ``cache_loc[n, :d] // P``, in order.

        Columns past the live ones hold `PAGE_SENTINEL`. Whatever the values
        of the inputs, no index is read or written out of range, and
        ``cache_seqlens <= d + P - 1`` so FA3 reads at most
        ``ceil((P - 1 + d) / P) <= d`` columns of the ``d + 1``.

    Compiles to one fused graph (no host sync, no data-dependent shape) and
    is safe inside CUDA-graph capture.
    """
    _check_ints(decode_length=decode_length, topk=topk, page_size=page_size)
    _check_shapes(cache_loc, last_page_lens, "decode_length", decode_length, topk)
    # Step d of an iteration of d steps: the run structure is the same.
    cache_seqlens, tables = draft_expand_tables(
        cache_loc[:, :decode_length], last_page_lens, num_draft_steps=decode_length,
        topk=topk, page_size=page_size, num_pages=num_pages)  # the slice #27360 was missing
    return cache_seqlens[-1], tables[-1]


def draft_expand_tables(
    cache_loc: torch.Tensor,
    last_page_lens: torch.Tensor,
    *,
    num_draft_steps: int,
    topk: int,
    page_size: int,
    num_pages: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`draft_expand_page_table` for every draft step of an iteration at once.

    Step ``i`` (``d = i + 1``, ``0 <= i < num_draft_steps``) gets exactly the
    live columns `draft_expand_page_table` gives it: the run structure of
    ``cache_loc[n, :d]`` is a prefix of that of ``cache_loc[n, :D]``
    (``D = num_draft_steps``), so one pass over ``D`` slots serves all steps.

    Returns ``(cache_seqlens, page_tables)``: int32 ``[D, rows]`` and int32
    ``[D, rows, D + 1]``. Step ``i`` uses ``cache_seqlens[i]`` (contiguous) and
    ``page_tables[i, :, :i + 2]`` (a view with row stride ``D + 1``; FA3 only
    needs a unit stride along a row). Columns ``c`` past step ``i``'s live
    pages hold `PAGE_SENTINEL`.

    Example (``P = 2``, one branch at row positions 5, 6, 7, 8 on identity
    slots, ``last = 1``, ``D = 3``): pages ``[2, 3, 3]``, so

        >>> cache_seqlens, page_tables = draft_expand_tables(
        ...     torch.tensor([[5, 6, 7, 8]]), torch.tensor([1]),
        ...     num_draft_steps=3, topk=1, page_size=2)
        >>> page_tables.tolist(), cache_seqlens.tolist()  # ok-host: doctest
        ([[[2, 0, 0, 0]], [[2, 3, 0, 0]], [[2, 3, 0, 0]]], [[2], [3], [4]])

    For ``D <= 8`` this is elementwise work only (inductor unrolls reductions
    that small): one fused kernel for all steps' tables.
    """
    _check_ints(num_draft_steps=num_draft_steps, topk=topk, page_size=page_size)
    _check_shapes(cache_loc, last_page_lens, "num_draft_steps", num_draft_steps, topk)
    steps = num_draft_steps
    if num_pages is not None:
        _check_ints(num_pages=num_pages)
    live = in_pool(cache_loc[:, :steps], page_size, num_pages)
    rows = live.shape[0]
    device = live.device
    d = torch.arange(1, steps + 1, device=device).view(steps, 1)
    cols = torch.arange(steps + 1, device=device).view(1, 1, steps + 1)
    if page_size == 1:
        table = F.pad(live, (0, 1), value=PAGE_SENTINEL).unsqueeze(0)
        table = torch.where(cols < d.unsqueeze(2), table, PAGE_SENTINEL)
        cache_seqlens = d.expand(steps, rows)
        return cache_seqlens.to(torch.int32), table.to(torch.int32)
    full, runs = _distinct_pages(live, page_size)  # [rows, D+1], [rows, D]
    live_cols = cols < runs.t().unsqueeze(2)  # [D, rows, D+1]
    table = torch.where(live_cols, full.unsqueeze(0), PAGE_SENTINEL)
    last = last_page_lens.to(torch.int64).clamp(0, page_size - 1)
    cache_seqlens = repeat_rows(last, topk).unsqueeze(0) + d
    return cache_seqlens.to(torch.int32), table.to(torch.int32)


def page_runs(slots: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs of equal consecutive pages among ``slots`` (int ``[n, d]``, a row per branch).

    Returns ``(pages, opens, runs)``, each ``[n, d]``: ``pages = slots // P``
    (int64); ``opens[n, j]``, slot ``j`` starts a new run (its page differs
    from slot ``j - 1``'s; always for ``j = 0``); ``runs[n, j]`` (int64), the
    number of runs among slots ``0 .. j``, so ``runs[:, d' - 1]`` distinct
    pages fill the expand table of a step with ``d'`` live slots. The prefix
    counts are a triangular-mask sum rather than a ``cumsum``: for small ``d``
    inductor unrolls it, and the whole table is one fused kernel.

        >>> page_runs(torch.tensor([[5, 6, 7, 8]]), 2)[2].tolist()   # pages 2 3 3 4; ok-host: doctest
        [[1, 2, 2, 3]]
    """
    d = slots.shape[1]
    pages = torch.div(slots.to(torch.int64), page_size, rounding_mode="floor")
    j = torch.arange(d, device=slots.device)
    previous = pages[:, (j - 1).clamp(min=0)]  # elementwise, unlike a cat (a kernel per input)
    opens = (j == 0) | (pages != previous)
    upto = torch.ones(d, d, dtype=torch.bool, device=slots.device).tril()  # [j, j']: j' <= j
    runs = (opens.unsqueeze(1) & upto).sum(dim=2)
    return pages, opens, runs


def _distinct_pages(live: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(table, runs)`` of the pages of ``live`` slots (int64 ``[n, d]``).

    ``table[n, c]`` (``[n, d + 1]``) is the page of the ``c``-th run of
    `page_runs` (0 where there is none). Column ``c`` is filled by the slot
    that opens a run and has ``c`` runs before it; run counts are ``<= d``,
    so every column index is in range.
    """
    d = live.shape[1]
    pages, opens, runs = page_runs(live, page_size)
    columns = torch.arange(d + 1, device=live.device)
    fills = opens.unsqueeze(2) & ((runs - 1).unsqueeze(2) == columns)  # [n, j, c]
    table = torch.where(fills, pages.unsqueeze(2), 0).sum(dim=1)  # <= 1 term each
    return table, runs


def _check_ints(**values: int) -> None:
    for name, value in values.items():
        _validate.positive_int(name, value)


def _check_shapes(cache_loc, last_page_lens, width_name: str, width: int, topk: int) -> None:
    _validate.tensor("cache_loc", cache_loc, ndim=2)
    _validate.tensor("last_page_lens", last_page_lens, ndim=1)
    rows = cache_loc.shape[0]
    if rows != last_page_lens.shape[0] * topk:
        raise ValueError(
            f"cache_loc has {rows} rows but last_page_lens has "
            f"{last_page_lens.shape[0]} requests x topk={topk}"
        )
    if cache_loc.shape[1] < width:
        raise ValueError(
            f"cache_loc has {cache_loc.shape[1]} columns, fewer than {width_name}={width}"
        )
    _validate.same_device(cache_loc=cache_loc, last_page_lens=last_page_lens)
