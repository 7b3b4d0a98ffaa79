"""Reductions over a vocabulary-sized last dimension, in two short stages.

A decode step reduces ``[R, V]`` logits with ``R`` as small as 1 and ``V``
around 128K. Done in one stage, such a reduction has ``R`` rows of work for
a GPU of over a hundred SMs, and the compilers do not split it: ``argmax``
becomes one long Triton reduction, and ``torch.topk`` aten's multi-block radix
select, several passes of launches per call.

Here each one is a reduction inside blocks of ``block`` entries (``R * V /
block`` independent pieces of work), then a short one over the blocks'
results. Each function returns what its one-stage counterpart returns:
`vocab_argmax` the same index (floating ``x``); `vocab_topk` the same values,
and where values tie at the ``k``-th place possibly other entries of that
value than ``torch.topk`` picks (which entries it picks is unspecified too;
exact speculative decoding does not depend on it, but a comparison of draft
token ids against ``torch.topk`` must allow it); `vocab_cumsum` the same
sums up to summation order. Shapes are static, so all three trace with
``torch.compile(fullgraph=True)`` and capture.
"""

from __future__ import annotations

from typing import Tuple

import torch

#: Entries per block of the first stage (`vocab_argmax`, `vocab_cumsum`).
VOCAB_BLOCK = 1024
#: Entries per block of `vocab_topk`: ``k`` blocks of it are its candidates.
TOPK_BLOCK = 256


def _int_in(name: str, value, low: int, high: float = float("inf"), why: str = "") -> None:
    """``low <= value <= high`` for a Python int (TypeError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        bound = f">= {low}" if high == float("inf") else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}{why}, got {value}")


def vocab_argmax(x: torch.Tensor, block: int = VOCAB_BLOCK) -> torch.Tensor:
    """``x.argmax(-1)`` (the first maximum) of a floating ``x [..., V]`` -> int64 ``[...]``.

    ``x`` is padded with ``-inf`` to ``nb * block`` entries and viewed as
    ``[..., nb, block]``; the first maximum of each block, then the first
    block holding the largest of those. Padding sits after every real entry,
    so it never wins a tie, and the first maximum of the first best block is
    the first maximum of the row; a NaN is the largest value, as for
    ``argmax``. ``V <= block`` is one plain ``argmax``.

    Example: ``x = [3, 1, 7, 7, 2]``, ``block = 2``: blocks ``[3, 1] [7, 7]
    [2, -inf]``, their maxima ``3, 7, 2`` at 0, 0, 0; the best block is 1,
    so the index is ``1 * 2 + 0 = 2``.
    """
    _int_in("block", block, 1)
    if not x.is_floating_point():
        raise TypeError(f"vocab_argmax needs a floating-point x, got {x.dtype}")
    v = x.shape[-1]
    if v <= block:  # static
        return x.argmax(-1)
    nb = -(-v // block)
    blocks = torch.nn.functional.pad(x, (0, nb * block - v), value=float("-inf"))
    best, inner = blocks.unflatten(-1, (nb, block)).max(-1)
    b = best.argmax(-1, keepdim=True)
    return (b * block + inner.gather(-1, b)).squeeze(-1)


def vocab_topk(x: torch.Tensor, k: int, block: int = TOPK_BLOCK
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k, dim=-1)`` of ``x [..., V]``: values (sorted, largest
    first) and int64 indices ``[..., k]``.

    Where entries tie at the ``k``-th value, which of them are returned may
    differ from ``torch.topk`` (e.g. an all-zero row of 3000 gives indices
    2048, 2049 here and 0, 1 from ``torch.topk`` on CPU).

    The ``nb = V // block`` full blocks each get their maximum; only the
    ``k`` blocks with the largest maxima can hold the row's ``k`` best entries
    (fewer than ``k`` blocks have a maximum above the ``k``-th best value, and
    each block whose maximum equals it holds one such entry), so their
    entries, with the ``V - nb * block`` entries after the full blocks, are
    the candidates of one short topk. Nothing is padded: every index is a
    real entry, even in a row with fewer than ``k`` finite values. Needs
    ``1 <= k <= V``; ``nb <= k`` or ``k > block`` is one plain topk.

    Example: ``x = [5, 1, 4, 8, 2, 6, 3]``, ``k = 2``, ``block = 2``: blocks
    ``[5, 1] [4, 8] [2, 6]`` have maxima ``5, 8, 6``; the two best blocks are
    1 and 2, so the candidates are ``4, 8, 2, 6`` (at 2, 3, 4, 5) and the
    tail ``3`` (at 6); their 2 best: ``8, 6`` at 3, 5.
    """
    _int_in("block", block, 1)
    v = x.shape[-1]
    _int_in("k", k, 1, v, f" (V = {v})")
    nb = v // block
    if nb <= k or k > block:  # static
        return torch.topk(x, k, dim=-1)
    full = nb * block
    blocks = x[..., :full].unflatten(-1, (nb, block))
    _, chosen = torch.topk(blocks.amax(-1), k, dim=-1, sorted=False)  # [..., k]
    picked = blocks.gather(-2, chosen.unsqueeze(-1).expand(*chosen.shape, block))
    picked_idx = chosen.unsqueeze(-1) * block + torch.arange(block, device=x.device)
    lead = x.shape[:-1]
    cand_vals = torch.cat([picked.flatten(-2), x[..., full:]], -1)
    cand_idx = torch.cat([picked_idx.flatten(-2),
                          torch.arange(full, v, device=x.device).expand(*lead, v - full)], -1)
    best_vals, pick = torch.topk(cand_vals, k, dim=-1)
    return best_vals, cand_idx.gather(-1, pick)


def log_prob_topk(logits: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most probable entries of ``logits [..., V]``: their float32
    log-probabilities (``log_softmax`` over ``V``) and int64 indices, by
    `vocab_topk`. What a draft head proposes from its logits."""
    return vocab_topk(torch.log_softmax(logits.float(), dim=-1), k)


def vocab_cumsum(x: torch.Tensor, block: int = VOCAB_BLOCK) -> torch.Tensor:
    """``torch.cumsum(x, -1)`` over a vocabulary-sized last dimension, as two short scans.

    ``x [..., V]`` (``V > block``; a shorter one is one plain scan) is
    zero-padded to ``nb * block`` and viewed as ``[..., nb, block]``: an
    inclusive scan inside each block, plus the exclusive scan of the ``nb``
    block totals. Same values up to summation order. Why: inductor on CUDA
    turns one scan of a vocabulary over few rows into a split scan whose code
    generation fails; scans of ``block`` and ``nb`` elements are not split.

    Example: ``vocab_cumsum(torch.ones(5), block=2)`` pads to ``[[1, 1], [1, 1],
    [1, 0]]``: inner ``[[1, 2], [1, 2], [1, 1]]``, block offsets ``[0, 2, 4]``,
    so ``[1, 2, 3, 4, 5]``.
    """
    _int_in("block", block, 1)
    v = x.shape[-1]
    if v <= block:  # static: one short scan already
        return torch.cumsum(x, dim=-1)
    nb = -(-v // block)
    blocks = torch.nn.functional.pad(x, (0, nb * block - v)).unflatten(-1, (nb, block))
    inner = torch.cumsum(blocks, dim=-1)
    totals = inner[..., -1]
    offsets = torch.cumsum(totals, dim=-1) - totals
    return (inner + offsets.unsqueeze(-1)).flatten(-2)[..., :v]
