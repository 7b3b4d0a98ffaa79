"""The forward modes, in one table.

Each mode's module defines its `Mode` (`fa3_spec.builders.interface`): the extra
batch inputs it takes and requires, its builder, its sliding-window builder,
how many queries each request contributes, which tokens of the request's own
``req_to_token`` row its request-level FA3 call reads, and its value checks.
Dispatch sites (``build_metadata``, ``error_flags``, the audit, the CLI) look
the mode up in `MODES`; there is no other list of modes and no switch over
their names.

======================  ======================  =====================  ===========
mode                    extra inputs            queries per request    per step
======================  ======================  =====================  ===========
``decode``              --                      1                      no
``draft_decode``        ``out_cache_loc``       K                      yes
                        or ``ancestor_slots``
``target_verify``       ``tree_mask``           N                      no
``draft_extend``        ``extend_seq_lens``     <= N (static bound N)  no
======================  ======================  =====================  ===========

Draft decode takes ``out_cache_loc`` (each branch attends its own slots,
sglang's semantics) or ``ancestor_slots`` (each leaf attends its true
ancestors), never both, and one of them when topk > 1; ``tree_mask`` is optional (None verifies a chain). Prefill of new prompts
(`fa3_spec.build_prefill_metadata`) is not a speculative mode: it takes a
static bound on new tokens per request and has no per-iteration role here.
"""

from __future__ import annotations

from typing import Dict, Optional

from . import _validate
from .batch import SpecBatch
from .builders import decode, draft, extend, verify
from .builders.interface import Mode
from .metadata import Metadata

__all__ = ["MODES", "Mode", "build_metadata", "get_mode"]

MODES: Dict[str, Mode] = {mode.name: mode for mode in (decode.MODE, draft.MODE, verify.MODE,
                                                       extend.MODE)}


def get_mode(name: str) -> Mode:
    """The `Mode` called ``name``; `ValueError` listing the modes otherwise."""
    if name not in MODES:
        raise ValueError(f"mode must be one of {tuple(MODES)}, got {name!r}")
    return MODES[name]


def build_metadata(mode: str, cfg_or_batch, *, step: int = 0, window_left: Optional[int] = None,
                   **kwargs) -> Metadata:
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
        spec.check(batch, step)
    else:
        batch = spec.batch(cfg_or_batch, step=step, **kwargs)
    if window_left is not None:
        return spec.window(batch, step, _validate.window_side("window_left", window_left, 0))
    return spec.build(batch, step)
