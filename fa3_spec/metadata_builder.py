"""`MetadataBuilder`: one deployment's static choices, bound once.

An engine makes one builder per deployment, outside any compiled region, from
its `SpecConfig`, its draft attention semantics and its KV pool size, then calls
it per step with tensors alone::

    builder = MetadataBuilder(cfg, num_pages=pool_pages)      # once
    md = builder.build("target_verify", req_to_token=..., req_pool_indices=...,
                       seq_lens=..., tree_mask=...)            # every step

The builder is a `fa3_spec.frozen.FrozenModule`: dynamo specialises the int
attributes of modules, so every size the builder reads is a compile-time
constant in a compiled step that takes it as an argument or closes over it,
however many configurations one process compiles, while the batch dimension
stays whatever the caller marks dynamic. A bare `SpecConfig` passed as an
argument of a compiled function does not have that property: dynamo makes its
ints symbolic when a second configuration arrives (docs/graphs.md).

Several tree shapes can share one pool: `with_shape` returns a builder of
another ``(topk, num_steps, num_draft_tokens)`` over the same pages, and the
pool is sized for the largest (`pool_pages` of each, take the maximum).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, List, Optional

import torch

from . import _validate
from .batch import SpecBatch
from .builders.draft import (
    build_draft_iteration_metadata,
    build_draft_prefix_metadata,
    draft_positions,
    draft_slots,
    draft_tail_copy_slots,
)
from .builders.prefill import build_prefill_metadata
from .checks import error_flags
from .frozen import FrozenModule
from .config import SpecConfig, check_config, check_draft_attention
from .metadata import FA3Metadata, Metadata
from .modes import get_mode

__all__ = ["MetadataBuilder"]

#: The default draft attention semantics: each tree leaf attends its true
#: ancestors (EAGLE-2's own semantics, from any allocator's slots).
DEFAULT_DRAFT_ATTENTION = "ancestors"


class MetadataBuilder(FrozenModule):
    """The metadata of every mode of one deployment.

    Args:
        cfg: the deployment's `SpecConfig`.
        draft_attention: what a tree draft leaf attends besides the prefix
            (`fa3_spec.DRAFT_ATTENTION`): ``"ancestors"`` (default), its true
            ancestors, from ``ancestor_slots``; ``"branch"``, its branch's own
            slots in ``out_cache_loc`` (sglang's semantics and slot layout).
        num_pages: the KV pool's size in pages (default ``cfg.num_pages``).
            Given, every page id a builder writes is clamped into the pool.

    The builder is immutable: it is made once and read by compiled steps.
    Methods raise `ValueError`/`TypeError` naming the argument, at trace time.
    """

    def __init__(self, cfg: SpecConfig, *, draft_attention: str = DEFAULT_DRAFT_ATTENTION,
                 num_pages: Optional[int] = None) -> None:
        super().__init__()
        check_config(cfg)
        check_draft_attention(draft_attention)
        if num_pages is not None:
            _validate.positive_int("num_pages", num_pages)
            if cfg.num_pages is not None and cfg.num_pages != num_pages:
                raise ValueError(f"num_pages={num_pages} differs from cfg.num_pages="
                                 f"{cfg.num_pages}; give the pool size once")
            cfg = dataclasses.replace(cfg, num_pages=num_pages)
        self.cfg = cfg
        self.draft_attention = draft_attention
        self.freeze()

    def extra_repr(self) -> str:
        return f"{self.cfg!r}, draft_attention={self.draft_attention!r}"

    # ------------------------------------------------------------------ sizes
    @property
    def num_pages(self) -> Optional[int]:
        """The KV pool's size in pages, or None (page ids are trusted)."""
        return self.cfg.num_pages

    @property
    def page_table_width(self) -> int:
        """Columns of every request-level page table (`SpecConfig.page_table_width`)."""
        return self.cfg.page_table_width

    @property
    def min_row_len(self) -> int:
        """Shortest ``req_to_token`` row the builders accept (`SpecConfig.min_row_len`)."""
        return self.cfg.min_row_len

    @property
    def row_len(self) -> int:
        """``req_to_token`` row length that also holds an iteration's draft slots
        under this builder's semantics (`SpecConfig.draft_row_len_for`)."""
        return self.cfg.draft_row_len_for(self.draft_attention)

    def pool_pages(self, max_reqs: int) -> int:
        """Pool size, in pages, that gives each of ``max_reqs`` requests a whole
        row of `row_len` slots (`SpecConfig.pool_pages`)."""
        return self.cfg.pool_pages(max_reqs, self.draft_attention)

    def expand_width(self, step: int) -> int:
        """Columns of the branch draft expand page table at ``step``."""
        return self.cfg.expand_width(step)

    def with_shape(self, *, topk: int, num_steps: int,
                   num_draft_tokens: int) -> "MetadataBuilder":
        """A builder of another tree shape over the same pool, page size,
        context bound, batch bound and draft semantics."""
        return MetadataBuilder(self.cfg.with_shape(topk, num_steps, num_draft_tokens),
                               draft_attention=self.draft_attention)

    # --------------------------------------------------------------- metadata
    def build(self, mode: str, *, step: int = 0, window_left: Optional[int] = None,
              req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
              seq_lens: torch.Tensor, **inputs: Optional[torch.Tensor]) -> Metadata:
        """The metadata of ``mode`` (a key of `fa3_spec.MODES`) for one batch.

        ``inputs`` are the mode's extra tensors (`fa3_spec.MODES[mode].inputs`).
        A draft-decode step takes ``ancestor_slots`` under ``"ancestors"`` and
        ``out_cache_loc`` under ``"branch"``; the other is refused.
        ``window_left`` builds a sliding-window layer's metadata
        (`fa3_spec.build_metadata`).
        """
        spec = get_mode(mode)
        inputs = self._inputs(mode, inputs)
        batch = spec.batch(self.cfg, step=step, req_to_token=req_to_token,
                           req_pool_indices=req_pool_indices, seq_lens=seq_lens, **inputs)
        if window_left is not None:
            return spec.window(batch, step, _validate.window_side("window_left", window_left, 0))
        return spec.build(batch, step)

    def draft_prefix(self, *, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor) -> FA3Metadata:
        """The step-invariant prefix call of a tree draft (`fa3_spec.build_draft_prefix_metadata`)."""
        return build_draft_prefix_metadata(self.cfg, req_to_token=req_to_token,
                                           req_pool_indices=req_pool_indices,
                                           seq_lens=seq_lens,
                                           draft_attention=self.draft_attention)

    def draft_iteration(self, *, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                        seq_lens: torch.Tensor,
                        out_cache_loc: Optional[torch.Tensor] = None) -> List[Metadata]:
        """Every branch draft-decode step of one iteration at once
        (`fa3_spec.build_draft_iteration_metadata`); ``"branch"`` builders only,
        because an ancestor step depends on the previous step's selection."""
        if self.draft_attention != "branch":
            raise ValueError("draft_iteration builds branch steps; this builder's "
                             "draft_attention is 'ancestors' (build each step with "
                             "build('draft_decode', step=..., ancestor_slots=...))")
        return build_draft_iteration_metadata(self.cfg, req_to_token=req_to_token,
                                              req_pool_indices=req_pool_indices,
                                              seq_lens=seq_lens, out_cache_loc=out_cache_loc)

    def prefill(self, *, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                seq_lens: torch.Tensor, extend_seq_lens: torch.Tensor,
                max_seqlen_q: int) -> FA3Metadata:
        """Metadata of a prefill of new prompt tokens (`fa3_spec.build_prefill_metadata`)."""
        return build_prefill_metadata(self.cfg, req_to_token=req_to_token,
                                      req_pool_indices=req_pool_indices, seq_lens=seq_lens,
                                      extend_seq_lens=extend_seq_lens,
                                      max_seqlen_q=max_seqlen_q)

    def draft_positions(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """Row positions of an iteration's draft slots (`fa3_spec.draft_positions`)."""
        return draft_positions(self.cfg, seq_lens, self.draft_attention)

    def draft_tail_copy_slots(self, *, seq_lens: torch.Tensor, out_cache_loc: torch.Tensor):
        """``(src, dst)`` of the branch layout's tail copy (`fa3_spec.draft_tail_copy_slots`)."""
        return draft_tail_copy_slots(self.cfg, seq_lens=seq_lens, out_cache_loc=out_cache_loc)

    def error_flags(self, mode: str, *, step: int = 0, **tensors: torch.Tensor) -> torch.Tensor:
        """int32 scalar of `fa3_spec.ErrorFlag` bits for one batch of ``mode``
        (`fa3_spec.error_flags`), against this builder's pool."""
        tensors = self._inputs(mode, tensors)
        return error_flags(self.cfg, mode, step=step, **tensors)

    def batch(self, mode: str, *, step: int = 0, **tensors: torch.Tensor) -> SpecBatch:
        """The validated `SpecBatch` of ``mode``: build it outside a compiled
        region to get `ValueError`/`TypeError` there."""
        tensors = self._inputs(mode, tensors)
        return get_mode(mode).batch(self.cfg, step=step, **tensors)

    def _inputs(self, mode: str, inputs: dict) -> dict:
        """``inputs`` as ``mode`` takes them: for a draft-decode step, the draft
        slots this builder's semantics reads, the other kind refused."""
        if mode != "draft_decode":
            return inputs
        return draft_slots(self.cfg, self.draft_attention, inputs)


def shared_pool_pages(builders: Iterable[MetadataBuilder], max_reqs: int) -> int:
    """Pool size, in pages, that serves every builder's shape: the largest `pool_pages`."""
    sizes = [b.pool_pages(max_reqs) for b in builders]
    if not sizes:
        raise ValueError("builders must not be empty")
    return max(sizes)
