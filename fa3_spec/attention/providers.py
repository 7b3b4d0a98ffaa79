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


#: Discovery results, filled once, outside any compiled region. A plain dict
#: (not ``lru_cache``): dynamo reads a filled dict as a constant, whereas it
#: traces through ``lru_cache`` into the import, which it cannot trace.
_FOUND: dict = {}


def find_provider() -> Optional[tuple]:
    """``(name, module)`` of the first importable FA3 provider, or None.

    Discovery imports modules, which ``torch.compile`` cannot trace: it runs
    on the first call outside a compiled region and is cached. Called first
    while compiling, it raises a `RuntimeError` that says how to avoid it.
    """
    if "provider" not in _FOUND:
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "fa3_spec looks for its FA3 provider by importing it, which cannot happen "
                "inside torch.compile: call fa3_spec.attention.fa3_available() once before "
                "compiling (or run the step once eagerly), or pass attention_backend='fa3' or 'torch'")
        _FOUND["provider"] = _discover()
    return _FOUND["provider"]


def _discover() -> Optional[tuple]:
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
    """True when CUDA is a Hopper GPU (sm90) and a provider imports.

    Cached per device after its first (eager) call, so that a compiled step
    that resolves ``attention_backend="auto"`` reads a constant."""
    key = ("available", None if device is None else str(device))
    if key not in _FOUND:
        if not torch.cuda.is_available():
            return False
        major, _ = torch.cuda.get_device_capability(device)
        _FOUND[key] = major == 9 and find_provider() is not None
    return _FOUND[key]


def _provider_module():
    """The provider's module; raises if none is found."""
    found = find_provider()
    if found is None:
        raise RuntimeError(
            "no FA3 provider found: install the tokenspeed-fa3 wheel "
            "(pip install 'fa3-spec[fa3]') or a flash-attn Hopper build, or use "
            "attention_backend='torch'"
        )
    return found[1]


def kvcache_forward() -> Callable:
    """The provider's ``flash_attn_with_kvcache``; raises if none is found."""
    return _provider_module().flash_attn_with_kvcache


def provider_plans() -> bool:
    """True when the FA3 provider makes scheduler plans for calls to share
    (``get_scheduler_metadata``; tokenspeed-fa3 does, sgl-kernel's does not).
    A constant once the provider is found, so a compiled step may read it."""
    found = find_provider()
    return found is not None and hasattr(found[1], "get_scheduler_metadata")


def scheduler_planner() -> Callable:
    """The provider's ``get_scheduler_metadata`` (FA3's scheduler plan);
    raises, naming the provider, if it has none."""
    module = _provider_module()
    if not hasattr(module, "get_scheduler_metadata"):
        raise NotImplementedError(
            f"the FA3 provider {_provider_label()} has no get_scheduler_metadata: call "
            "cascade_attention without plans (check fa3_spec.attention.provider_plans())")
    return module.get_scheduler_metadata


# --- What a provider supports --------------------------------------------------
#
# FA3 builds differ in the per-layer arguments they compile in: the
# tokenspeed-fa3 wheel is built without tanh softcapping and refuses it with a
# host-side error, other builds may lack FP8. fa3_spec asks *before* calling
# the kernel, in Python, so an unsupported argument is a clear error at trace
# (or call) time, never a kernel assert, and never a probe inside a graph.

#: Per-layer features fa3_spec may ask a provider about.
FEATURES = ("softcap", "fp8_kv")

#: Support of known builds, by the distribution that ships the module, as
#: recorded by the GPU tests (compile_tests/GPU_RESULTS.md): tokenspeed-fa3
#: refuses softcap and accepts FP8 KV with ``[B, H_kv]`` descales. A build not
#: listed here is probed once.
KNOWN_FEATURES = {
    "tokenspeed-fa3": frozenset({"fp8_kv"}),
}


@functools.lru_cache(maxsize=None)
def provider_distribution() -> Optional[str]:
    """The installed distribution that ships the provider's module (None if unknown)."""
    found = find_provider()
    if found is None:
        return None
    from importlib import metadata

    top = found[1].__name__.split(".")[0]
    dists = metadata.packages_distributions().get(top, [])
    return dists[0] if dists else None


def _probe(feature: str) -> bool:
    """Run a one-query FA3 call that uses ``feature``; True if the build accepts it."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"fa3_spec must probe the FA3 provider ({provider_version()}) for {feature!r}, "
            "which cannot run inside CUDA-graph capture: call "
            "fa3_spec.attention.provider_features() once before capturing"
        )
    dev = torch.device("cuda")
    dtype = torch.float8_e4m3fn if feature == "fp8_kv" else torch.bfloat16
    # Head dim 128, single-token pages: the shape of a tree-verify expand call.
    q = torch.zeros(1, 1, 1, 128, device=dev).to(dtype)  # [batch, seqlen_q, H, D]
    kv = torch.zeros(1, 1, 1, 128, device=dev).to(dtype)
    kw = dict(cache_seqlens=torch.ones(1, dtype=torch.int32, device=dev),
              page_table=torch.zeros(1, 1, dtype=torch.int32, device=dev))
    if feature == "softcap":
        kw["softcap"] = 30.0
    try:
        kvcache_forward()(q, kv, kv, **kw)
        torch.cuda.synchronize()
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False
    return True


@functools.lru_cache(maxsize=None)
def provider_features() -> frozenset:
    """The `FEATURES` the FA3 provider in use supports (empty if there is none).

    From `KNOWN_FEATURES` for a known build, otherwise probed once with tiny
    calls on the GPU and cached. A probe cannot run inside CUDA-graph capture:
    on an unknown build, call this once before capturing (a compiled step
    traced outside capture has already done so).
    """
    if find_provider() is None or not torch.cuda.is_available():
        return frozenset()
    known = KNOWN_FEATURES.get(provider_distribution())
    if known is not None:
        return known
    return frozenset(f for f in FEATURES if _probe(f))


@torch.compiler.assume_constant_result
def provider_supports(feature: str) -> bool:
    """Whether the FA3 provider supports ``feature`` (one of `FEATURES`).

    A constant to ``torch.compile``: evaluated in Python when the step is
    traced, and never part of the graph.
    """
    if feature not in FEATURES:
        raise ValueError(f"unknown FA3 feature {feature!r}; known: {FEATURES}")
    return feature in provider_features()


@torch.compiler.assume_constant_result
def _provider_label() -> str:
    return provider_version()


def require(feature: str, what: str) -> None:
    """Raise NotImplementedError naming the provider when it lacks ``feature``.

    Under ``torch.compile(fullgraph=True)`` the error surfaces wrapped in
    dynamo's ``Unsupported`` ("Observed exception"), whose text carries this
    message; without fullgraph it propagates as is.
    """
    if provider_supports(feature):
        return
    label = _provider_label()
    if label == "none":
        raise NotImplementedError(
            f"{what} needs an FA3 provider with {feature!r} on a CUDA GPU, and none is "
            "available here; use attention_backend='torch'"
        )
    raise NotImplementedError(
        f"{what} is not supported by the FA3 provider {label} "
        f"(this build lacks {feature!r}); use attention_backend='torch' for this layer"
    )
