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

from typing import Optional, Tuple

import torch

from ..batch import SpecBatch
from ..config import SpecConfig
from ..invariants import page_flags, tree_mask_flags
from ..metadata import PAGE_SENTINEL, CascadeMetadata, Metadata
from ..paged import BatchView
from ._common import request_call, slot_call
from .interface import Mode
from .window import window_cascade, window_call


def build_target_verify_metadata(
    cfg: SpecConfig,
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: Optional[torch.Tensor] = None,
) -> Metadata:
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


def draft_token_positions(view: BatchView) -> torch.Tensor:
    """int64 ``[B, N]``: row position ``seq_len + c`` of draft token ``c`` of each request."""
    return view.seq_lens.unsqueeze(1) + torch.arange(view.cfg.num_draft_tokens,
                                                     device=view.seq_lens.device)


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


def target_verify_metadata(batch: SpecBatch) -> Metadata:
    """`build_target_verify_metadata` on a validated `SpecBatch`."""
    view = batch.view()
    cfg = view.cfg
    n, bs = cfg.num_draft_tokens, batch.batch_size
    if batch.tree_mask is None:
        return request_call(view, view.seq_lens + n, queries_per_row=n,
                            max_seqlen_k=cfg.max_context_len + n, causal=True)
    prefix = request_call(view, view.seq_lens, queries_per_row=n,
                          max_seqlen_k=cfg.max_context_len, causal=False)

    tokens = torch.arange(n, device=view.seq_lens.device)
    sorted_slots, attended = attended_slots(view.slots(draft_token_positions(view)), batch.tree_mask)
    table = torch.where(tokens < attended.unsqueeze(-1), sorted_slots, PAGE_SENTINEL)

    cache_seqlens = view.mask_padding(attended, 1).reshape(bs * n).to(torch.int32)
    table = view.mask_padding(table, 1).reshape(bs * n, n).to(torch.int32)
    return CascadeMetadata(prefix=prefix, expand=slot_call(table, cache_seqlens, max_seqlen_k=n))


class TargetVerifyMode(Mode):
    """``target_verify``: the target over N draft tokens, a chain (no ``tree_mask``)
    or a tree; draft token ``c`` of request ``b`` at row position ``seq_len + c``."""

    name = "target_verify"
    inputs = ("tree_mask",)

    def required(self, cfg: SpecConfig) -> Tuple[str, ...]:
        return ()  # no tree_mask: a chain

    def queries_per_request(self, cfg: SpecConfig) -> int:
        return cfg.num_draft_tokens

    def build(self, batch: SpecBatch, step: int) -> Metadata:
        return target_verify_metadata(batch)

    def window(self, batch: SpecBatch, step: int, window_left: int) -> Metadata:
        view = batch.view()
        cfg = view.cfg
        n = cfg.num_draft_tokens
        if batch.tree_mask is None:  # token j at seq_len + j
            return window_call(view, view.seq_lens + n, n, window_left, cfg.max_context_len + n)
        # Token j at seq_len + depth(j), its path the tokens it attends.
        path, attended = attended_slots(view.slots(draft_token_positions(view)), batch.tree_mask)
        return window_cascade(view, path.reshape(-1, n), attended.reshape(-1) - 1, n, n - 1,
                              window_left)

    def read_length(self, batch: SpecBatch, view: BatchView, step: int) -> torch.Tensor:
        # A tree's drafts come through the expand call; a chain reads them in the row.
        if batch.tree_mask is None:
            return view.seq_lens + view.cfg.num_draft_tokens
        return view.seq_lens

    def flags(self, batch: SpecBatch, view: BatchView, step: int,
              num_pages: Optional[int]) -> torch.Tensor:
        if batch.tree_mask is None:
            return super().flags(batch, view, step, num_pages)
        # The expand call reads the draft tokens' slots as page-size-1 ids.
        pool_slots = None if num_pages is None else num_pages * view.cfg.page_size
        return (tree_mask_flags(batch.tree_mask, view.live)
                | page_flags(view.raw_slots(draft_token_positions(view)), 1, pool_slots, view.live))


MODE = TargetVerifyMode()
