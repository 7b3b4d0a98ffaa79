"""Plain decode, one query per request (docs/semantics.md, "Decode")."""

from __future__ import annotations

import torch

from ..batch import SpecBatch
from ..config import SpecConfig
from ..metadata import FA3Metadata
from ..paged import BatchView
from ._common import request_call
from .interface import Mode
from .window import window_call


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
        arange(B + 1)``, causal, page table ``[B, cfg.page_table_width]`` over
        ``seq_lens``; ``max_seqlen_k = max_context_len``.

    Compiles to one graph with no host sync (shapes depend on ``B`` and
    ``cfg`` only) and replays inside a CUDA graph.

    Example:
        >>> cfg = SpecConfig(page_size=2, topk=1, num_steps=2,
        ...                  num_draft_tokens=1, max_bs=4, max_context_len=6)
        >>> r2t = torch.arange(16, dtype=torch.int32).view(2, 8)  # identity rows
        >>> md = build_decode_metadata(cfg, req_to_token=r2t,
        ...     req_pool_indices=torch.tensor([1, 0]), seq_lens=torch.tensor([3, 0]))
        >>> md.page_table.tolist(), md.cache_seqlens.tolist()  # ok-host: doctest
        ([[4, 5, 0, 0], [0, 0, 0, 0]], [3, 0])
    """
    batch = SpecBatch.create(cfg, req_to_token=req_to_token,
                             req_pool_indices=req_pool_indices, seq_lens=seq_lens)
    return decode_metadata(batch)


def decode_metadata(batch: SpecBatch) -> FA3Metadata:
    """`build_decode_metadata` on a validated `SpecBatch`."""
    view = batch.view()
    return request_call(view, view.seq_lens, queries_per_row=1,
                        max_seqlen_k=view.cfg.max_context_len, causal=True)


class DecodeMode(Mode):
    """``decode``: one query per request, causal, over its ``seq_len`` tokens."""

    name = "decode"

    def queries_per_request(self, cfg: SpecConfig) -> int:
        return 1

    def build(self, batch: SpecBatch, step: int) -> FA3Metadata:
        return decode_metadata(batch)

    def window(self, batch: SpecBatch, step: int, window_left: int) -> FA3Metadata:
        view = batch.view()  # the query sits at seq_len - 1
        return window_call(view, view.seq_lens, 1, window_left, view.cfg.max_context_len)

    def read_length(self, batch: SpecBatch, view: BatchView, step: int) -> torch.Tensor:
        return view.seq_lens


MODE = DecodeMode()
