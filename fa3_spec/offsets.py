"""Cumulative offsets and row arithmetic shared by the builders: row repeats,
ceilings, prefix sums (``cu_seqlens``), all pure and traceable.

The batch's slots and page tables are read through `fa3_spec.paged.BatchView`;
nothing here gathers by a tensor index, so nothing here can read out of range.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true


def repeat_rows(x: torch.Tensor, repeats: int) -> torch.Tensor:
    """``[B, ...] -> [B * repeats, ...]``, each row repeated consecutively."""
    if repeats == 1:
        return x
    return x.unsqueeze(1).expand(x.shape[0], repeats, *x.shape[1:]).reshape(
        x.shape[0] * repeats, *x.shape[1:]
    )


def cdiv_tensor(x: torch.Tensor, d: int) -> torch.Tensor:
    return torch.div(x + (d - 1), d, rounding_mode="floor")


def cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., n + 1]`` exclusive prefix sums of ``lengths`` (``[..., n]``)
    along the last dimension, for **per-request** rows (``n <= max_bs``).

    Bitwise equal to `scan_cu_seqlens` (sums are taken in int64 and wrap to
    int32 exactly as an int32 cumsum does), but built from `exclusive_sums`,
    which inductor fuses with its inputs and consumers: no scan kernel.

    Example: ``cu_seqlens(tensor([3, 0, 5])) -> tensor([0, 3, 3, 8], dtype=int32)``.
    """
    if not torch.compiler.is_compiling():  # eagerly a scan is one kernel, and the fastest
        return scan_cu_seqlens(lengths)
    return exclusive_sums(lengths).to(torch.int32)


def scan_cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """`cu_seqlens` by a scan (``cumsum``): for per-token rows, whose count
    (``B * N``) is too large for `exclusive_sums`' ``O(n^2)`` work."""
    return F.pad(torch.cumsum(lengths, -1, dtype=torch.int32), (1, 0))


def exclusive_sums(values: torch.Tensor) -> torch.Tensor:
    """int64 ``[..., n + 1]``: ``out[..., m] = sum(values[..., :m])``.

    Eagerly this is a ``cumsum``. Under ``torch.compile`` it is a
    comparison-sum, ``sum_j values[..., j] * (j < m)``: a scan is a kernel of
    its own on CUDA that nothing fuses across, while this is elementwise code
    when ``n <= UNROLLED_SUMS`` is known at trace time (``UNROLLED_SUMS`` terms
    written out; inductor itself only unrolls reductions shorter than 8) and otherwise an
    ordinary reduction over ``n``, which inductor fuses into one kernel with
    its neighbours (no ``[n + 1, n]`` temporary). A symbolic ``n`` (a batch
    dimension marked dynamic) takes the reduction, so no guard is added on
    it. ``O(n^2)`` work: meant for per-request rows, not per-token ones.
    Integer sums are exact, so every path gives the same bits.
    """
    n = values.shape[-1]
    values = values.to(torch.int64)
    if not torch.compiler.is_compiling():
        return F.pad(torch.cumsum(values, -1), (1, 0))
    m = torch.arange(n + 1, device=values.device)
    if statically_known_true(n <= UNROLLED_SUMS):  # UNROLLED_SUMS elementwise terms
        # Padded to a static width, so the loop never depends on n: a symbolic n
        # whose range is known to be small (a batch bounded by max_bs <= 16) is
        # not specialised to its current value.
        padded = F.pad(values, (0, UNROLLED_SUMS - n))
        out = torch.zeros(values.shape[:-1] + (n + 1,), dtype=torch.int64, device=values.device)
        for j in range(UNROLLED_SUMS):
            out = out + padded[..., j:j + 1] * (m > j)
        return out
    before = torch.arange(n, device=values.device) < m.unsqueeze(1)  # [n + 1, n]
    return (values.unsqueeze(-2) * before).sum(-1)


#: Largest static ``n`` for which a compiled `exclusive_sums` writes its
#: ``n`` terms out: the batch sizes where metadata latency matters.
UNROLLED_SUMS = 16


def uniform_cu_seqlens(rows: int, per_row: int, device) -> torch.Tensor:
    """int32 ``[rows + 1]`` offsets when every row has ``per_row`` queries."""
    return torch.arange(0, rows * per_row + 1, per_row, dtype=torch.int32, device=device)
