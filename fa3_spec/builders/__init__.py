"""Pure metadata builders, one module per forward mode.

Each mode's module has a public entry point with the builders' keyword
signature (``build_*_metadata(cfg, *, req_to_token, ...)``) that validates its
inputs into a `fa3_spec.SpecBatch`, the builder proper on a `SpecBatch`, and
its `Mode` (`mode`): everything the library knows about the mode, in one
place. The mode table (`fa3_spec.modes.MODES`) lists them; `window` builds
the two shapes of sliding-window metadata the modes use
(``build_metadata(mode, ..., window_left=W)``).
"""

from .ancestors import draft_ancestor_slots
from .decode import build_decode_metadata
from .draft import (
    build_draft_decode_metadata,
    build_draft_iteration_metadata,
    build_draft_prefix_metadata,
    draft_positions,
    draft_tail_copy_slots,
)
from .extend import build_draft_extend_metadata
from .prefill import build_prefill_metadata, extend_query_positions
from .verify import build_target_verify_metadata

__all__ = [
    "build_decode_metadata",
    "build_draft_decode_metadata",
    "build_draft_extend_metadata",
    "build_draft_iteration_metadata",
    "build_draft_prefix_metadata",
    "build_prefill_metadata",
    "build_target_verify_metadata",
    "draft_ancestor_slots",
    "extend_query_positions",
    "draft_positions",
    "draft_tail_copy_slots",
]
