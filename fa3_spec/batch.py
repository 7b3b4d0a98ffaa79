"""`SpecBatch`: one validated record of a batch's inputs.

Every builder takes the same request triple (``req_to_token``,
``req_pool_indices``, ``seq_lens``) plus, by mode, ``out_cache_loc`` or
``ancestor_slots``, ``tree_mask`` or ``extend_seq_lens``. A `SpecBatch`
holds them, validated once at construction (shapes, dtypes, devices; never
values), with ``out_cache_loc`` in its one canonical shape ``[B * K, S]``
and ``ancestor_slots`` in ``[B * K, d']``. It is a frozen
pytree: it crosses ``torch.compile`` boundaries, and building it *outside* a
compiled region is how a compiled caller gets `ValueError`/`TypeError`
rather than dynamo's wrapper exception.

    >>> import torch, fa3_spec
    >>> cfg = fa3_spec.SpecConfig(page_size=2, topk=2, num_steps=3,
    ...                           num_draft_tokens=3, max_bs=4, max_context_len=8)
    >>> r2t = torch.arange(16, 32, dtype=torch.int32).view(1, 16)  # one row, pages 8..15
    >>> loc = torch.tensor([[[21, 22, 23], [25, 26, 27]]])  # [B, K, S] draft slots
    >>> batch = SpecBatch.create(cfg, req_to_token=r2t, req_pool_indices=torch.tensor([0]),
    ...                          seq_lens=torch.tensor([5]), out_cache_loc=loc)
    >>> batch.out_cache_loc.shape  # canonical [B * K, S]
    torch.Size([2, 3])
    >>> md = fa3_spec.build_metadata("draft_decode", batch, step=1)
    >>> md.expand.page_table.tolist()  # ok-host: doctest
    [[10, 11, 0], [12, 13, 0]]
    >>> SpecBatch.create(cfg, req_to_token=r2t, req_pool_indices=torch.tensor([0]),
    ...                  seq_lens=torch.tensor([5.0]))
    Traceback (most recent call last):
        ...
    TypeError: seq_lens must have dtype in (torch.int32, torch.int64), got torch.float32
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.utils._pytree as pytree

from . import _validate
from .config import SpecConfig, check_config
from .paged import BatchView

_TENSORS = ("req_to_token", "req_pool_indices", "seq_lens", "out_cache_loc", "tree_mask",
            "extend_seq_lens", "ancestor_slots")


@dataclasses.dataclass(frozen=True)
class SpecBatch:
    """The inputs of one batch, validated.

    Attributes:
        cfg: the static configuration (pytree context, not a leaf).
        req_to_token: int32/int64 ``[max_reqs, >= cfg.min_row_len]`` (engine-owned).
        req_pool_indices: int ``[B]`` row of each request.
        seq_lens: int ``[B]`` tokens in the cache; 0 marks a padding row.
        out_cache_loc: int ``[B * K, S]`` draft slots (upstream's row-major
            ``[B, K, S]`` viewed per branch), or None.
        tree_mask: bool ``[B, N, N]`` draft part of the verify mask, or None.
        extend_seq_lens: int ``[B]`` tokens re-read by draft extend, or None.
        ancestor_slots: int64 ``[B * K, d']`` slots of each draft leaf's
            ancestors and its own (depths ``0 .. d'-1``), or None
            (docs/semantics.md, "Draft decode").
    """

    cfg: SpecConfig
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: Optional[torch.Tensor] = None
    tree_mask: Optional[torch.Tensor] = None
    extend_seq_lens: Optional[torch.Tensor] = None
    ancestor_slots: Optional[torch.Tensor] = None

    @classmethod
    def create(cls, cfg: SpecConfig, *, req_to_token, req_pool_indices, seq_lens,
               out_cache_loc=None, tree_mask=None, extend_seq_lens=None,
               ancestor_slots=None) -> "SpecBatch":
        """Validate and canonicalise; the arguments keep the builders' names and meanings."""
        if isinstance(req_to_token, SpecBatch):
            raise TypeError("pass a SpecBatch to fa3_spec.build_metadata, not as req_to_token")
        cfg = check_config(cfg)
        bs = _validate.request_triple(cfg, req_to_token, req_pool_indices, seq_lens)
        device = dict(seq_lens=seq_lens)
        if out_cache_loc is not None:
            out_cache_loc = _validate.draft_slots(cfg, out_cache_loc, bs)
            device["out_cache_loc"] = out_cache_loc
        if tree_mask is not None:
            tree_mask = _validate.tree_mask(tree_mask, bs, cfg.num_draft_tokens)
            device["tree_mask"] = tree_mask
        if extend_seq_lens is not None:
            extend_seq_lens = _validate.per_request("extend_seq_lens", extend_seq_lens, bs)
            device["extend_seq_lens"] = extend_seq_lens
        if ancestor_slots is not None:
            ancestor_slots = _validate.ancestor_slots(cfg, ancestor_slots, bs)
            device["ancestor_slots"] = ancestor_slots
        _validate.same_device(**device)
        return cls(cfg, req_to_token, req_pool_indices, seq_lens, out_cache_loc, tree_mask,
                   extend_seq_lens, ancestor_slots)

    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.shape[0]

    def view(self) -> BatchView:
        """The sanitised views builders read: rows and lengths clamped, padding mask."""
        return BatchView(self.cfg, self.req_to_token, self.req_pool_indices,
                         self.seq_lens)

    def require(self, *names: str, mode: str, condition: str = "") -> None:
        """Raise `ValueError` if any of ``names`` is missing (None) for ``mode``
        (required under ``condition``, e.g. ``"topk > 1"``, when given)."""
        for name in names:
            if getattr(self, name) is None:
                raise ValueError(f"{name} is required for mode {mode!r}"
                                 + (f" with {condition}" if condition else ""))


def _flatten(batch: SpecBatch):
    return [getattr(batch, n) for n in _TENSORS], batch.cfg


def _unflatten(children, cfg) -> SpecBatch:
    return SpecBatch(cfg, *children)


pytree.register_pytree_node(SpecBatch, _flatten, _unflatten,
                            serialized_type_name="fa3_spec.SpecBatch")
