"""RMSNorm and SwiGLU, each fused into the GEMM that reads its output.

A Llama layer at decode time runs two RMSNorms and one SwiGLU between its
GEMMs. Compiled, each is one small kernel of its own, plus the gap before the
GEMM that waits for it: at batch 1 on the H200 about 0.3 ms of a 4.5 ms
decode step (``benchmarks/RESULTS.md``). Both fold into the skinny GEMM of
`fa3_spec.eagle.gemm`:

- RMSNorm is a scale per row, ``rms_norm(s) @ w = (s * gain) @ w / rms(s)``:
  the kernel multiplies its ``x`` tiles by ``gain``, sums the row's squares
  beside the dot and scales the fp32 result at the end. The residual adds in
  front of the norm (``s = x + deltas``) happen on the tiles too, and the
  sum, which the residual stream needs, is written once.
- SwiGLU is elementwise: the kernel reads ``[gate | up]`` tiles and dots
  ``silu(gate) * up``.

`rms_norm_matmul` and `swiglu_matmul` are what the layers call. On CPU, and
with ``FA3_SPEC_GEMM=cublas``, they are the plain compositions (`rms_norm`,
`swiglu`, `fa3_spec.eagle.gemm.matmul`), so inductor sees what it saw
before. On CUDA they are the opaque ops ``fa3_spec::rms_norm_mm`` and
``fa3_spec::swiglu_mm``, whose CUDA kernels decide from shapes at run time:
the fused Triton kernel where `fa3_spec.eagle.gemm.prologue_applies` (at most
`SKINNY_MAX_M` rows), else one Triton row kernel for the norm or the
activation (as inductor's would be) and cuBLAS for the GEMM.

The fused kernel rounds differently from the composition: the norm's
``1 / rms`` multiplies the fp32 accumulator instead of the rounded input, and
``silu(gate) * up`` rounds once. Both are as accurate; they are not bit for
bit alike (``compile_tests/test_gpu_gemm.py`` bounds them against fp32).

Example (what `fa3_spec.eagle.layer.layer_body` does)::

    x_in, qkv = rms_norm_matmul(x, w.attn_norm, w.wqkv, eps, deltas=deltas, return_sum=True)
    ...
    gate_up = rms_norm_matmul(x_in, w.mlp_norm, w.w_gate_up, eps, deltas=[attn_out])
    mlp_out = swiglu_matmul(gate_up, w.w_down)
"""

from __future__ import annotations

import functools
from typing import List, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .gemm import (GEMM_IMPL, RMS_NORM, SWIGLU, device_guard, launch, matmul, prologue_applies,
                   triton_available)

#: The longest row the fallback row kernels take in one block (else plain torch).
_ROW_MAX = 1 << 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm of ``x [..., H]`` with ``weight [H]``: normalised in
    (at least) fp32, rounded to ``x``'s dtype, then scaled by ``weight``."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [..., 2I]`` (gate columns first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _residual_sum(x: torch.Tensor, deltas: Sequence[torch.Tensor]) -> torch.Tensor:
    for d in deltas:  # left to right, as the layers always add them
        x = x + d
    return x


# ------------------------------------------------------------------ checks
def _check_norm(x, deltas, gain, w, return_sum):
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"rms_norm_mm: x and w must be 2-D, got x {tuple(x.shape)} and "
                         f"w {tuple(w.shape)}")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"rms_norm_mm: x [M, K] and w [K, N] disagree on K: x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}")
    if len(deltas) > 2:
        raise ValueError(f"rms_norm_mm: at most 2 deltas, got {len(deltas)}")
    for i, d in enumerate(deltas):
        if d.shape != x.shape:
            raise ValueError(f"rms_norm_mm: deltas[{i}] must have x's shape {tuple(x.shape)}, "
                             f"got {tuple(d.shape)}")
    if gain.shape != (x.shape[1],):
        raise ValueError(f"rms_norm_mm: gain must be [K] = [{x.shape[1]}], got {tuple(gain.shape)}")
    if return_sum and not deltas:
        raise ValueError("rms_norm_mm: return_sum needs deltas (without them the sum is x)")
    for name, t in [("w", w), ("gain", gain)] + [(f"deltas[{i}]", d) for i, d in enumerate(deltas)]:
        if t.dtype != x.dtype:
            raise TypeError(f"rms_norm_mm: {name} must have x's dtype {x.dtype}, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"rms_norm_mm: {name} must be on x's device {x.device}, "
                             f"got {t.device}")


def _check_swiglu(x, w):
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"swiglu_mm: gate_up and w must be 2-D, got gate_up {tuple(x.shape)} "
                         f"and w {tuple(w.shape)}")
    if x.shape[1] != 2 * w.shape[0]:
        raise ValueError(f"swiglu_mm: gate_up [M, 2I] and w [I, N] disagree on I: gate_up "
                         f"{tuple(x.shape)}, w {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise TypeError(f"swiglu_mm: gate_up and w must share a dtype, got {x.dtype} and {w.dtype}")
    if x.device != w.device:
        raise ValueError(f"swiglu_mm: gate_up and w must be on one device, got {x.device} and "
                         f"{w.device}")


# ------------------------------------------------------------------ ops
@torch.library.custom_op("fa3_spec::rms_norm_mm", mutates_args=())
def rms_norm_mm(x: torch.Tensor, deltas: List[torch.Tensor], gain: torch.Tensor,
                w: torch.Tensor, eps: float, return_sum: bool) -> List[torch.Tensor]:
    """``s = x + deltas`` (left to right; ``x, deltas [M, K]``, at most two),
    ``[rms_norm(s, gain, eps) @ w]`` (``w [K, N]``), then ``s`` if
    ``return_sum``. On CUDA the fused kernel where it applies (see the module
    docstring); here the composition."""
    _check_norm(x, deltas, gain, w, return_sum)
    s = _residual_sum(x, deltas)
    out = rms_norm(s, gain, eps) @ w
    return [out, s] if return_sum else [out]


@rms_norm_mm.register_fake
def _rms_norm_mm_fake(x, deltas, gain, w, eps, return_sum):
    _check_norm(x, deltas, gain, w, return_sum)
    out = x.new_empty(x.shape[0], w.shape[1])
    return [out, x.new_empty(x.shape)] if return_sum else [out]


@torch.library.custom_op("fa3_spec::swiglu_mm", mutates_args=())
def swiglu_mm(gate_up: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``swiglu(gate_up [M, 2I]) @ w [I, N] -> [M, N]``. On CUDA the fused
    kernel where it applies (see the module docstring); here the composition."""
    _check_swiglu(gate_up, w)
    return swiglu(gate_up) @ w


@swiglu_mm.register_fake
def _swiglu_mm_fake(gate_up, w):
    _check_swiglu(gate_up, w)
    return gate_up.new_empty(gate_up.shape[0], w.shape[1])


# ------------------------------------------------------------------ CUDA
@functools.cache
def _row_kernels():
    """Triton row kernels for what the fused kernel does not take (more than
    `SKINNY_MAX_M` rows): the norm or the activation alone, as one kernel."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(x_ptr, d1_ptr, d2_ptr, g_ptr, h_ptr, sum_ptr, K,
                            stride_x, stride_d1, stride_d2, eps, NUM_DELTAS: tl.constexpr,
                            STORE_SUM: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        rk = tl.arange(0, BLOCK)
        ok = rk < K
        dtype = h_ptr.dtype.element_ty
        s = tl.load(x_ptr + row * stride_x + rk, mask=ok, other=0.0).to(tl.float32)
        if NUM_DELTAS > 0:
            s += tl.load(d1_ptr + row * stride_d1 + rk, mask=ok, other=0.0).to(tl.float32)
            if NUM_DELTAS > 1:
                s += tl.load(d2_ptr + row * stride_d2 + rk, mask=ok, other=0.0).to(tl.float32)
            s = s.to(dtype).to(tl.float32)
            if STORE_SUM:
                tl.store(sum_ptr + row * K + rk, s.to(dtype), mask=ok)
        rstd = tl.rsqrt(tl.sum(s * s, axis=0) / K + eps)
        gain = tl.load(g_ptr + rk, mask=ok, other=0.0).to(tl.float32)
        h = (s * rstd).to(dtype).to(tl.float32) * gain
        tl.store(h_ptr + row * K + rk, h.to(dtype), mask=ok)

    @triton.jit
    def swiglu_kernel(x_ptr, out_ptr, I, stride_x, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < I
        gate = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + I + c, mask=ok, other=0.0).to(tl.float32)
        act = gate * tl.sigmoid(gate) * up
        tl.store(out_ptr + row * I + c, act.to(out_ptr.dtype.element_ty), mask=ok)

    return triton, add_rms_norm_kernel, swiglu_kernel


def _rows_fit(x: torch.Tensor, others: Sequence[torch.Tensor]) -> bool:
    return (triton_available() and x.dtype in (torch.bfloat16, torch.float16)
            and x.shape[0] > 0 and 0 < x.shape[1] <= _ROW_MAX
            and all(t.stride(-1) == 1 for t in (x, *others)))


def _add_rms_norm_rows(x, deltas, gain, eps, return_sum):
    """``(rms_norm(s, gain, eps), s or None)``, one Triton launch where it fits."""
    if not (_rows_fit(x, deltas) and gain.is_contiguous()):
        s = _residual_sum(x, deltas)
        return rms_norm(s, gain, eps), (s if return_sum else None)
    triton, norm_kernel, _ = _row_kernels()
    m, k = x.shape
    h = torch.empty(m, k, device=x.device, dtype=x.dtype)
    s = torch.empty(m, k, device=x.device, dtype=x.dtype) if return_sum else h
    d1, d2 = (tuple(deltas) + (x, x))[:2]
    with device_guard(x):
        norm_kernel[(m,)](x, d1, d2, gain, h, s, k, x.stride(0), d1.stride(0), d2.stride(0),
                          float(eps), NUM_DELTAS=len(deltas), STORE_SUM=return_sum,
                          BLOCK=triton.next_power_of_2(k), num_warps=8)
    return h, (s if return_sum else None)


def _swiglu_rows(gate_up):
    if not _rows_fit(gate_up, ()):
        return swiglu(gate_up)
    triton, _, act_kernel = _row_kernels()
    m, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(m, i, device=gate_up.device, dtype=gate_up.dtype)
    with device_guard(gate_up):
        act_kernel[(m, triton.cdiv(i, 1024))](gate_up, out, i, gate_up.stride(0), BLOCK=1024,
                                              num_warps=4)
    return out


if GEMM_IMPL == "triton":

    @rms_norm_mm.register_kernel("cuda")
    def _rms_norm_mm_cuda(x, deltas, gain, w, eps, return_sum):
        _check_norm(x, deltas, gain, w, return_sum)
        if prologue_applies(x, w, prologue=RMS_NORM, deltas=deltas, gain=gain):
            got = launch(x, w, prologue=RMS_NORM, deltas=deltas, gain=gain, eps=eps,
                         store_sum=return_sum)
            return list(got) if return_sum else [got]
        h, s = _add_rms_norm_rows(x, deltas, gain, eps, return_sum)
        return [h @ w, s] if return_sum else [h @ w]

    @swiglu_mm.register_kernel("cuda")
    def _swiglu_mm_cuda(gate_up, w):
        _check_swiglu(gate_up, w)
        if prologue_applies(gate_up, w, prologue=SWIGLU):
            return launch(gate_up, w, prologue=SWIGLU)
        return _swiglu_rows(gate_up) @ w


# ------------------------------------------------------------------ what the layers call
def _fused(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and GEMM_IMPL == "triton"


def _flat(t: torch.Tensor) -> torch.Tensor:
    # A 2-D tensor passes as is: a reshape's layout check would guard a symbolic row count.
    return t if t.dim() == 2 else t.flatten(0, -2)


def rms_norm_matmul(x: torch.Tensor, gain: torch.Tensor, w: torch.Tensor, eps: float, *,
                    deltas: Sequence[torch.Tensor] = (), return_sum: bool = False
                    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """``rms_norm(s, gain, eps) @ w`` with ``s = x + deltas[0] + ...`` (left to
    right), ``x`` and each delta ``[..., K]``, ``gain [K]``, ``w [K, N]``:
    ``[..., N]``; with ``return_sum``, ``(s, out)`` (``s`` is ``x`` itself when
    there are no deltas). At most two deltas. One fused kernel on CUDA for
    up to `SKINNY_MAX_M` rows (see the module docstring)."""
    deltas = tuple(deltas)
    if not _fused(x):
        s = _residual_sum(x, deltas)
        out = matmul(rms_norm(s, gain, eps), w)
        return (s, out) if return_sum else out
    lead = x.shape[:-1]
    got = rms_norm_mm(_flat(x), [_flat(d) for d in deltas], gain, w, eps,
                      return_sum and bool(deltas))
    out = got[0] if x.dim() == 2 else got[0].view(*lead, w.shape[1])
    if not return_sum:
        return out
    s = (got[1] if x.dim() == 2 else got[1].view(x.shape)) if deltas else x
    return s, out


def swiglu_matmul(gate_up: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``(silu(gate) * up) @ w`` for ``gate_up [..., 2I]`` (gate columns first)
    and ``w [I, N]``: ``[..., N]``. One fused kernel on CUDA for up to
    `SKINNY_MAX_M` rows (see the module docstring)."""
    if not _fused(gate_up):
        return matmul(swiglu(gate_up), w)
    out = swiglu_mm(_flat(gate_up), w)
    return out if gate_up.dim() == 2 else out.view(*gate_up.shape[:-1], w.shape[1])
