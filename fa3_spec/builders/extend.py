"""Draft extend: the draft model re-reads accepted tokens (docs/semantics.md, "Draft extend")."""

from __future__ import annotations

from typing import Optional

import torch

from ..offsets import cu_seqlens
from ..batch import SpecBatch
from ..config import SpecConfig
from ..invariants import ErrorFlag, flag
from ..metadata import FA3Metadata
from ..paged import BatchView
from ._common import request_call
from .interface import Mode
from .window import window_call


def build_draft_extend_metadata(
    cfg: SpecConfig,
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
) -> FA3Metadata:
    """Metadata of draft extend: ``extend_seq_lens[b]`` new queries per request.

    ``seq_lens`` already includes the new tokens. The query tensor is sized
    statically for ``B * N`` tokens; ``cu_seqlens_q`` packs the real ones at
    the front::

        request      0            1        2 (padding)
        extend       3            1        0
        q tokens     [q q q]      [q]      -          (then unused rows)
        cu_seqlens_q 0            3        4       4

    Returns:
        `FA3Metadata`, causal; ``cu_seqlens_q = pad(cumsum(extend_seq_lens))``
        with each length clamped to ``[0, N]`` (so it never exceeds ``B*N``),
        ``max_seqlen_q = N``, ``cache_seqlens = seq_lens``, table over
        ``seq_lens``. Compiles to one graph with no host sync; capture-safe.
    """
    batch = SpecBatch.create(cfg, req_to_token=req_to_token, req_pool_indices=req_pool_indices,
                             seq_lens=seq_lens, extend_seq_lens=extend_seq_lens)
    return draft_extend_metadata(batch)


def _queries(batch: SpecBatch, view: BatchView) -> torch.Tensor:
    """int64 ``[B]``: each request's new queries, clamped to ``[0, N]`` (0 on padding rows)."""
    n = view.cfg.num_draft_tokens
    return torch.where(view.live, batch.extend_seq_lens.to(torch.int64).clamp(0, n), 0)


def draft_extend_metadata(batch: SpecBatch) -> FA3Metadata:
    """`build_draft_extend_metadata` on a validated `SpecBatch`."""
    batch.require("extend_seq_lens", mode="draft_extend")
    view = batch.view()
    cfg = view.cfg
    return request_call(view, view.seq_lens, queries_per_row=cfg.num_draft_tokens,
                        max_seqlen_k=cfg.max_context_len, causal=True,
                        cu_seqlens_q=cu_seqlens(_queries(batch, view)))


class DraftExtendMode(Mode):
    """``draft_extend``: ``extend_seq_lens[b] <= N`` new queries per request, causal,
    over ``seq_len`` tokens (the new ones included)."""

    name = "draft_extend"
    inputs = ("extend_seq_lens",)

    def queries_per_request(self, cfg: SpecConfig) -> int:
        return cfg.num_draft_tokens  # a static bound

    def build(self, batch: SpecBatch, step: int) -> FA3Metadata:
        return draft_extend_metadata(batch)

    def window(self, batch: SpecBatch, step: int, window_left: int) -> FA3Metadata:
        view = batch.view()  # query j at seq_len - e + j
        cfg = view.cfg
        return window_call(view, view.seq_lens, cfg.num_draft_tokens, window_left,
                           cfg.max_context_len, queries=_queries(batch, view))

    def read_length(self, batch: SpecBatch, view: BatchView, step: int) -> torch.Tensor:
        return view.seq_lens

    def flags(self, batch: SpecBatch, view: BatchView, step: int,
              num_pages: Optional[int]) -> torch.Tensor:
        ext, seq = batch.extend_seq_lens.to(torch.int64), batch.seq_lens.to(torch.int64)
        bad = (ext < 0) | (ext > view.cfg.num_draft_tokens) | (ext > seq)
        return flag(bad & (seq > 0), ErrorFlag.EXTEND_LEN_OUT_OF_RANGE)


MODE = DraftExtendMode()
