"""Which CUDA kernel each of the library's ops runs: one dataclass, chosen explicitly.

The defaults are the library's Triton kernels, each falling back by itself
where its layout rules do not hold. `select_kernels` registers the other
implementation of an op as its CUDA kernel, which is what a benchmark's
"other arm" does; it is never read from the environment. Op kernels are
registered per process (``torch.library``), so the choice holds for every
engine of the process, and a CUDA graph keeps the kernels it was captured with.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from ..attention.expand_attention import (DEFAULT_EXPAND_KERNEL, EXPAND_KERNELS, expand_kernel,
                                          select_expand_kernel)
from ..attention.kv_store import STORE_KV_IMPLS, store_kv, store_kv_cuda, store_kv_index_copy
from ..triton_support import set_pdl
from .gemm import GEMM_IMPLS, skinny_mm, skinny_mm_cublas, skinny_mm_cuda
from .rope_kv import ROPE_KV_IMPLS, rope_store_kv, rope_store_kv_cuda, rope_store_kv_split

__all__ = ["Kernels", "parse_kernels", "select_kernels", "selected_kernels"]


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The CUDA implementation of each op.

    Attributes:
        gemm: ``fa3_spec::skinny_mm``: ``"triton"`` (up to 16 rows, cuBLAS
            beyond) or ``"cublas"``.
        store_kv: ``fa3_spec::store_kv``: ``"triton"`` (K and V in one launch)
            or ``"index_copy"``.
        rope_kv: ``fa3_spec::rope_store_kv``: ``"fused"`` (one Triton launch)
            or ``"split"`` (plain torch inside the op).
        expand_attention: a tree's expand calls under FA3: ``"triton"``
            (``fa3_spec::expand_attention``, one small program per row and KV
            head) or ``"fa3"`` (FA3 itself, one CTA per row and KV head set
            up for a key tile of 128 or more).
        pdl: programmatic dependent launch of the library's Triton kernels
            on Hopper (`fa3_spec.triton_support.pdl_launch`).
    """

    gemm: str = "triton"
    store_kv: str = "triton"
    rope_kv: str = "fused"
    expand_attention: str = DEFAULT_EXPAND_KERNEL
    pdl: bool = True

    def __post_init__(self) -> None:
        for name, choices in (("gemm", GEMM_IMPLS), ("store_kv", STORE_KV_IMPLS),
                              ("rope_kv", ROPE_KV_IMPLS),
                              ("expand_attention", EXPAND_KERNELS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        if not isinstance(self.pdl, bool):
            raise TypeError(f"pdl must be a bool, got {self.pdl!r}")


_SELECTED = {"kernels": Kernels()}


def parse_kernels(pairs: Sequence[str]) -> Kernels:
    """`Kernels` from ``NAME=VALUE`` pairs, the defaults for names not given:
    ``["expand_attention=fa3", "pdl=off"]`` (``pdl`` takes ``on`` or
    ``off``). How a command line names them (``fa3-spec eagle --kernels``).

    Raises:
        ValueError: a pair that is not ``NAME=VALUE`` with NAME a field, a
            name given twice, or a value the field refuses (the message
            names it).
    """
    names = [f.name for f in dataclasses.fields(Kernels)]
    choice = {}
    for pair in pairs:
        name, _, value = str(pair).partition("=")
        if name not in names or not value:
            raise ValueError(f"expected NAME=VALUE with NAME one of {', '.join(names)}; "
                             f"got {pair!r}")
        if name in choice:
            raise ValueError(f"{name} given twice")
        if name == "pdl":
            if value not in ("on", "off"):
                raise ValueError(f"pdl must be on or off, got {value!r}")
            value = value == "on"
        choice[name] = value
    return Kernels(**choice)


def select_kernels(kernels: Kernels) -> Kernels:
    """Register ``kernels``' CUDA implementations for this process; returns the
    previous choice (pass it back to restore). Call it before compiling or
    capturing: a compiled graph calls the ops, a captured one replays the
    kernels it recorded."""
    if not isinstance(kernels, Kernels):
        raise TypeError(f"kernels must be a Kernels, got {type(kernels).__name__}")
    skinny_mm.register_kernel("cuda")(
        skinny_mm_cuda if kernels.gemm == "triton" else skinny_mm_cublas)
    store_kv.register_kernel("cuda")(
        store_kv_cuda if kernels.store_kv == "triton" else store_kv_index_copy)
    rope_store_kv.register_kernel("cuda")(
        rope_store_kv_cuda if kernels.rope_kv == "fused" else rope_store_kv_split)
    select_expand_kernel(kernels.expand_attention)
    set_pdl(kernels.pdl)
    previous, _SELECTED["kernels"] = _SELECTED["kernels"], kernels
    return previous


def selected_kernels() -> Kernels:
    """The kernels registered now (`Kernels()` unless `select_kernels` changed
    them). The expand kernel is read where it is kept
    (`fa3_spec.attention.expand_kernel`), which `select_expand_kernel` may
    have set on its own."""
    return dataclasses.replace(_SELECTED["kernels"], expand_attention=expand_kernel())
