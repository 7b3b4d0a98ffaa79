"""The forward modes, in one table.

Each `Mode` names its builder (on a validated `SpecBatch`), the extra batch
inputs it takes, how many queries each request contributes, and which
tokens of the request's own ``req_to_token`` row its request-level FA3 call
reads (what checked mode inspects). Dispatch sites (``build_metadata``,
``error_flags``, the audit, the CLI) read this table; there is no other
list of modes.

======================  ==================  =====================  ===========
mode                    extra inputs        queries per request    per step
======================  ==================  =====================  ===========
``decode``              --                  1                      no
``draft_decode``        ``out_cache_loc``   K                      yes
``target_verify``       ``tree_mask``       N                      no
``draft_extend``        ``extend_seq_lens`` <= N (static bound N)  no
======================  ==================  =====================  ===========

``out_cache_loc`` is required for draft decode only when topk > 1;
``tree_mask`` is optional (None verifies a chain). Prefill of new prompts
(`fa3_spec.build_prefill_metadata`) is not a speculative mode: it takes a
static bound on new tokens per request and has no per-iteration role here.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Tuple

import torch

from .batch import SpecBatch
from .builders import decode, draft, extend, verify, window
from .config import SpecConfig
from .paged import BatchView


@dataclasses.dataclass(frozen=True)
class Mode:
    """One forward mode.

    Attributes:
        name: the mode's name (the key in `MODES`).
        build: ``build(batch, step) -> FA3Metadata | CascadeMetadata``.
        inputs: extra batch inputs the mode takes, beyond the request triple.
        per_step: True when the metadata depends on the draft ``step``.
        queries_per_request: ``f(cfg) -> int`` (a static bound for extend).
        read_length: ``f(view, step, tree) -> int64 [B]``: positions
            ``t < length`` of each request's own row its request-level call reads.
    """

    name: str
    build: Callable
    inputs: Tuple[str, ...]
    per_step: bool
    queries_per_request: Callable[[SpecConfig], int]
    read_length: Callable[[BatchView, int, bool], torch.Tensor]

    def required(self, cfg: SpecConfig) -> Tuple[str, ...]:
        """The extra inputs that must not be None under ``cfg``."""
        if self.name == "draft_decode":
            return self.inputs if cfg.topk > 1 else ()
        if self.name == "target_verify":
            return ()
        return self.inputs

    def batch(self, cfg: SpecConfig, *, step: int = 0, **kwargs) -> SpecBatch:
        """Validate the builder keywords of this mode into a `SpecBatch`.

        Unknown keywords raise `TypeError`; a missing required input raises
        `ValueError`; ``step`` is checked for per-step modes.
        """
        allowed = {"req_to_token", "req_pool_indices", "seq_lens", *self.inputs}
        extra = {k for k, v in kwargs.items() if k not in allowed and v is not None}
        if extra:
            raise TypeError(f"mode {self.name!r} takes no {sorted(extra)}")
        given = {k: v for k, v in kwargs.items() if k in allowed}
        if self.name == "draft_decode" and cfg.topk == 1:
            given.pop("out_cache_loc", None)  # topk = 1: drafts follow the prefix
        batch = SpecBatch.create(cfg, **given)
        batch.require(*self.required(cfg), mode=self.name)
        if self.per_step:
            cfg.check_step(step)
        return batch


MODES: Dict[str, Mode] = {
    mode.name: mode
    for mode in (
        Mode("decode", decode.decode_metadata, (), False, lambda cfg: 1, decode.read_length),
        Mode("draft_decode", draft.draft_decode_metadata, ("out_cache_loc",), True,
             lambda cfg: cfg.topk, draft.read_length),
        Mode("target_verify", verify.target_verify_metadata, ("tree_mask",), False,
             lambda cfg: cfg.num_draft_tokens, verify.read_length),
        Mode("draft_extend", extend.draft_extend_metadata, ("extend_seq_lens",), False,
             lambda cfg: cfg.num_draft_tokens, extend.read_length),
    )
}


def get_mode(name: str) -> Mode:
    """The `Mode` called ``name``; `ValueError` listing the modes otherwise."""
    if name not in MODES:
        raise ValueError(f"mode must be one of {tuple(MODES)}, got {name!r}")
    return MODES[name]


def build_metadata(mode: str, cfg_or_batch, *, step: int = 0, window_left: Optional[int] = None,
                   **kwargs):
    """The metadata of ``mode`` (a key of `MODES`).

    Either ``build_metadata(mode, cfg, step=..., **builder_keywords)`` or
    ``build_metadata(mode, batch, step=...)`` with a `SpecBatch` built
    beforehand (outside a compiled region, so errors keep their types).

    ``window_left=W`` (static int, ``0 <= W <= 2**62``) builds the metadata of a
    sliding-window layer: each query reads only the keys of its own key set
    at positions ``>= pos - W`` (`fa3_spec.builders.window`;
    docs/semantics.md, "Sliding-window layers"). It is a per-call argument,
    not a `SpecConfig` field, because a hybrid model builds both kinds from
    one batch in the same step. Pass the result to `cascade_attention`
    without ``window_size``: single calls carry their window, cascades are
    trimmed exactly.
    """
    spec = get_mode(mode)
    if isinstance(cfg_or_batch, SpecBatch):
        if kwargs:
            raise TypeError("pass either a SpecBatch or builder keywords, not both")
        batch = cfg_or_batch
        batch.require(*spec.required(batch.cfg), mode=mode)
        if spec.per_step:
            batch.cfg.check_step(step)
    else:
        batch = spec.batch(cfg_or_batch, step=step, **kwargs)
    if window_left is not None:
        return window.window_metadata(batch, mode, step, window_left)
    return spec.build(batch, step)
