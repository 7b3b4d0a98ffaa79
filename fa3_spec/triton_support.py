"""What the library's Triton kernels share: whether Triton imports, the
device guard a launch needs, the environment switch that picks an op's
CUDA implementation at import, and whether a launch uses programmatic
dependent launch (`pdl_launch`).
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


PDL_MODES = ("on", "off")


def pdl_launch(t: torch.Tensor) -> bool:
    """Whether a Triton launch on ``t``'s device uses programmatic dependent
    launch (PDL): CUDA of compute capability 9 or more (Hopper), a Triton
    with ``gdc_wait``, and ``FA3_SPEC_PDL`` not ``off`` (read at import).

    With PDL the GPU may start a kernel while the one before it in the
    stream is still finishing, so its launch overlaps that kernel's end.
    Every library kernel launched this way calls ``gdc_wait()`` before its
    first load or store, which waits for the previous kernel to complete
    and its writes to be visible: the stream's order is kept, for the
    kernels before it whatever they are. It then calls
    ``gdc_launch_dependents()``, so the next kernel may start launching in
    turn. Measured on the H200 in a one-off probe of a decode-shaped chain
    of 9 kernels per layer x 32 layers in one CUDA graph: 3.63 ms with PDL
    against 3.76 ms without (``benchmarks/RESULTS.md``). CUDA graphs keep
    it (stream capture records the launch attribute).
    """
    return _PDL_ON and t.device.type == "cuda" and _pdl_device(t.device.index) and _pdl_triton()


_PDL_ON = impl_from_env("FA3_SPEC_PDL", PDL_MODES, "on") == "on"


@functools.cache
def _pdl_device(index) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.cache
def _pdl_triton() -> bool:
    if not triton_available():
        return False
    try:
        cuda = importlib.import_module("triton.language.extra.cuda")
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


def pdl_kwargs(pdl: bool) -> dict:
    """The launch keywords for `pdl_launch`'s answer (none without PDL, so
    that a Triton without the option is never asked for it)."""
    return {"launch_pdl": True} if pdl else {}
