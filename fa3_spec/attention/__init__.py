"""Attention over fa3_spec metadata: the FA3 custom op, a torch reference, the merge.

Importing this package registers the custom ops, with their fakes:
``fa3_spec::fa3_paged_attention``, ``fa3_spec::fa3_scheduler_plan``,
``fa3_spec::expand_attention`` and ``fa3_spec::store_kv``.
"""

from .cascade import (ATTENTION_BACKENDS, attention_call, cascade_attention,
                      fa3_equivalent_key_bound,
                      fa3_plans, resolve_attention_backend)
from .expand_attention import (EXPAND_KERNELS, MAX_EXPAND_KEYS, expand_attention,
                               expand_attention_triton, expand_call_applies, expand_kernel,
                               expand_kernel_applies, expand_key_bound, select_expand_kernel)
from .fa3_op import default_num_splits, fa3_paged_attention, fa3_scheduler_plan, plan_entries
from .kv_store import (STORE_KV_IMPLS, fused_store_applies, fused_store_available, store_kv,
                       store_kv_fused, store_kv_index_copy)
from .merge import add_attention_sink, merge_attention_states
from .providers import (
    FEATURES, fa3_available, find_provider, provider_features, provider_plans, provider_supports,
    provider_version,
)
from .reference import paged_attention_reference, visible_keys

__all__ = [
    "ATTENTION_BACKENDS",
    "EXPAND_KERNELS",
    "FEATURES",
    "MAX_EXPAND_KEYS",
    "STORE_KV_IMPLS",
    "add_attention_sink",
    "attention_call",
    "cascade_attention",
    "default_num_splits",
    "expand_attention",
    "expand_attention_triton",
    "expand_call_applies",
    "expand_kernel",
    "expand_kernel_applies",
    "expand_key_bound",
    "fa3_available",
    "fa3_equivalent_key_bound",
    "fa3_paged_attention",
    "fa3_plans",
    "fa3_scheduler_plan",
    "fused_store_applies",
    "fused_store_available",
    "find_provider",
    "merge_attention_states",
    "paged_attention_reference",
    "plan_entries",
    "provider_features",
    "provider_plans",
    "provider_supports",
    "provider_version",
    "resolve_attention_backend",
    "select_expand_kernel",
    "store_kv",
    "store_kv_fused",
    "store_kv_index_copy",
    "visible_keys",
]
