"""Prefill / general extend: any number of new tokens per request.

Draft extend (`build_draft_extend_metadata`) bounds the new tokens of a
request by ``num_draft_tokens``. Prefill of new prompts, or an engine's
chunked prefill, needs any length: the bound ``max_seqlen_q`` is a static
argument instead. Request ``b`` has ``seq_lens[b]`` tokens in the cache
*including* its ``extend_seq_lens[b]`` new ones, whose K/V the model writes
before attending; new token ``i`` sits at position
``seq_lens[b] - extend_seq_lens[b] + i`` and sees every key up to itself::

    request        0                 1            2 (padding)
    prefix         4 cached          0            -
    extend         3                 5            0
    seq_lens       7                 5            0
    q tokens       [q q q]           [q q q q q]  -      (then unused rows)
    cu_seqlens_q   0                 3            8      8
    positions      4 5 6             0 1 2 3 4
"""

from __future__ import annotations

import torch

from .. import _validate
from ..offsets import cu_seqlens
from ..batch import SpecBatch
from ..config import SpecConfig
from ..metadata import FA3Metadata
from ._common import request_call


def build_prefill_metadata(
    cfg: SpecConfig,
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    max_seqlen_q: int,
) -> FA3Metadata:
    """Metadata of a prefill / extend pass with arbitrary new tokens per request.

    Args:
        cfg: static configuration.
        req_to_token, req_pool_indices: as in `build_decode_metadata`.
        seq_lens: int64 ``[B]`` tokens in the cache *including* the new ones
            (0 marks a padding row).
        extend_seq_lens: int ``[B]`` new tokens per request.
        max_seqlen_q: static upper bound on ``extend_seq_lens`` (>= 1). Each
            length is clamped to ``[0, min(max_seqlen_q, seq_len)]``, so the
            packed queries never exceed ``B * max_seqlen_q``.

    Returns:
        `FA3Metadata`, causal (bottom-right aligned, so new token ``i`` sees
        the prefix and new tokens ``0 .. i``); ``cu_seqlens_q =
        pad(cumsum(extend_seq_lens))``, ``cache_seqlens = seq_lens``, page
        table ``[B, cfg.page_table_width]`` over ``seq_lens``, ``max_seqlen_k =
        max_context_len``. Padding rows have no queries and read nothing.

    Example:
        >>> cfg = SpecConfig(page_size=2, topk=1, num_steps=2,
        ...                  num_draft_tokens=1, max_bs=4, max_context_len=6)
        >>> r2t = torch.arange(16, dtype=torch.int32).view(2, 8)  # identity rows
        >>> md = build_prefill_metadata(cfg, req_to_token=r2t,
        ...     req_pool_indices=torch.tensor([1, 0]), seq_lens=torch.tensor([5, 3]),
        ...     extend_seq_lens=torch.tensor([2, 3]), max_seqlen_q=4)
        >>> md.cu_seqlens_q.tolist(), md.page_table.tolist()  # ok-host: doctest
        ([0, 2, 5], [[4, 5, 6, 0], [0, 1, 0, 0]])

    Compiles with ``fullgraph=True`` (no host sync; output shapes depend on
    ``B`` and ``cfg`` only) and runs inside CUDA-graph capture.
    """
    _validate.positive_int("max_seqlen_q", max_seqlen_q)
    batch = SpecBatch.create(cfg, req_to_token=req_to_token, req_pool_indices=req_pool_indices,
                             seq_lens=seq_lens, extend_seq_lens=extend_seq_lens)
    batch.require("extend_seq_lens", mode="prefill")
    view = batch.view()
    ext = batch.extend_seq_lens
    queries = torch.minimum(ext.to(torch.int64).clamp(0, max_seqlen_q), view.seq_lens)
    queries = torch.where(view.live, queries, 0)
    return request_call(
        view,
        view.seq_lens,
        queries_per_row=max_seqlen_q,
        max_seqlen_k=view.cfg.max_context_len,
        causal=True,
        cu_seqlens_q=cu_seqlens(queries),
    )


def extend_query_positions(
    metadata: FA3Metadata, seq_lens: torch.Tensor, num_queries: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each packed query of an extend/prefill call sits.

    Args:
        metadata: from `build_prefill_metadata` or `build_draft_extend_metadata`.
        seq_lens: int ``[B]`` the same ``seq_lens`` given to the builder.
        num_queries: static length ``T`` of the packed query tensor.

    Returns:
        ``(row, position, owned)``, each ``[T]``: the request (int64, clamped
        into ``[0, B)``), the token position ``seq_len - extend_len + i``
        (int64, 0 where not owned) and whether a request owns the query
        (False past ``cu_seqlens_q[-1]``). Traceable, no host sync.
    """
    if not isinstance(metadata, FA3Metadata):
        raise TypeError(f"metadata must be an FA3Metadata, got {type(metadata).__name__}")
    _validate.per_request("seq_lens", seq_lens, metadata.num_rows)
    _validate.int_at_least("num_queries", num_queries, 0)
    cu = metadata.cu_seqlens_q.to(torch.int64)
    bs = cu.shape[0] - 1
    j = torch.arange(num_queries, device=cu.device)
    row = metadata.query_rows(num_queries).clamp(max=max(bs - 1, 0))
    owned = j < cu[-1]
    if bs == 0:
        zero = torch.zeros(num_queries, dtype=torch.int64, device=cu.device)
        return zero, zero, owned
    queries = cu[1:] - cu[:-1]
    seq = seq_lens.to(torch.int64).clamp(min=0)
    position = seq[row] - queries[row] + (j - cu[row])
    return row, torch.where(owned, position.clamp(min=0), 0), owned
