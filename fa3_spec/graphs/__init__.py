"""Compiling and capturing steps: the runner, its compile policy, the compile caches.

* `runner`: `CUDAGraphRunner` (one captured step per batch bucket, padding
  rows by construction), `capture` (one call captured), `check_buckets`;
* `policy`: `CompilePolicy` (compile backend, graphs, dynamic batch,
  regions, inductor options: resolved once), `compile_fullgraph`,
  `with_own_code`;
* `cache`: `save_compile_cache` / `load_compile_cache` for a fast restart.
"""

from .cache import load_compile_cache, save_compile_cache
from .policy import (COMPILE_BACKENDS, INDUCTOR_OPTIONS, CompilePolicy, compile_fullgraph,
                     with_own_code)
from .runner import CopyGroup, CUDAGraphRunner, LivePlan, Route, capture, check_buckets

__all__ = [
    "COMPILE_BACKENDS", "INDUCTOR_OPTIONS", "CUDAGraphRunner", "CompilePolicy", "CopyGroup",
    "LivePlan", "Route", "capture", "check_buckets", "compile_fullgraph", "load_compile_cache",
    "save_compile_cache", "with_own_code",
]
