"""Target verify of a chain or a tree of N draft tokens (docs/semantics.md, "Target verify").

Draft token ``c`` of request ``b`` sits at row position ``seq_len + c``.

Chain (``tree_mask is None``): one causal call, N queries per request over
``seq_len + N`` tokens.

Tree: a cascade. The prefix call gives every draft query the ``seq_len``
prefix tokens (non-causal). The expand call has one row per draft query and
lists the *slots* of the draft tokens that query attends, so it is
expressed in page size 1 whatever the KV page size::

    tree (N = 4)      tree_mask[b]        expand rows (slot of token c = s_c)
        0             j\\c 0 1 2 3         row j   page_table      cache_seqlens
       / \\            0   1 . . .         0       s0 0  0  0      1
      1   2           1   1 1 . .         1       s0 s1 0  0      2
          |           2   1 . 1 .         2       s0 s2 0  0      2
          3           3   1 . 1 1         3       s0 s2 s3 0      3
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..batch import SpecBatch
from ..config import SpecConfig
from ..metadata import PAGE_SENTINEL, CascadeMetadata, FA3Metadata
from ..paged import BatchView
from ._common import request_call, slot_call


def build_target_verify_metadata(
    cfg: SpecConfig,
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: Optional[torch.Tensor] = None,
) -> Union[FA3Metadata, CascadeMetadata]:
    """Metadata of the target model's verify pass over N draft tokens.

    Args:
        cfg: static configuration (``N = cfg.num_draft_tokens``).
        req_to_token, req_pool_indices, seq_lens: as in `build_decode_metadata`.
        tree_mask: bool ``[B, N, N]``; row ``j`` marks the draft tokens query
            ``j`` attends (its ancestors and itself). None for a chain.

    Returns:
        Chain: `FA3Metadata`, causal, N queries per request,
        ``cache_seqlens = seq_len + N``.

        Tree: `CascadeMetadata`; ``prefix`` non-causal with N queries per
        request over ``seq_len``; ``expand`` ``B*N`` rows of one query,
        ``page_size = 1``, page table ``[B*N, N]`` of attended slots in
        ascending token order, ``cache_seqlens`` = tokens attended.

    Compiles to one graph with no host sync (an ``argsort`` of a static
    ``[B, N, N]`` key, no data-dependent shape) and replays inside a CUDA graph.
    """
    batch = SpecBatch.create(cfg, req_to_token=req_to_token, req_pool_indices=req_pool_indices,
                             seq_lens=seq_lens, tree_mask=tree_mask)
    return target_verify_metadata(batch)


def read_length(view: BatchView, step: int = 0, tree: bool = False) -> torch.Tensor:
    """Tokens of its own row each request-level call reads: ``seq_len`` for a
    tree (the drafts come through the expand call), ``seq_len + N`` for a chain."""
    return view.seq_lens if tree else view.seq_lens + view.cfg.num_draft_tokens


def draft_token_slots(view: BatchView) -> torch.Tensor:
    """int64 ``[B, N]``: the slot of draft token ``c`` of each request, its row
    position ``seq_len + c`` (clamped into the pool, as FA3 reads it)."""
    tokens = torch.arange(view.cfg.num_draft_tokens, device=view.seq_lens.device)
    return view.slots(view.seq_lens.unsqueeze(1) + tokens)


def attended_slots(slots: torch.Tensor, mask: torch.Tensor) -> tuple:
    """``(sorted_slots int64 [B, N, N], attended int64 [B, N])`` from the draft
    tokens' ``slots`` (``[B, N]``) and the tree ``mask`` (bool ``[B, N, N]``):
    row ``j`` lists the slots of the draft tokens query ``j`` attends in
    ascending token order, then the others (ascending too); ``attended[b, j]``
    counts the first group. For a tree mask ascending token order is
    ascending depth: the path root .. ``j``."""
    bs, n = slots.shape
    tokens = torch.arange(n, device=slots.device)
    order = torch.argsort(torch.where(mask, tokens, tokens + n), dim=-1)
    sorted_slots = torch.gather(slots.to(torch.int64).unsqueeze(1).expand(bs, n, n), 2, order)
    return sorted_slots, mask.sum(dim=-1)


def target_verify_metadata(batch: SpecBatch, step: int = 0) -> Union[FA3Metadata, CascadeMetadata]:
    """`build_target_verify_metadata` on a validated `SpecBatch` (``step`` is unused)."""
    cfg, view = batch.cfg, batch.view()
    n, bs = cfg.num_draft_tokens, batch.batch_size
    tree = batch.tree_mask is not None
    if not tree:
        return request_call(view, read_length(view), queries_per_row=n,
                            max_seqlen_k=cfg.max_context_len + n, causal=True)
    mask = batch.tree_mask
    prefix = request_call(view, read_length(view, tree=True), queries_per_row=n,
                          max_seqlen_k=cfg.max_context_len, causal=False)

    tokens = torch.arange(n, device=view.seq_lens.device)
    sorted_slots, attended = attended_slots(draft_token_slots(view), mask)
    table = torch.where(tokens < attended.unsqueeze(-1), sorted_slots, PAGE_SENTINEL)

    cache_seqlens = view.mask_padding(attended, 1).reshape(bs * n).to(torch.int32)
    table = view.mask_padding(table, 1).reshape(bs * n, n).to(torch.int32)
    return CascadeMetadata(prefix=prefix, expand=slot_call(table, cache_seqlens, max_seqlen_k=n))
