"""Mode 1: plain decode, one query per request (SPEC §3.1)."""

from __future__ import annotations

import torch

from .. import _validate
from .._paged import BatchView
from ..config import SpecConfig
from ..metadata import FA3Metadata
from ._common import request_call


def build_decode_metadata(
    cfg: SpecConfig,
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
) -> FA3Metadata:
    """Metadata of a non-speculative decode step.

    Args:
        cfg: static configuration.
        req_to_token: int32/int64 ``[max_reqs, >= cfg.min_row_len]`` slots.
        req_pool_indices: int64 ``[B]`` row of each request.
        seq_lens: int64 ``[B]`` tokens in the cache (0 marks a padding row).

    Returns:
        `FA3Metadata`: ``cache_seqlens = seq_lens``, ``cu_seqlens_q =
        arange(B + 1)``, causal, page table ``[B, cfg.max_pages]`` over
        ``seq_lens``; ``max_seqlen_k = max_context_len``.

    Example:
        >>> cfg = SpecConfig(page_size=2, topk=1, num_steps=2,
        ...                  num_draft_tokens=1, max_bs=4, max_context_len=6)
        >>> r2t = torch.arange(16, dtype=torch.int32).view(2, 8)  # identity rows
        >>> md = build_decode_metadata(cfg, req_to_token=r2t,
        ...     req_pool_indices=torch.tensor([1, 0]), seq_lens=torch.tensor([3, 0]))
        >>> md.page_table.tolist(), md.cache_seqlens.tolist()  # ok-host: doctest
        ([[4, 5, 0, 0], [0, 0, 0, 0]], [3, 0])
    """
    _validate.batch(cfg, req_to_token, req_pool_indices, seq_lens)
    view = BatchView(cfg, req_to_token, req_pool_indices, seq_lens)
    return request_call(
        view,
        view.seq_lens,
        queries_per_row=1,
        max_seqlen_k=cfg.max_context_len,
        causal=True,
    )
