"""The ``k`` best entries of short score rows, by pairwise ranks instead of a sort.

The tree's selections rank a few hundred candidate scores per request
(``K * K`` per draft step, ``K + (S - 1) K^2`` for the tree) by a stable
descending sort. Compiled with a batch that is an unbacked symbol, inductor
generates that sort as one slow persistent kernel; the rank of each entry,
``#{entries before it}``, is instead one comparison per pair of entries (a
``[..., L, L]`` reduction that inductor fuses) and needs no sort at all.

The order is exactly ``torch.sort(scores, descending=True, stable=True)``'s:
a larger value first, NaN before every number (as the sort places it), and
among equal values (or NaNs) the lower index first. It is a strict total
order, so the ranks of a row are a permutation of ``0 .. L-1`` and every
index returned is one of the row's own, whatever the values.
"""

from __future__ import annotations

import torch


def _earlier(length: int, device) -> torch.Tensor:
    """``[L, L]`` bool: ``[i, j]`` is ``j < i``."""
    idx = torch.arange(length, device=device)
    return idx.unsqueeze(0) < idx.unsqueeze(1)


def descending_ranks(scores: torch.Tensor) -> torch.Tensor:
    """The rank of each entry of ``scores [..., L]`` in its row's stable
    descending order (see the module docstring): int64 ``[..., L]``, a
    permutation of ``0 .. L-1`` per row."""
    if not scores.is_floating_point():
        raise TypeError(f"descending_ranks needs floating-point scores, got {scores.dtype}")
    s_i = scores.unsqueeze(-1)  # [..., L, 1]: the entry ranked
    s_j = scores.unsqueeze(-2)  # [..., 1, L]: an entry that may come before it
    nan_i, nan_j = torch.isnan(s_i), torch.isnan(s_j)
    larger = (s_j > s_i) | (nan_j & ~nan_i)
    same = (s_j == s_i) | (nan_j & nan_i)
    return (larger | (same & _earlier(scores.shape[-1], scores.device))).sum(-1)


def _check_k(scores: torch.Tensor, k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if not 1 <= k <= scores.shape[-1]:
        raise ValueError(f"k must be in [1, {scores.shape[-1]}] (the row length), got {k}")


def _index_at(place: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """``[..., k]``: at ``r``, the index ``i`` of the one valid entry whose
    ``place`` is ``r`` (``place [..., L]`` ranks the valid entries)."""
    length = place.shape[-1]
    slot = torch.arange(k, device=place.device).unsqueeze(-1)  # [k, 1]
    hit = valid.unsqueeze(-2) & (place.unsqueeze(-2) == slot)  # [..., k, L]
    return (hit.long() * torch.arange(length, device=place.device)).sum(-1)


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]``:
    the indices of each row's ``k`` best entries, best first. int64 ``[..., k]``.
    Position ``r`` holds the one index whose rank is ``r``."""
    _check_k(scores, k)
    rank = descending_ranks(scores)
    return _index_at(rank, torch.ones_like(rank, dtype=torch.bool), k)


def top_index_set(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``top_indices(scores, k)`` sorted ascending: the same ``k`` indices of
    each row in index order. int64 ``[..., k]``. Position ``p`` holds the
    chosen index with ``p`` chosen indices before it (counted pairwise, not
    by a scan)."""
    _check_k(scores, k)
    chosen = descending_ranks(scores) < k  # [..., L], k of them true
    before = (chosen.unsqueeze(-2) & _earlier(scores.shape[-1], scores.device)).sum(-1)
    return _index_at(before, chosen, k)
