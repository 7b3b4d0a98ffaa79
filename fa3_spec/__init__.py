"""fa3_spec: FlashAttention-3 metadata for EAGLE speculative decoding.

Pure functional builders of the page tables, sequence lengths and cumulative
offsets FA3 needs in every speculative forward mode over a paged KV cache,
with no host syncs, so that metadata and attention compile with
``torch.compile(fullgraph=True)`` and capture into one CUDA graph.

    >>> import fa3_spec
    >>> cfg = fa3_spec.SpecConfig(page_size=2, topk=8, num_steps=5,
    ...     num_draft_tokens=6, max_bs=64, max_context_len=8192)
"""

from .attention import cascade_attention, merge_attention_states
from .batch import SpecBatch
from .builders import (
    build_decode_metadata,
    build_prefill_metadata,
    extend_query_positions,
    build_draft_decode_metadata,
    build_draft_extend_metadata,
    build_draft_iteration_metadata,
    build_draft_prefix_metadata,
    build_target_verify_metadata,
    draft_ancestor_slots,
    draft_positions,
    draft_tail_copy_slots,
)
from .checks import ErrorFlag, describe_errors, error_flags
from .config import DRAFT_ATTENTION, SpecConfig
from .expand import draft_expand_page_table, draft_expand_tables
from .metadata_builder import MetadataBuilder
from .metadata import PAGE_SENTINEL, CascadeMetadata, DraftPrefixMetadata, FA3Metadata, Metadata
from .modes import MODES, Mode, build_metadata
from .tree import tree_mask_from_flat, tree_mask_from_parents

__version__ = "0.1.0"

__all__ = [
    "MODES",
    "ErrorFlag",
    "build_metadata",
    "describe_errors",
    "error_flags",
    "PAGE_SENTINEL",
    "CascadeMetadata",
    "DRAFT_ATTENTION",
    "DraftPrefixMetadata",
    "FA3Metadata",
    "Metadata",
    "MetadataBuilder",
    "SpecBatch",
    "SpecConfig",
    "Mode",
    "build_decode_metadata",
    "build_prefill_metadata",
    "extend_query_positions",
    "cascade_attention",
    "merge_attention_states",
    "build_draft_decode_metadata",
    "build_draft_extend_metadata",
    "build_draft_iteration_metadata",
    "build_draft_prefix_metadata",
    "build_target_verify_metadata",
    "draft_expand_page_table",
    "draft_ancestor_slots",
    "draft_expand_tables",
    "draft_positions",
    "draft_tail_copy_slots",
    "tree_mask_from_flat",
    "tree_mask_from_parents",
]
