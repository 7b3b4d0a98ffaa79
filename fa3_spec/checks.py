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

Every check reads the *raw* inputs (int64, before any clamp or int32 cast),
over exactly the token positions the mode's FA3 calls read (see
``docs/semantics.md``). Padding rows (``seq_len == 0``) are exempt from every
check: they read nothing.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _validate
from .config import SpecConfig, check_config
from .invariants import ErrorFlag, MESSAGES, flag, row_flags
from .modes import get_mode

__all__ = ["ErrorFlag", "describe_errors", "error_flags"]


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
    ancestor_slots: Optional[torch.Tensor] = None,
    num_pages: Optional[int] = None,
) -> torch.Tensor:
    """int32 scalar tensor: the OR of every `ErrorFlag` the inputs violate.

    Takes the arguments of the builder of ``mode`` (a key of
    `fa3_spec.MODES`), validated exactly as that builder validates them
    (same `ValueError`/`TypeError`), plus, optionally, the KV pool size
    ``num_pages`` (default ``cfg.num_pages``). Page ids are checked against
    int32 always, and against the pool when its size is known.

    Rows with ``seq_len == 0`` are padding: every check exempts them. No host
    sync, static shapes: capture it with the step.
    """
    spec = get_mode(mode)
    cfg = check_config(cfg)
    batch = spec.batch(cfg, step=step, req_to_token=req_to_token,
                       req_pool_indices=req_pool_indices, seq_lens=seq_lens,
                       out_cache_loc=out_cache_loc, tree_mask=tree_mask,
                       extend_seq_lens=extend_seq_lens, ancestor_slots=ancestor_slots)
    if num_pages is None:
        num_pages = cfg.num_pages
    else:
        _validate.positive_int("num_pages", num_pages)

    view = batch.view()
    raw_seq = seq_lens.to(torch.int64)
    rpi = req_pool_indices.to(torch.int64)
    live = raw_seq > 0
    flags = flag(live & ((rpi < 0) | (rpi >= req_to_token.shape[0])),
                 ErrorFlag.REQUEST_INDEX_OUT_OF_RANGE)
    flags = flags | flag((raw_seq < 0) | (raw_seq > cfg.max_context_len),
                         ErrorFlag.SEQ_LEN_OUT_OF_RANGE)
    # The request-level call: positions t < length of the request's own row.
    flags = flags | row_flags(cfg, view, spec.read_length(batch, view, step), num_pages)
    return flags | spec.flags(batch, view, step, num_pages)


def describe_errors(flags) -> list:
    """Readable messages for an error mask (reads it: the one host sync)."""
    value = int(flags)
    return [msg for bit, msg in MESSAGES.items() if value & int(bit)]
