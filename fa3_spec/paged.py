"""The paged view of a batch: slots and page tables read from ``req_to_token``.

Every builder, checked mode, the sglang adapter and the EAGLE loop read a
request's slots the same way, so they share one view of the batch instead
of re-deriving it. `BatchView` clamps every index it uses into the tensor it
indexes (request rows into ``req_to_token``, positions into a row), so
whatever the inputs hold nothing is read out of range; and it never writes
by index: its tables are gathers, comparisons and reductions over static
shapes. Traceable with ``torch.compile(fullgraph=True)``, no host sync.

Two readings of a slot, for two purposes:

* `BatchView.slots`: clamped into the KV pool when ``cfg.num_pages`` is set,
  what a builder writes into a table FA3 reads;
* `BatchView.raw_slots`: the values as the caller wrote them (int64, before
  any clamp or int32 cast), what checked mode inspects.

    >>> import torch, fa3_spec
    >>> cfg = fa3_spec.SpecConfig(page_size=2, topk=1, num_steps=2, num_draft_tokens=1,
    ...                           max_bs=2, max_context_len=5)
    >>> r2t = torch.arange(12, dtype=torch.int32).view(2, 6) + 2   # row 1: slots 8 .. 13
    >>> view = BatchView(cfg, r2t, torch.tensor([1]), torch.tensor([3]))
    >>> view.full_page_table(3).tolist(), view.page_table(view.seq_lens, 3).tolist()  # ok-host: doctest
    ([[4, 5, 6]], [[4, 5, 0]])
"""

from __future__ import annotations

from typing import Optional

import torch

from .offsets import cdiv_tensor, repeat_rows
from .config import SpecConfig
from .metadata import PAGE_SENTINEL

__all__ = ["BatchView", "in_pool"]


class BatchView:
    """Sanitised per-batch inputs and the slots and pages they address.

    Attributes:
        cfg: the static configuration.
        req_to_token: the caller's table (not copied).
        rows: int64 ``[B]`` request rows, clamped into ``req_to_token``.
        seq_lens: int64 ``[B]`` clamped to ``[0, max_context_len]``.
        live: bool ``[B]``; False for padding rows (``seq_len == 0``).
    """

    def __init__(self, cfg: SpecConfig, req_to_token: torch.Tensor,
                 req_pool_indices: torch.Tensor, seq_lens: torch.Tensor):
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

    def raw_slots(self, positions: torch.Tensor) -> torch.Tensor:
        """int64 slots at token ``positions`` (int ``[B, n]``) of each request's row,
        as the caller wrote them: positions are clamped into the row, values are not."""
        cols = positions.clamp(0, self.req_to_token.shape[1] - 1)
        return self.req_to_token[self.rows.unsqueeze(1), cols].to(torch.int64)

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """`raw_slots`, clamped into the KV pool when ``cfg.num_pages`` is set."""
        return in_pool(self.raw_slots(positions), self.cfg.page_size, self.cfg.num_pages)

    def full_page_table(self, width: int) -> torch.Tensor:
        """int32 ``[B, width]``: column ``j`` is ``req_to_token[row_b, j * P] // P``
        for every ``j`` (clamped into the pool), whatever ``seq_len`` is."""
        p = self.cfg.page_size
        first_tokens = (torch.arange(width, device=self.rows.device) * p).expand(self.batch_size, width)
        return torch.div(self.slots(first_tokens), p, rounding_mode="floor").to(torch.int32)

    def page_table(self, lengths: torch.Tensor, width: int) -> torch.Tensor:
        """Page table over ``lengths`` tokens (int64 ``[B]``), ``width`` columns.

        Column ``j < ceil(lengths[b] / P)`` is that of `full_page_table`; the
        rest hold `PAGE_SENTINEL`.
        """
        cols = torch.arange(width, device=self.rows.device)
        used = cols.unsqueeze(0) < cdiv_tensor(lengths, self.cfg.page_size).unsqueeze(1)
        return torch.where(used, self.full_page_table(width), PAGE_SENTINEL).to(torch.int32)

    def mask_padding(self, values: torch.Tensor, repeats: int = 1) -> torch.Tensor:
        """Zero ``values`` (leading dim ``B * repeats``) on padding rows."""
        live = repeat_rows(self.live, repeats)
        shape = (-1,) + (1,) * (values.dim() - 1)
        return torch.where(live.view(shape), values, torch.zeros_like(values))


def in_pool(slots: torch.Tensor, page_size: int, num_pages: Optional[int]) -> torch.Tensor:
    """int64 ``slots`` clamped into a pool of ``num_pages`` pages (as they are when None)."""
    slots = slots.to(torch.int64)
    if num_pages is None:
        return slots
    return slots.clamp(0, num_pages * page_size - 1)
