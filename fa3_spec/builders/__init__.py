"""Pure metadata builders, one module per forward mode."""

from .decode import build_decode_metadata
from .draft import (
    build_draft_decode_metadata,
    build_draft_iteration_metadata,
    build_draft_prefix_metadata,
    draft_tail_copy_slots,
)
from .extend import build_draft_extend_metadata
from .prefill import build_prefill_metadata, extend_query_positions
from .verify import build_target_verify_metadata

MODES = ("decode", "draft_decode", "target_verify", "draft_extend")


def build_metadata(mode: str, cfg, *, step: int = 0, **kwargs):
    """Call the builder of ``mode`` (one of `MODES`) with the builder's keywords."""
    if mode == "draft_decode":
        return build_draft_decode_metadata(cfg, step, **kwargs)
    builders = {
        "decode": build_decode_metadata,
        "target_verify": build_target_verify_metadata,
        "draft_extend": build_draft_extend_metadata,
    }
    if mode not in builders:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return builders[mode](cfg, **kwargs)


__all__ = [
    "MODES",
    "build_metadata",
    "build_decode_metadata",
    "build_draft_decode_metadata",
    "build_draft_extend_metadata",
    "build_draft_iteration_metadata",
    "build_draft_prefix_metadata",
    "build_prefill_metadata",
    "build_target_verify_metadata",
    "extend_query_positions",
    "draft_tail_copy_slots",
]
