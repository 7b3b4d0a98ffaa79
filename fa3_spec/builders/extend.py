"""Mode 6: draft extend, the draft model re-reading accepted tokens."""

from __future__ import annotations

import torch

from .. import _validate
from .._paged import BatchView, cu_seqlens
from ..config import SpecConfig
from ..metadata import FA3Metadata
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
        ``seq_lens``.
    """
    bs = _validate.batch(cfg, req_to_token, req_pool_indices, seq_lens)
    ext = _validate.tensor("extend_seq_lens", extend_seq_lens, ndim=1)
    if ext.shape[0] != bs:
        raise ValueError(
            f"extend_seq_lens has {ext.shape[0]} entries but the batch has {bs}"
        )
    _validate.same_device(extend_seq_lens=ext, seq_lens=seq_lens)
    view = BatchView(cfg, req_to_token, req_pool_indices, seq_lens)
    n = cfg.num_draft_tokens
    queries = torch.where(view.live, ext.to(torch.int64).clamp(0, n), 0)
    return request_call(
        view,
        view.seq_lens,
        queries_per_row=n,
        max_seqlen_k=cfg.max_context_len,
        causal=True,
        cu_seqlens_q=cu_seqlens(queries),
    )
