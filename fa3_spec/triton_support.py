"""What the library's Triton kernels share: whether Triton imports, the
device guard a launch needs, and the environment switch that picks an op's
CUDA implementation at import.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from typing import Sequence

import torch


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports. Asked once per process, at the first launch
    that needs it (or a direct call): that is when Triton is first imported,
    never at ``import fa3_spec`` (a process that wants Triton's CPU
    interpreter must import it first)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # an install that does not import is no Triton
        return False
    return True


def device_guard(t: torch.Tensor):
    """``t``'s CUDA device as the current one: a custom op gets no device
    guard, and Triton launches on the current device. A no-op off CUDA (the
    interpreter)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def impl_from_env(variable: str, choices: Sequence[str], default: str) -> str:
    """``os.environ[variable]`` (``default`` when unset), which must be one of
    ``choices`` (``ValueError`` naming the variable otherwise)."""
    impl = os.environ.get(variable, default)
    if impl not in choices:
        raise ValueError(f"{variable} must be one of {tuple(choices)}, got {impl!r}")
    return impl
