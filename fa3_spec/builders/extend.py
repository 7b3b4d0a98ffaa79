"""Draft extend: the draft model re-reads accepted tokens (docs/semantics.md, "Draft extend")."""

from __future__ import annotations

import torch

from .._paged import cu_seqlens
from ..batch import SpecBatch
from ..config import SpecConfig
from ..metadata import FA3Metadata
from ..paged import BatchView
from ._common import request_call


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


def read_length(view: BatchView, step: int = 0, tree: bool = False) -> torch.Tensor:
    """Tokens of its own row each request's call reads: ``seq_len``."""
    return view.seq_lens


def draft_extend_metadata(batch: SpecBatch, step: int = 0) -> FA3Metadata:
    """`build_draft_extend_metadata` on a validated `SpecBatch` (``step`` is unused)."""
    batch.require("extend_seq_lens", mode="draft_extend")
    cfg, view = batch.cfg, batch.view()
    n = cfg.num_draft_tokens
    queries = torch.where(view.live, batch.extend_seq_lens.to(torch.int64).clamp(0, n), 0)
    return request_call(view, read_length(view), queries_per_row=n,
                        max_seqlen_k=cfg.max_context_len, causal=True,
                        cu_seqlens_q=cu_seqlens(queries))
