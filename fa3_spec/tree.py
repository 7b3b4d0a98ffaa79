"""Tree masks for target verify: conversions between layouts.

Our builders take the draft part of the verify mask as bool ``[B, N, N]``
(row ``j`` = draft tokens query ``j`` attends, itself included). Upstream
engines pass one flat bool tensor instead: per request a block of ``N`` rows
by ``seq_len + N`` columns, blocks concatenated in batch order; the draft
part of row ``j`` is columns ``seq_len .. seq_len + N - 1``. That layout is
``O(sum(seq_len) * N)``; the draft part alone is ``O(B * N * N)``.
"""

from __future__ import annotations

import torch

from . import _validate


def tree_mask_from_flat(
    custom_mask: torch.Tensor, seq_lens: torch.Tensor, num_draft_tokens: int
) -> torch.Tensor:
    """Extract the ``[B, N, N]`` draft mask from upstream's flat custom mask.

    Traceable and capture-safe: one gather at offsets computed from
    ``seq_lens``, clamped into ``custom_mask`` (an inconsistent ``seq_lens``
    yields wrong bits, never an out-of-range read).
    """
    flat = _validate.tensor("custom_mask", custom_mask, ndim=1, dtypes=(torch.bool,))
    sl = _validate.tensor("seq_lens", seq_lens, ndim=1).to(torch.int64)
    n = _validate.int_at_least("num_draft_tokens", num_draft_tokens, 1)
    row_len = sl + n  # columns per mask row
    block_start = mask_block_starts(sl, n)  # [B]
    j = torch.arange(n, device=sl.device).view(1, n, 1)
    c = torch.arange(n, device=sl.device).view(1, 1, n)
    index = block_start.view(-1, 1, 1) + j * row_len.view(-1, 1, 1) + sl.view(-1, 1, 1) + c
    index = index.clamp(0, max(flat.numel() - 1, 0))
    if flat.numel() == 0:
        return torch.zeros(index.shape, dtype=torch.bool, device=flat.device)
    return flat[index]


def mask_block_starts(seq_lens: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
    """int64 ``[B]`` offset of each request's block in the flat custom mask.

    Request ``b``'s block is ``N`` rows of ``seq_len + N`` columns, so its
    start is ``sum_{b' < b} N * (seq_len[b'] + N)``. Computed in int64: at
    production sizes (N = 64, 256 requests, 128K context) the flat mask holds
    more than 2^31 elements and an int32 offset would wrap.
    """
    sizes = num_draft_tokens * (seq_lens.to(torch.int64) + num_draft_tokens)
    return torch.cumsum(sizes, 0) - sizes


def flat_from_tree_mask(tree_mask: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Upstream's flat custom mask for ``tree_mask`` (prefix columns all True).

    Host-side helper (sizes depend on ``seq_lens`` values): for tests,
    notebooks and feeding an upstream-style path.
    """
    blocks = []
    n = tree_mask.shape[-1]
    for b, s in enumerate(seq_lens.tolist()):  # ok-host: host-side helper, never in a step
        prefix = torch.ones(n, int(s), dtype=torch.bool, device=tree_mask.device)
        blocks.append(torch.cat([prefix, tree_mask[b]], dim=1).reshape(-1))
    if not blocks:
        return torch.zeros(0, dtype=torch.bool, device=tree_mask.device)
    return torch.cat(blocks)


def tree_mask_from_parents(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self mask ``[B, N, N]`` of trees given by ``parents``.

    Args:
        parents: int ``[B, N]``; ``parents[b, c]`` is the parent of draft
            token ``c`` (``< c``), and ``-1`` for the root (token 0).

    Traceable: ``ceil(log2 N)`` boolean squarings of the parent relation.
    Out-of-range parents are treated as "no parent".
    """
    par = _validate.tensor("parents", parents, ndim=2)
    bs, n = par.shape
    tokens = torch.arange(n, device=par.device)
    is_parent = par.unsqueeze(-1).to(torch.int64) == tokens  # [B, N(child), N(parent)]
    reach = is_parent | torch.eye(n, dtype=torch.bool, device=par.device)
    hops = 1
    while hops < n:
        reach = torch.bmm(reach.float(), reach.float()) > 0
        hops *= 2
    return reach
