"""The model's GEMMs, ``x @ w`` with ``w [in, out]``: a Triton kernel for skinny ``x``.

A decode or draft step at small batch multiplies 1 to 16 rows by weights
that stream from DRAM once, so its GEMMs are bound by read bandwidth, and
cuBLAS's tiles for large M leave some of it unread at these shapes
(``benchmarks/kernels.py`` compares the two on the target's shapes).

`matmul` is what the layers call. On CPU it is plain ``x @ w`` (inductor
and the CPU suite see exactly what they saw before). On CUDA it is the
opaque op `skinny_mm`, whose CUDA kernel decides from the concrete shapes
at run time, never from values:

- ``M <= SKINNY_MAX_M`` rows, a 2-D bf16/fp16 ``x`` with unit column stride,
  a contiguous ``w`` of its dtype on its device, fewer than ``2**31``
  elements in either, and Triton importable: the Triton kernel;
- anything else: ``x @ w`` (cuBLAS).

The kernel tiles ``N`` by ``BLOCK_N`` and ``K`` by ``BLOCK_K`` with one
``BLOCK_M = 16`` row tile (``tl.dot``, fp32 accumulation). Where ``K`` is
much longer than ``N`` (the down projection) it splits ``K`` into
``SPLIT`` slices that write fp32 partials ``[SPLIT, M, N]``, and a second
kernel sums them in a fixed order: no atomics, so results are
deterministic run to run. Loads and stores are masked against ``M``,
``N`` and ``K`` (the unmasked weight load is taken only when the tiles
divide the shapes exactly), so no launch reads or writes outside its
tensors. Tile sizes come from `tile_config`, a rule fitted to a tile sweep
at the target's shapes.

`skinny_mm_cuda` is the op's CUDA kernel; `fa3_spec.eagle.kernels.select_kernels`
registers `skinny_mm_cublas` in its place (a benchmark's other arm).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from ..triton_support import device_guard, pdl_kwargs, pdl_launch, triton_available

#: The implementations `fa3_spec.eagle.kernels.select_kernels` can register for CUDA.
GEMM_IMPLS = ("cublas", "triton")
SKINNY_MAX_M = 16  # the row tile (BLOCK_M): one program row covers every row of x
_INT32_LIMIT = 2 ** 31


class TileConfig(NamedTuple):
    """Tiles of one skinny GEMM: ``block_n`` x ``block_k``, ``split`` K slices."""

    block_n: int
    block_k: int
    split: int


def tile_config(k: int, n: int) -> TileConfig:
    """The tiles for ``[M, k] @ [k, n]``, a rule fitted to a tile sweep at
    llama3-8b's shapes for M = 1-16 (the kernel benchmark has the sweep):

    >>> tile_config(14336, 4096)   # down: K >> N, split K in four
    TileConfig(block_n=128, block_k=64, split=4)
    >>> tile_config(4096, 4096)    # o
    TileConfig(block_n=32, block_k=256, split=1)
    >>> tile_config(4096, 128256)  # lm_head, gate/up: wide N
    TileConfig(block_n=128, block_k=64, split=1)
    """
    if k >= 3 * n:
        cfg = TileConfig(128, 64, 4)
    elif n <= 4096:
        cfg = TileConfig(32, 256, 1)
    elif n <= 8192:
        cfg = TileConfig(64, 256, 1)
    else:
        cfg = TileConfig(128, 64, 1)
    if k < cfg.split * cfg.block_k:  # too short to split: one slice
        cfg = cfg._replace(split=1)
    return cfg


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"skinny_mm: x and w must be 2-D, got x {tuple(x.shape)} and w {tuple(w.shape)}")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"skinny_mm: x [M, K] and w [K, N] disagree on K: x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise TypeError(f"skinny_mm: x and w must share a dtype, got {x.dtype} and {w.dtype}")
    if x.device != w.device:
        raise ValueError(f"skinny_mm: x and w must be on one device, got {x.device} and {w.device}")


@torch.library.custom_op("fa3_spec::skinny_mm", mutates_args=())
def skinny_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ w [K, N] -> [M, N]``; on CUDA the Triton kernel where
    `skinny_applies` (see the module docstring), else ``x @ w``."""
    _check(x, w)
    return x @ w


@skinny_mm.register_fake
def _skinny_mm_fake(x, w):
    _check(x, w)
    return x.new_empty(x.shape[0], w.shape[1])


def _check_config(config: TileConfig) -> None:
    def pow2(v):
        return isinstance(v, int) and v >= 16 and v & (v - 1) == 0

    if not (isinstance(config, tuple) and len(config) == 3 and pow2(config[0]) and pow2(config[1])
            and isinstance(config[2], int) and config[2] >= 1):
        raise ValueError("config must be a TileConfig(block_n, block_k, split) with powers of two "
                         f">= 16 for the blocks and split >= 1, got {config!r}")


def skinny_applies(x: torch.Tensor, w: torch.Tensor, config: Optional[TileConfig] = None) -> bool:
    """Whether the Triton kernel takes ``x @ w`` (shapes, layouts and dtypes
    only, never values), with ``config`` or else `tile_config`'s tiles."""
    if not triton_available():
        return False
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0]:
        return False
    m, k = x.shape
    n = w.shape[1]
    if not (1 <= m <= SKINNY_MAX_M and k > 0 and n > 0):
        return False
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16) or x.device != w.device:
        return False
    if not w.is_contiguous() or (k > 1 and x.stride(1) != 1):
        return False
    # int32 offsets inside the kernels: every element index below 2**31.
    split = (config or tile_config(k, n)).split
    return max(k * n, m * x.stride(0) + k, split * m * n) < _INT32_LIMIT


@functools.cache
def _kernels():
    """The two Triton kernels, built at first use (``(triton, mm, reduce)``)."""
    import triton
    import triton.language as tl

    @triton.jit
    def skinny_mm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, k_per_split,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PARTIAL: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr):
        # Program (n, 0, s): columns [n*BN, n*BN + BN) of K slice s.
        if PDL:  # wait for the previous kernel before any load or store (pdl_launch)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(2)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk0 = tl.arange(0, BLOCK_K)
        k_start = pid_s * k_per_split
        m_ok = rm[:, None] < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in tl.range(0, k_per_split, BLOCK_K):
            rk = k_start + kk + rk0
            if EVEN:  # the tiles divide N and K exactly: every weight load is in range
                w = tl.load(w_ptr + rk[:, None] * N + rn[None, :])
            else:
                w = tl.load(w_ptr + rk[:, None] * N + rn[None, :],
                            mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                        mask=m_ok & (rk[None, :] < K), other=0.0)
            acc += tl.dot(x, w)
        mask = m_ok & (rn[None, :] < N)
        if PARTIAL:
            tl.store(out_ptr + pid_s * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)
        else:
            tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def sum_partials_kernel(part_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                            PDL: tl.constexpr):
        if PDL:  # wait for the previous kernel before any load or store (pdl_launch)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = r < MN
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):  # a fixed order: deterministic
            acc += tl.load(part_ptr + s * MN + r, mask=ok, other=0.0)
        tl.store(out_ptr + r, acc.to(out_ptr.dtype.element_ty), mask=ok)

    return triton, skinny_mm_kernel, sum_partials_kernel


def skinny_mm_triton(x: torch.Tensor, w: torch.Tensor,
                     config: Optional[TileConfig] = None) -> torch.Tensor:
    """``x @ w`` by the Triton kernel, with ``config``'s tiles or else
    `tile_config`'s (``benchmarks/kernel_bench.py gemm`` sweeps them); the tensors
    must pass `skinny_applies` (``TypeError`` otherwise). Runs wherever
    Triton does."""
    if config is not None:
        _check_config(config)
        config = TileConfig(*config)
    if not skinny_applies(x, w, config):
        raise TypeError("skinny_mm_triton: x and w do not fit the kernel (see skinny_applies): "
                        f"x {tuple(x.shape)} {x.dtype} stride {x.stride()}, w {tuple(w.shape)} {w.dtype}")
    return _launch(x, w, config)


def _launch(x: torch.Tensor, w: torch.Tensor,
            config: Optional[TileConfig] = None) -> torch.Tensor:
    triton, mm_kernel, sum_kernel = _kernels()
    m, k = x.shape
    n = w.shape[1]
    cfg = config or tile_config(k, n)
    k_per_split = triton.cdiv(k, cfg.split * cfg.block_k) * cfg.block_k
    even = n % cfg.block_n == 0 and k % (cfg.split * cfg.block_k) == 0
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    partial = cfg.split > 1
    dst = torch.empty(cfg.split, m, n, device=x.device, dtype=torch.float32) if partial else out
    pdl = pdl_launch(x)
    with device_guard(x):
        mm_kernel[(triton.cdiv(n, cfg.block_n), 1, cfg.split)](
            x, w, dst, m, n, k, x.stride(0), k_per_split,
            BLOCK_M=SKINNY_MAX_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            PARTIAL=partial, EVEN=even, PDL=pdl, num_warps=4, num_stages=4, **pdl_kwargs(pdl))
        if partial:
            sum_kernel[(triton.cdiv(m * n, 1024),)](dst, out, m * n, SPLIT=cfg.split, BLOCK=1024,
                                                    PDL=pdl, num_warps=4, **pdl_kwargs(pdl))
    return out


def skinny_mm_cuda(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The op's CUDA kernel: the Triton kernel where it applies, else cuBLAS."""
    _check(x, w)
    config = tile_config(x.shape[1], w.shape[1])  # once: the check and the launch share it
    if skinny_applies(x, w, config):
        return _launch(x, w, config)
    return x @ w


def skinny_mm_cublas(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The op's other CUDA kernel: cuBLAS at every row count."""
    _check(x, w)
    return x @ w


skinny_mm.register_kernel("cuda")(skinny_mm_cuda)


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ w [K, N] -> [..., N]``, what the model's layers call.

    CPU: ``x @ w``. CUDA: the op `skinny_mm` on ``x`` flattened to 2-D
    (the Triton kernel for at most `SKINNY_MAX_M` rows, cuBLAS beyond).
    The branch is on the device, never on a value, so a compiled frame has
    one op whatever its (symbolic) row count.
    """
    if x.device.type != "cuda":
        return x @ w
    if x.dim() == 2:  # no reshape: its layout check would guard a symbolic row count
        return skinny_mm(x, w)
    return skinny_mm(x.flatten(0, -2), w).view(*x.shape[:-1], w.shape[-1])
