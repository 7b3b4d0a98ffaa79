"""The draft "expand" page table for topk > 1 (the code path of sglang #27360).

In a topk > 1 draft step every branch attends the shared prefix (prefix call)
plus its own draft tokens (expand call). The expand call has one row per
branch; its page table lists the distinct pages, in order, of the branch's
first ``decode_length`` draft slots.

Worked example (the seed's case): ``P = 2``, ``S = 4``, ``seq_len = 5`` so
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

import torch

from . import _validate
from ._paged import repeat_rows
from .metadata import PAGE_SENTINEL


def draft_expand_page_table(
    cache_loc: torch.Tensor,
    last_page_lens: torch.Tensor,
    *,
    decode_length: int,
    topk: int,
    page_size: int,
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
    _validate.tensor("cache_loc", cache_loc, ndim=2)
    _validate.tensor("last_page_lens", last_page_lens, ndim=1)
    for name, value, minimum in (
        ("decode_length", decode_length, 1),
        ("topk", topk, 1),
        ("page_size", page_size, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
    rows = cache_loc.shape[0]
    if rows != last_page_lens.shape[0] * topk:
        raise ValueError(
            f"cache_loc has {rows} rows but last_page_lens has "
            f"{last_page_lens.shape[0]} requests x topk={topk}"
        )
    if cache_loc.shape[1] < decode_length:
        raise ValueError(
            f"cache_loc has {cache_loc.shape[1]} columns, fewer than "
            f"decode_length={decode_length}"
        )
    _validate.same_device(cache_loc=cache_loc, last_page_lens=last_page_lens)

    d = decode_length
    live = cache_loc[:, :d].to(torch.int64)  # the slice #27360 was missing
    device = cache_loc.device
    if page_size == 1:
        cache_seqlens = torch.full((rows,), d, dtype=torch.int32, device=device)
        sentinel = torch.full((rows, 1), PAGE_SENTINEL, dtype=torch.int64, device=device)
        return cache_seqlens, torch.cat([live, sentinel], dim=1).to(torch.int32)

    pages = torch.div(live, page_size, rounding_mode="floor")  # [n, d]
    starts_run = torch.ones_like(pages, dtype=torch.bool)
    starts_run = torch.cat([starts_run[:, :1], pages[:, 1:] != pages[:, :-1]], dim=1)
    run_index = torch.cumsum(starts_run.to(torch.int32), dim=1) - 1  # in [0, d-1]
    columns = torch.arange(d + 1, device=device)
    # first[n, j, c]: slot j opens the run that fills column c.
    first = starts_run.unsqueeze(2) & (run_index.unsqueeze(2) == columns)
    table = torch.where(first, pages.unsqueeze(2), 0).sum(dim=1)  # <= 1 term each
    table = torch.where(first.any(dim=1), table, PAGE_SENTINEL)

    last = last_page_lens.to(torch.int64).clamp(0, page_size - 1)
    cache_seqlens = (repeat_rows(last, topk) + d).to(torch.int32)
    return cache_seqlens, table.to(torch.int32)
