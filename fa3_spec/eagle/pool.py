"""The paged KV pool of the loop: target and draft caches, ``req_to_token`` rows.

Target and draft each own a cache ``[L, num_pages, P, H_kv, D]``; both are
indexed by the same slots (slot ``s`` = page ``s // P``, offset ``s % P``).
Page 0 is reserved (the sentinel page every padding row reads and writes).

A request owns one ``req_to_token`` row of
``cfg.draft_row_len_for(draft_attention)`` positions (int32 slots). At
admission it gets the pages for every position it can touch: committed
positions up to ``prompt_len + max_new_tokens``, plus the verify window and
the topk > 1 draft scratch past the last one, in the layout of
`fa3_spec.draft_positions` for ``draft_attention``: ``"branch"``, with
``P > 1`` and ``topk > 1`` each branch has its own pages, the first beginning
with a copy of the prefix's partial last page; ``"ancestors"``, plain slots
right after the prefix (``cfg.ancestor_draft_slots`` of them).
Positions past the reservation map to slot 0. Pages come from a shuffled
free list, so a request's pages are scattered over the pool.

Allocation and release are host bookkeeping done between iterations (the
row is written with one host-to-device copy); nothing here runs inside an
iteration, and nothing reads a device value.
"""

from __future__ import annotations

import random
from typing import List, Sequence

import torch

from ..config import SpecConfig, cdiv
from .models import KVCache


class KVPool:
    """Target and draft KV caches plus ``req_to_token``, with a host allocator.

    Args:
        cfg: static configuration; ``cfg.num_pages`` is the pool size in
            pages (page 0 included) and must be set.
        max_reqs: rows of ``req_to_token``.
        target_layers, draft_layers, num_kv_heads, head_dim, dtype, device:
            cache geometry.
        seed: shuffles the free-page list.
        draft_attention: the draft semantics whose scratch each row holds
            (``"branch"`` or ``"ancestors"``, `fa3_spec.DRAFT_ATTENTION`).
        also: configurations of other tree shapes whose iterations run over
            the same pool (per-bucket shapes): each row is long enough, and
            each request reserves enough, for every one of them. They must
            share ``cfg``'s page size, pool size and context bound.
    """

    def __init__(self, cfg: SpecConfig, *, max_reqs: int, target_layers: int, draft_layers: int,
                 num_kv_heads: int, head_dim: int, dtype, device, seed: int = 0,
                 draft_attention: str, also: Sequence[SpecConfig] = ()):
        if cfg.num_pages is None:
            raise ValueError("cfg.num_pages must give the pool size in pages")
        if max_reqs < 1:
            raise ValueError(f"max_reqs must be >= 1, got {max_reqs}")
        for other in also:
            if (other.page_size, other.num_pages, other.max_context_len) != (
                    cfg.page_size, cfg.num_pages, cfg.max_context_len):
                raise ValueError("also: every configuration must share cfg's page_size, "
                                 "num_pages and max_context_len")
        self.cfg = cfg
        self.device = torch.device(device)
        configs = [cfg, *also]
        self.row_len = max(c.draft_row_len_for(draft_attention) for c in configs)
        #: The largest verify window of the shapes served (the tree's nodes).
        self.verify_window = max(c.num_draft_tokens for c in configs)
        self.req_to_token = torch.zeros(max_reqs, self.row_len, dtype=torch.int32, device=device)
        geom = (cfg.num_pages, cfg.page_size, num_kv_heads, head_dim)
        self.target_kv = KVCache.zeros(target_layers, *geom, dtype=dtype, device=device)
        self.draft_kv = KVCache.zeros(draft_layers, *geom, dtype=dtype, device=device)
        pages = list(range(1, cfg.num_pages))
        random.Random(seed).shuffle(pages)
        self._free_pages: List[int] = pages
        self._free_rows: List[int] = list(range(max_reqs))
        self._pages_of_row: dict = {}

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def check_request(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise ValueError if such a request can never fit the configuration."""
        cfg = self.cfg
        if prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        need = prompt_len + max_new_tokens + self.verify_window
        if need > cfg.max_context_len:
            raise ValueError(
                f"prompt_len + max_new_tokens + num_draft_tokens = {need} exceeds "
                f"max_context_len={cfg.max_context_len}")
        if self.pages_needed(prompt_len, max_new_tokens) > cfg.num_pages - 1:
            raise ValueError("the request needs more pages than the pool has")

    def positions_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Row positions a request can touch: committed tokens plus the scratch
        past them (verify window, draft branches)."""
        scratch = self.row_len - self.cfg.max_context_len
        return min(self.row_len, prompt_len + max_new_tokens + scratch)

    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        return cdiv(self.positions_needed(prompt_len, max_new_tokens), self.cfg.page_size)

    def can_allocate(self, prompt_len: int, max_new_tokens: int) -> bool:
        return bool(self._free_rows) and (
            self.pages_needed(prompt_len, max_new_tokens) <= len(self._free_pages))

    def allocate(self, prompt_len: int, max_new_tokens: int) -> int:
        """Reserve a row and its pages; write the row; return the row index."""
        self.check_request(prompt_len, max_new_tokens)
        if not self.can_allocate(prompt_len, max_new_tokens):
            raise RuntimeError("KV pool exhausted (call can_allocate first)")
        p = self.cfg.page_size
        n = self.pages_needed(prompt_len, max_new_tokens)
        pages = [self._free_pages.pop() for _ in range(n)]
        row = self._free_rows.pop(0)
        self._pages_of_row[row] = pages
        pos = torch.arange(n * p)
        slots = torch.tensor(pages, dtype=torch.int64)[pos // p] * p + pos % p
        host = torch.zeros(self.row_len, dtype=torch.int32)
        host[: min(n * p, self.row_len)] = slots[: self.row_len].to(torch.int32)
        self.req_to_token[row].copy_(host.to(self.device))
        return row

    def release(self, row: int) -> None:
        """Return a finished request's pages and row (its stale slots stay in
        the row; no live batch row points at it)."""
        self._free_pages.extend(self._pages_of_row.pop(row))
        self._free_rows.append(row)
