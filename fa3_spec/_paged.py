"""Pure, traceable helpers shared by the builders.

Memory safety lives here. Each helper clamps every index it uses into the
tensor it indexes, so whatever values the inputs hold (negative request
indices, lengths past the row, garbage slots), nothing is read out of range;
and nothing is ever written by index: outputs are built by gathers,
comparisons and reductions over static shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .config import SpecConfig
from .metadata import PAGE_SENTINEL


class BatchView:
    """Sanitised per-batch inputs.

    Attributes:
        req_to_token: the caller's table (not copied).
        rows: int64 ``[B]`` request rows, clamped into ``req_to_token``.
        seq_lens: int64 ``[B]`` clamped to ``[0, max_context_len]``.
        live: bool ``[B]``; False for padding rows (``seq_len == 0``).
    """

    def __init__(self, cfg: SpecConfig, req_to_token, req_pool_indices, seq_lens):
        self.cfg = cfg
        self.req_to_token = req_to_token
        self.rows = req_pool_indices.to(torch.int64).clamp(0, req_to_token.shape[0] - 1)
        self.seq_lens = seq_lens.to(torch.int64).clamp(0, cfg.max_context_len)
        self.live = self.seq_lens > 0

    @property
    def last_page_lens(self) -> torch.Tensor:
        """int64 ``[B]`` ``seq_len % P``: tokens on the partial last page (0 if P == 1)."""
        return torch.remainder(self.seq_lens, self.cfg.page_size)

    @property
    def batch_size(self) -> int:
        return self.rows.shape[0]

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Slots of token ``positions`` (int64 ``[B, n]``) of each request.

        Clamped into the KV pool when ``cfg.num_pages`` is set.
        """
        cols = positions.clamp(0, self.req_to_token.shape[1] - 1)
        slots = self.req_to_token[self.rows.unsqueeze(1), cols].to(torch.int64)
        return in_pool(slots, self.cfg.page_size, self.cfg.num_pages)

    def page_table(self, lengths: torch.Tensor, width: int) -> torch.Tensor:
        """Page table over ``lengths`` tokens (int64 ``[B]``), ``width`` columns.

        Column ``j < ceil(lengths[b] / P)`` holds
        ``req_to_token[row_b, j * P] // P``; the rest hold the sentinel.
        """
        p = self.cfg.page_size
        cols = torch.arange(width, device=self.rows.device)
        first_tokens = (cols * p).unsqueeze(0).expand(self.batch_size, width)
        pages = torch.div(self.slots(first_tokens), p, rounding_mode="floor")
        used = cols.unsqueeze(0) < cdiv_tensor(lengths, p).unsqueeze(1)
        return torch.where(used, pages, PAGE_SENTINEL).to(torch.int32)

    def mask_padding(self, values: torch.Tensor, repeats: int = 1) -> torch.Tensor:
        """Zero ``values`` (leading dim ``B * repeats``) on padding rows."""
        live = repeat_rows(self.live, repeats)
        shape = (-1,) + (1,) * (values.dim() - 1)
        return torch.where(live.view(shape), values, torch.zeros_like(values))


def in_pool(slots: torch.Tensor, page_size: int, num_pages) -> torch.Tensor:
    """int64 ``slots`` clamped into a pool of ``num_pages`` pages (as they are when None)."""
    slots = slots.to(torch.int64)
    if num_pages is None:
        return slots
    return slots.clamp(0, num_pages * page_size - 1)


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
