"""Checked mode: detect invalid tensor *values* on the device, without a sync.

Builders never index out of range whatever the inputs hold: they clamp. But a
clamped garbage input still gives wrong metadata. `error_flags` computes an
int32 bitmask of value-level invariant violations with plain torch ops. It is
traceable with ``fullgraph=True``, captures into a CUDA graph next to the builders,
and costs no host sync. Read it after the step (a sync the caller chooses), and
turn it into words with `describe_errors`.

    flags = fa3_spec.error_flags(cfg, "draft_decode", step=2, num_pages=pool_pages,
                                 req_to_token=..., req_pool_indices=..., seq_lens=...,
                                 out_cache_loc=...)
    ...  # the captured step runs
    if int(flags):                         # the one sync, outside the step
        raise RuntimeError(describe_errors(flags))
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

import torch

from . import _validate
from ._paged import BatchView, repeat_rows
from .builders import build_metadata
from .config import SpecConfig


class ErrorFlag(enum.IntFlag):
    """Bits of the error mask."""

    REQUEST_INDEX_OUT_OF_RANGE = 1 << 0  # req_pool_indices outside req_to_token's rows
    SEQ_LEN_OUT_OF_RANGE = 1 << 1  # seq_len < 0 or > max_context_len (window past the row)
    DRAFT_LAYOUT = 1 << 2  # distinct expand pages != ceil((last + d) / P)
    TREE_MASK_NOT_A_TREE = 1 << 3  # a row without itself or the root; ancestors not closed
    PAGE_ID_OUT_OF_RANGE = 1 << 4  # a page id FA3 will read outside [0, num_pages)
    EXTEND_LEN_OUT_OF_RANGE = 1 << 5  # extend_seq_len < 0, > N or > seq_len


_MESSAGES = {
    ErrorFlag.REQUEST_INDEX_OUT_OF_RANGE: "a req_pool_indices entry is outside req_to_token's rows",
    ErrorFlag.SEQ_LEN_OUT_OF_RANGE: "a seq_len is negative or above max_context_len "
    "(its window would run past the req_to_token row)",
    ErrorFlag.DRAFT_LAYOUT: "draft slots are not laid out as SPEC §3 requires: a branch's "
    "first d slots span a number of pages other than ceil((seq_len % P + d) / P)",
    ErrorFlag.TREE_MASK_NOT_A_TREE: "tree_mask is not an ancestor mask: a row misses itself "
    "or the root, or is not closed under ancestors",
    ErrorFlag.PAGE_ID_OUT_OF_RANGE: "a page id FA3 will read is outside the KV pool",
    ErrorFlag.EXTEND_LEN_OUT_OF_RANGE: "an extend_seq_len is negative, above num_draft_tokens "
    "or above its seq_len",
}


def _flag(violated: torch.Tensor, bit: ErrorFlag) -> torch.Tensor:
    return violated.any().to(torch.int32) * int(bit)


def error_flags(
    cfg: SpecConfig,
    mode: str,
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    step: int = 0,
    out_cache_loc: Optional[torch.Tensor] = None,
    tree_mask: Optional[torch.Tensor] = None,
    extend_seq_lens: Optional[torch.Tensor] = None,
    num_pages: Optional[int] = None,
) -> torch.Tensor:
    """int32 scalar tensor: the OR of every `ErrorFlag` the inputs violate.

    Takes the arguments of the builder of ``mode`` (one of ``decode``,
    ``draft_decode``, ``target_verify``, ``draft_extend``) plus, optionally, the
    KV pool size ``num_pages`` (default ``cfg.num_pages``), to check every
    page id FA3 would read before any clamping. Rows
    with ``seq_len == 0`` are padding and are exempt from the layout, tree and
    page checks. No host sync, static shapes: capture it with the step.
    """
    _validate.batch(cfg, req_to_token, req_pool_indices, seq_lens)
    view = BatchView(cfg, req_to_token, req_pool_indices, seq_lens)
    raw_seq = seq_lens.to(torch.int64)
    rpi = req_pool_indices.to(torch.int64)
    flags = _flag((rpi < 0) | (rpi >= req_to_token.shape[0]), ErrorFlag.REQUEST_INDEX_OUT_OF_RANGE)
    flags = flags | _flag((raw_seq < 0) | (raw_seq > cfg.max_context_len), ErrorFlag.SEQ_LEN_OUT_OF_RANGE)
    live = view.live

    kwargs = dict(req_to_token=req_to_token, req_pool_indices=req_pool_indices, seq_lens=seq_lens)
    if mode == "draft_decode":
        kwargs["out_cache_loc"] = out_cache_loc
        if cfg.topk > 1 and cfg.page_size > 1 and out_cache_loc is not None:
            flags = flags | _draft_layout(cfg, step, view, out_cache_loc)
    elif mode == "target_verify":
        kwargs["tree_mask"] = tree_mask
        if tree_mask is not None:
            flags = flags | _tree_flags(tree_mask, live)
    elif mode == "draft_extend":
        ext = _validate.tensor("extend_seq_lens", extend_seq_lens, ndim=1).to(torch.int64)
        kwargs["extend_seq_lens"] = extend_seq_lens
        bad = (ext < 0) | (ext > cfg.num_draft_tokens) | (ext > raw_seq)
        flags = flags | _flag(bad & live, ErrorFlag.EXTEND_LEN_OUT_OF_RANGE)
    elif mode != "decode":
        raise ValueError(f"unknown mode {mode!r}")

    if num_pages is None:
        num_pages = cfg.num_pages
    if num_pages is not None:
        # Raw page ids: the check must see what the values hold, not the
        # clamped ids builders write when cfg.num_pages is set.
        raw = dataclasses.replace(cfg, num_pages=None)
        for call in build_metadata(mode, raw, step=step, **kwargs).calls:
            pool = num_pages * cfg.page_size // call.page_size  # pages of the call's own size
            page = call.page_table.to(torch.int64)
            bad = call.read_columns() & ((page < 0) | (page >= pool))
            flags = flags | _flag(bad, ErrorFlag.PAGE_ID_OUT_OF_RANGE)
    return flags


def _draft_layout(cfg: SpecConfig, step: int, view: BatchView, out_cache_loc) -> torch.Tensor:
    d, p, k = cfg.decode_length(step), cfg.page_size, cfg.topk
    loc = out_cache_loc.reshape(view.batch_size * k, cfg.num_steps)[:, :d].to(torch.int64)
    pages = torch.div(loc, p, rounding_mode="floor")
    distinct = 1 + (pages[:, 1:] != pages[:, :-1]).sum(dim=1)
    last = repeat_rows(view.last_page_lens, k)
    # Consecutive positions: their offsets also follow on from `last`.
    offsets_ok = (torch.remainder(loc[:, 0], p) == last)
    bad = (distinct != (last + d + p - 1) // p) | ~offsets_ok
    return _flag(bad & repeat_rows(view.live, k), ErrorFlag.DRAFT_LAYOUT)


def _tree_flags(tree_mask: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    mask = tree_mask.to(torch.bool)
    n = mask.shape[-1]
    eye = torch.eye(n, dtype=torch.bool, device=mask.device)
    missing_self = (~mask & eye).flatten(1).any(dim=1)
    missing_root = (~mask[:, :, 0]).any(dim=1) if n else torch.zeros_like(live)
    m = mask.to(torch.float32)
    # Closed under ancestors: if j sees c and c sees a, j must see a.
    reach = torch.bmm(m, m) > 0
    not_closed = (reach & ~mask).flatten(1).any(dim=1)
    bad = (missing_self | missing_root | not_closed) & live
    return _flag(bad, ErrorFlag.TREE_MASK_NOT_A_TREE)


def describe_errors(flags) -> list:
    """Readable messages for an error mask (reads it: the one host sync)."""
    value = int(flags)
    return [msg for bit, msg in _MESSAGES.items() if value & int(bit)]
