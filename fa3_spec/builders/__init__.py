"""Pure metadata builders, one module per forward mode."""

from .decode import build_decode_metadata
from .draft import (
    build_draft_decode_metadata,
    build_draft_prefix_metadata,
    draft_tail_copy_slots,
)
from .extend import build_draft_extend_metadata
from .verify import build_target_verify_metadata

__all__ = [
    "build_decode_metadata",
    "build_draft_decode_metadata",
    "build_draft_extend_metadata",
    "build_draft_prefix_metadata",
    "build_target_verify_metadata",
    "draft_tail_copy_slots",
]
