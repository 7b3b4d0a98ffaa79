"""The EAGLE reference loop: fa3_spec metadata in motion.

A Llama-style target and an EAGLE draft head (`models`), a paged KV pool
(`pool`), one speculative iteration that runs entirely on the device
(`iteration`), a host driver with admission, finishes, joins, CUDA graphs per
batch bucket and asynchronous readback (`engine`), and the ``fa3-spec eagle``
command (`cli`). Exactness contract: with greedy acceptance the output equals
plain greedy decoding of the target (`greedy_generate`), token for token.
"""

from .engine import EagleEngine, greedy_generate
from .iteration import DEFAULT_SCRIPT, LoopConfig, eagle_iteration, empty_state, step_in_place
from .models import (
    PRESETS, EagleDraft, EagleModels, KVCache, LlamaTarget, ModelShape, SpecModel, make_models,
)
from ..builders import draft_positions
from .pool import KVPool

__all__ = [
    "DEFAULT_SCRIPT", "EagleDraft", "EagleEngine", "EagleModels", "KVCache", "KVPool",
    "LlamaTarget", "LoopConfig", "ModelShape", "PRESETS", "SpecModel", "draft_positions",
    "eagle_iteration", "empty_state", "greedy_generate", "make_models", "step_in_place",
]
