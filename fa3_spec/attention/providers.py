"""Lazy discovery of an FA3 implementation.

Importing fa3_spec never imports FA3: a CPU machine has none. The first FA3
call looks, in order, for

* ``flash_attn_interface`` — the ``tokenspeed-fa3`` wheel or a flash-attn
  Hopper build (``flash_attn_with_kvcache``, op namespace ``flash_attn_3``);
* ``sgl_kernel.flash_attn`` — sglang's build of the same kernels.

Each provider is normalised to one callable taking the metadata fields and
returning ``(out [total_q, H, Dv], lse [H, total_q] float32)``.
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable, Optional

import torch

_CANDIDATES = (
    ("flash_attn_interface", "flash_attn_interface"),
    ("sgl_kernel", "sgl_kernel.flash_attn"),
)


@functools.lru_cache(maxsize=None)
def find_provider() -> Optional[tuple]:
    """``(name, module)`` of the first importable FA3 provider, or None."""
    for name, module in _CANDIDATES:
        try:
            mod = importlib.import_module(module)
        except Exception:  # ImportError, or a broken build raising on load
            continue
        if hasattr(mod, "flash_attn_with_kvcache"):
            return name, mod
    return None


def provider_version() -> str:
    """A printable ``name version`` of the provider in use ('none' if absent)."""
    found = find_provider()
    if found is None:
        return "none"
    name, mod = found
    from importlib import metadata

    for dist in ("tokenspeed-fa3", "flash-attn-3", "flash_attn_3", "flash-attn", "sgl-kernel"):
        try:
            return f"{name} ({dist} {metadata.version(dist)})"
        except metadata.PackageNotFoundError:
            continue
    return name


def fa3_available(device: Optional[torch.device] = None) -> bool:
    """True when CUDA is a Hopper GPU (sm90) and a provider imports."""
    if not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major == 9 and find_provider() is not None


def kvcache_forward() -> Callable:
    """The provider's ``flash_attn_with_kvcache``; raises if none is found."""
    found = find_provider()
    if found is None:
        raise RuntimeError(
            "no FA3 provider found: install the tokenspeed-fa3 wheel "
            "(pip install 'fa3-spec[fa3]') or a flash-attn Hopper build, or use "
            "backend='torch'"
        )
    return found[1].flash_attn_with_kvcache
