"""The request-level FA3 call every mode starts from."""

from __future__ import annotations

from typing import Optional

import torch

from ..offsets import cu_seqlens, scan_cu_seqlens, uniform_cu_seqlens
from ..metadata import FA3Metadata
from ..paged import BatchView


def request_call(
    view: BatchView,
    lengths: torch.Tensor,
    *,
    queries_per_row: int,
    max_seqlen_k: int,
    causal: bool,
    cu_seqlens_q: Optional[torch.Tensor] = None,
) -> FA3Metadata:
    """One row per request attending its first ``lengths[b]`` tokens.

    ``lengths`` is int64 ``[B]``; padding rows get length 0. The page table is
    ``cfg.page_table_width`` wide. Unless given, ``cu_seqlens_q`` gives every row
    ``queries_per_row`` queries (``max_seqlen_q`` is that number either way).
    """
    cfg = view.cfg
    lengths = torch.where(view.live, lengths, 0)
    cache_seqlens = lengths.to(torch.int32)
    if cu_seqlens_q is None:
        cu_seqlens_q = uniform_cu_seqlens(view.batch_size, queries_per_row, lengths.device)
    return FA3Metadata(
        page_table=view.page_table(lengths, cfg.page_table_width),
        cache_seqlens=cache_seqlens,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens(cache_seqlens),
        max_seqlen_q=queries_per_row,
        max_seqlen_k=max_seqlen_k,
        page_size=cfg.page_size,
        causal=causal,
    )


def slot_call(page_table: torch.Tensor, cache_seqlens: torch.Tensor, *,
              max_seqlen_k: int) -> FA3Metadata:
    """An expand call whose table lists token *slots*: page size 1, one query per row.

    ``page_table`` int32 ``[rows, W]`` (slot ids, sentinel past each row's
    ``cache_seqlens``), ``cache_seqlens`` int32 ``[rows]``. Not causal: each
    row's one query attends exactly its listed slots.
    """
    rows = cache_seqlens.shape[0]
    return FA3Metadata(
        page_table=page_table,
        cache_seqlens=cache_seqlens,
        cu_seqlens_q=uniform_cu_seqlens(rows, 1, cache_seqlens.device),
        cu_seqlens_k=scan_cu_seqlens(cache_seqlens),  # per-token rows
        max_seqlen_q=1,
        max_seqlen_k=max_seqlen_k,
        page_size=1,
        causal=False,
    )
