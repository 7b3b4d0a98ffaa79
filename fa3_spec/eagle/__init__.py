"""The EAGLE reference loop: fa3_spec metadata in motion.

A Llama-style target and an EAGLE draft head (`models`; loaded from local
Hugging Face checkpoints by `from_pretrained`, `checkpoint`), a paged KV pool
(`pool`), one speculative iteration that runs entirely on the device
(`iteration`), a host driver with admission, finishes, joins, CUDA graphs per
batch bucket and asynchronous readback (`engine`), its running statistics
(`stats`), and the ``fa3-spec eagle``
command (`cli`). Exactness contract: with greedy acceptance the output equals
plain greedy decoding of the target (`greedy_generate`), token for token.
Sampled requests (`sampling`) follow the target's sampling law exactly.
"""

from .checkpoint import CheckpointError, from_pretrained
from .engine import EagleEngine, RequestResult
from .greedy import greedy_generate
from .iteration import DEFAULT_SCRIPT, LoopConfig, eagle_iteration, empty_state, step_in_place
from .models import (
    PRESETS, Eagle3Draft, EagleDraft, EagleModels, KVCache, LlamaTarget, ModelShape, SpecModel,
    make_models,
)
from ..builders import draft_positions
from .pool import KVPool
from .stats import EngineStats

__all__ = [
    "CheckpointError", "DEFAULT_SCRIPT", "Eagle3Draft", "EagleDraft", "EagleEngine",
    "EagleModels", "EngineStats", "KVCache", "KVPool", "LlamaTarget", "LoopConfig", "ModelShape",
    "PRESETS", "RequestResult", "SpecModel", "draft_positions", "eagle_iteration", "empty_state", "from_pretrained",
    "greedy_generate", "make_models", "step_in_place",
]
