"""Reductions over a vocabulary-sized last dimension, in two short stages.

A decode step reduces ``[R, V]`` logits with ``R`` as small as 1 and ``V``
around 128K. Done in one stage, such a reduction has ``R`` rows of work for
a GPU of over a hundred SMs, and the compilers do not split it: ``argmax``
becomes one long Triton reduction, and ``torch.topk`` aten's multi-block radix
select, several passes of launches per call.

Here each one is a reduction inside blocks of ``block`` entries (``R * V /
block`` independent pieces of work), then a short one over the blocks'
results. Each function returns what its one-stage counterpart returns:
`vocab_argmax` the same index (floating ``x``); `vocab_exp_sum` the terms of
the log-sum-exp up to summation order; `vocab_topk` the same values,
and where values tie at the ``k``-th place possibly other entries of that
value than ``torch.topk`` picks (which entries it picks is unspecified too;
exact speculative decoding does not depend on it, but a comparison of draft
token ids against ``torch.topk`` must allow it); `vocab_cumsum` the same
sums up to summation order. Shapes are static, so all four trace with
``torch.compile(fullgraph=True)`` and capture.
"""

from __future__ import annotations

from typing import Tuple

import torch

#: Entries per block of the first stage (`vocab_argmax`, `vocab_exp_sum`, `vocab_cumsum`).
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


def _full_blocks(x: torch.Tensor, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [..., V]`` as its ``nb = V // block`` full blocks, a view ``[..., nb,
    block]``, and the ``V - nb * block`` entries after them, ``[..., V % block]``:
    nothing padded or copied (a padded copy is one more pass over the logits
    wherever the compiler does not fuse the pad into the reduction)."""
    full = x.shape[-1] // block * block
    return x[..., :full].unflatten(-1, (full // block, block)), x[..., full:]


def _finite_shift(peak: torch.Tensor) -> torch.Tensor:
    """``peak`` with its infinities replaced by 0: the shift of an ``exp``, so
    that an all ``-inf`` row sums to 0 and a ``+inf`` one to ``+inf``, not NaN."""
    return torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)


def vocab_argmax(x: torch.Tensor, block: int = VOCAB_BLOCK) -> torch.Tensor:
    """``x.argmax(-1)`` (the first maximum) of a floating ``x [..., V]`` -> int64 ``[...]``.

    The ``nb = V // block`` full blocks (`_full_blocks`: a view) each give
    their first maximum, and the first block holding the largest of those
    gives the candidate.
    The first maximum of the ``V - nb * block`` entries after the full
    blocks replaces it only where it is larger (or a NaN where the blocks
    hold none): on a tie the earlier entry wins. A NaN is the largest value,
    as for ``argmax``. ``V < 2 * block`` is one plain ``argmax``.

    Example: ``x = [3, 1, 7, 7, 2]``, ``block = 2``: blocks ``[3, 1] [7, 7]``,
    their maxima ``3, 7`` at 0, 0, and the tail ``[2]``; the best block is 1
    and the tail's 2 is not larger than its 7, so the index is ``1 * 2 + 0 = 2``.
    """
    _int_in("block", block, 1)
    if not x.is_floating_point():
        raise TypeError(f"vocab_argmax needs a floating-point x, got {x.dtype}")
    v = x.shape[-1]
    nb = v // block
    if nb <= 1:  # static
        return x.argmax(-1)
    blocks, tail = _full_blocks(x, block)
    best, inner = blocks.max(-1)
    b = best.argmax(-1, keepdim=True)
    found = (b * block + inner.gather(-1, b)).squeeze(-1)
    if tail.shape[-1] == 0:  # static
        return found
    top = best.gather(-1, b).squeeze(-1)
    tail_top, tail_at = tail.max(-1)
    later = (tail_top > top) | (torch.isnan(tail_top) & ~torch.isnan(top))
    return torch.where(later, nb * block + tail_at, found)


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
    blocks, tail = _full_blocks(x, block)
    _, chosen = torch.topk(blocks.amax(-1), k, dim=-1, sorted=False)  # [..., k]
    picked = blocks.gather(-2, chosen.unsqueeze(-1).expand(*chosen.shape, block))
    picked_idx = chosen.unsqueeze(-1) * block + torch.arange(block, device=x.device)
    lead = x.shape[:-1]
    cand_vals = torch.cat([picked.flatten(-2), tail], -1)
    cand_idx = torch.cat([picked_idx.flatten(-2),
                          torch.arange(full, v, device=x.device).expand(*lead, v - full)], -1)
    best_vals, pick = torch.topk(cand_vals, k, dim=-1)
    return best_vals, cand_idx.gather(-1, pick)


def _peak_and_sum(x: torch.Tensor, acc: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Over the last dimension of ``x``: the maximum (in ``acc``), and
    ``sum(exp(x - _finite_shift(maximum)))`` in ``acc``. ``x`` is converted
    inside the sum's expression, so a compiler reads it in its own dtype and
    writes no converted copy. Written out because ``torch.logsumexp`` guards
    on its input being empty, which an unbacked row count cannot answer."""
    peak = x.amax(-1).to(acc)
    return peak, torch.exp(x.to(acc) - _finite_shift(peak).unsqueeze(-1)).sum(-1)


def vocab_exp_sum(x: torch.Tensor, block: int = VOCAB_BLOCK
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(shift, total)`` of a floating ``x [..., V]``, each ``[...]`` in float32
    (float64 for a float64 ``x``): the row's maximum (0 where it is infinite)
    and ``sum(exp(x - shift))``, so that ``logsumexp = shift + log(total)``
    and ``log_softmax = (x - shift) - log(total)``, as precise as torch's own
    (the shift is an entry of ``x``).

    The ``nb = V // block`` full blocks (`_full_blocks`: views) and the
    ``V - nb * block`` entries after them each give their maximum and their
    sum shifted by it; the sums are then rescaled to the row's shift (a
    block whose maximum is infinite keeps its sum, 0 or ``+inf``). A NaN in
    a row gives NaN. ``V < 2 * block`` (at most one full block) is one stage.

    Example: ``x = [0, 0, 0, 0, log 4]``, ``block = 2``: the blocks ``[0, 0]``
    and ``[0, 0]`` have maximum 0 and sum 2 each, the tail ``[log 4]``
    maximum ``log 4`` and sum 1; rescaled to the row's shift ``log 4``:
    ``0.5 + 0.5 + 1 = 2``, so ``(log 4, 2)`` and a log-sum-exp of ``log 8``.
    """
    _int_in("block", block, 1)
    if not x.is_floating_point():
        raise TypeError(f"vocab_exp_sum needs a floating-point x, got {x.dtype}")
    v = x.shape[-1]
    if v == 0:
        raise ValueError(f"x must have at least one entry in its last dimension, got {tuple(x.shape)}")
    acc = torch.promote_types(x.dtype, torch.float32)
    nb = v // block
    if nb <= 1:  # static: one stage
        peak, total = _peak_and_sum(x, acc)
        return _finite_shift(peak), total
    blocks, tail = _full_blocks(x, block)
    peaks, sums = _peak_and_sum(blocks, acc)  # [..., nb]
    if tail.shape[-1]:  # static
        tail_peak, tail_sum = _peak_and_sum(tail, acc)
        peaks = torch.cat([peaks, tail_peak.unsqueeze(-1)], -1)
        sums = torch.cat([sums, tail_sum.unsqueeze(-1)], -1)
    shift = _finite_shift(peaks.amax(-1))
    own = torch.where(torch.isinf(peaks), shift.unsqueeze(-1), peaks)  # infinite: weight 1
    return shift, (sums * torch.exp(own - shift.unsqueeze(-1))).sum(-1)


def log_prob_topk(logits: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most probable entries of floating ``logits [..., V]``: their
    float32 log-probabilities (``log_softmax`` over ``V`` of the logits as
    float32) and int64 indices. What a draft head proposes from its logits.

    The ``k`` best logits (`vocab_topk`, in the logits' own dtype: the
    order is the log-probabilities' order) less the row's log-sum-exp
    (`vocab_exp_sum`), as ``log_softmax`` computes them: ``(x - shift) -
    log(total)``. Compiled, nothing ``[..., V]`` is written (eager PyTorch
    makes its temporaries): a ``log_softmax`` first would write the float32
    log-probabilities of the whole vocabulary and read them back for the
    top-k. A row holding ``+inf`` gives NaN at its ``+inf`` entries and
    ``-inf`` at the others, where ``log_softmax`` gives NaN everywhere:
    neither is a distribution.
    """
    if not logits.is_floating_point():
        raise TypeError(f"log_prob_topk needs floating-point logits, got {logits.dtype}")
    if logits.dtype == torch.float64:  # static; float32 results, as log_softmax(logits.float())
        logits = logits.float()
    vals, idx = vocab_topk(logits, k)
    shift, total = vocab_exp_sum(logits)
    return (vals.to(shift.dtype) - shift.unsqueeze(-1)) - torch.log(total).unsqueeze(-1), idx


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
