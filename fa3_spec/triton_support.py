"""What the library's Triton kernels share: whether Triton imports, the
device guard a launch needs, and whether a launch uses programmatic
dependent launch (`pdl_launch`, `set_pdl`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
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


_PDL = {"enabled": True}


def set_pdl(enabled: bool) -> bool:
    """Turn programmatic dependent launch of the library's kernels on or off
    for this process (`fa3_spec.eagle.kernels.select_kernels` calls it);
    returns the previous setting. Launches read it, so a CUDA graph keeps
    the setting it was captured with."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    previous, _PDL["enabled"] = _PDL["enabled"], enabled
    return previous


def pdl_launch(t: torch.Tensor) -> bool:
    """Whether a Triton launch on ``t``'s device uses programmatic dependent
    launch (PDL): CUDA of compute capability 9 or more (Hopper), a Triton
    with ``gdc_wait``, PDL not turned off (`set_pdl`), and
    inductor's own PDL off (``torch._inductor.config.triton.enable_pdl``,
    read at each launch; see below).

    With PDL the GPU may start a kernel while the one before it in the
    stream is still finishing, so its launch overlaps that kernel's end.
    Every library kernel launched this way calls ``gdc_wait()`` before its
    first load or store, which waits for the previous kernel to complete and
    its writes to be visible, so whatever ran before it is ordered. It then
    calls ``gdc_launch_dependents()``, so that the next kernel may start
    launching while this one runs. That is safe for the kernels that follow
    when each of them either is not PDL-launched (cuBLAS, FA3's main and
    combine kernels, inductor's kernels without its own PDL) or waits before its
    first access (the library's). Inductor's PDL breaks that rule: a kernel
    that reads nothing the previous node wrote skips ``gdc_wait``, so a
    kernel after it could read this one's output early. Hence the last
    condition.

    The gain is the launch latency of each boundary between two library
    kernels (``benchmarks/kernels.py`` measures it).
    CUDA graphs keep it (stream capture records the launch attribute).
    """
    return (_PDL["enabled"] and t.device.type == "cuda" and not _inductor_pdl()
            and _pdl_device(t.device.index) and _pdl_triton())


def _inductor_pdl() -> bool:
    """Whether inductor generates PDL kernels (never imports inductor: if it
    is not imported, it generates nothing)."""
    config = sys.modules.get("torch._inductor.config")
    return bool(getattr(getattr(config, "triton", None), "enable_pdl", False))


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
