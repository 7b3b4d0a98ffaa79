"""The expand call of a tree cascade as one Triton kernel: ``fa3_spec::expand_attention``.

A tree's expand call (docs/semantics.md, "Target verify" and "Draft
decode") has one row per draft query, one query per row, and lists the
slots of the few draft tokens that query attends, in page size 1. FA3 gives
each (row, KV head) one CTA, which sets up its pipeline for a key tile of
128 or more to read at most ``N`` keys; with ``B * N`` rows that fixed cost
dominates the call (``benchmarks/kernel_bench.py expand`` times both). Here
one small program per (row, KV head) gathers the row's keys and values,
multiplies them by the group's query heads with ``tl.dot`` (fp32
accumulation, probabilities in the input dtype as FA3 does), and writes the
normalised output and its natural-log LSE.

What it reads is the library's read rule for such a call
(`fa3_spec.attention.paged_attention_reference`): keys ``t <
min(cache_seqlens[r], max_seqlen_k)`` at ``page_table[r, min(t, W - 1)]``,
each slot clamped into the cache, so whatever the index tensors hold the
kernel reads and writes inside its tensors. A row with no key gives output
0 and LSE ``-inf``; so do the queries past its first of a row that claims
more than one (``cu_seqlens_q`` says so; the builders never do). Queries
that no row owns are not written, as FA3 leaves them
(`fa3_spec.attention.attention_call` masks them to 0 and ``-inf`` for both).

`cascade_attention` routes an expand call here under ``attention_backend=
"fa3"`` when `expand_call_applies` (static facts of the call: one query per
row, page size 1, no window, softcap or FP8) and `expand_kernel` is
``"triton"``, the default (`DEFAULT_EXPAND_KERNEL`), since a tree's expand
calls are many rows of a few keys each, where FA3's per-CTA setup outweighs
the reads. ``select_expand_kernel("fa3")`` (or `fa3_spec.eagle.select_kernels`
with the other kernels) puts every call on FA3. The op's CUDA kernel takes the Triton path where
`expand_kernel_applies` (layouts and sizes), else calls FA3; its default
(CPU) implementation is the reference.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch

from ..metadata import FA3Metadata
from ..triton_support import device_guard, pdl_kwargs, pdl_launch, triton_available
from .fa3_op import fa3_paged_attention
from .reference import paged_attention_reference

#: The kernels an expand call can run on CUDA (`select_expand_kernel`).
EXPAND_KERNELS = ("fa3", "triton")
#: The most keys a row may attend for the Triton kernel (one key tile).
MAX_EXPAND_KEYS = 128
#: The kernel expand calls run on until `select_expand_kernel` says otherwise
#: (also `fa3_spec.eagle.Kernels`' default).
DEFAULT_EXPAND_KERNEL = "triton"
_SELECTED = {"kernel": DEFAULT_EXPAND_KERNEL}


def expand_key_bound(max_seqlen_k: int) -> int:
    """The key tile the kernel reads for a call bounded by ``max_seqlen_k``
    keys: the next power of two, at least 16 (``tl.dot``'s least). Calls
    whose bounds give one tile run one compiled kernel, and a compiled
    region may pass this bound instead of the call's own
    (`fa3_spec.eagle.regions`): the keys read are those below
    ``cache_seqlens``, which the builders keep below the call's bound."""
    return max(16, 1 << max(0, int(max_seqlen_k) - 1).bit_length())


def select_expand_kernel(kernel: str) -> str:
    """Run expand calls on ``kernel`` (one of `EXPAND_KERNELS`) from now on in
    this process; returns the previous choice. Read when a step is traced or
    run eagerly: call it before compiling or capturing."""
    if kernel not in EXPAND_KERNELS:
        raise ValueError(f"kernel must be one of {EXPAND_KERNELS}, got {kernel!r}")
    previous, _SELECTED["kernel"] = _SELECTED["kernel"], kernel
    return previous


def expand_kernel() -> str:
    """The kernel expand calls run on now (`select_expand_kernel`)."""
    return _SELECTED["kernel"]


def _one_query_per_slot(md: FA3Metadata) -> bool:
    """The metadata half of an expand call: one query per row in page size 1, no window."""
    return md.max_seqlen_q == 1 and md.page_size == 1 and md.window_left == -1


def expand_call_applies(md: FA3Metadata, q: torch.Tensor, *, softcap: float,
                        window_size: tuple, descaled: bool) -> bool:
    """Whether an FA3 call of ``md`` is an expand call this op serves (static
    facts only): one query per row in page size 1, no window, no softcap, no
    FP8 descales, and a bf16 or fp16 ``q``."""
    return (_one_query_per_slot(md) and tuple(window_size) == (-1, -1) and softcap == 0.0
            and not descaled and q.dtype in (torch.bfloat16, torch.float16))


def selected_key_bound(md: FA3Metadata) -> Optional[int]:
    """The key bound a compiled region may pass for ``md``'s call when the
    expand kernel is selected and takes it (`expand_key_bound`), or None:
    the call's bound is then FA3's to read (`fa3_spec.eagle.regions`)."""
    if expand_kernel() != "triton" or not _one_query_per_slot(md):
        return None
    bound = expand_key_bound(md.max_seqlen_k)
    return bound if bound <= MAX_EXPAND_KEYS else None


def _check(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(f"expand_attention: q must be [total_q, H_q, D] and the caches "
                         f"[slots, 1, H_kv, D], got q {tuple(q.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if k_cache.shape[1] != 1 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"expand_attention: the caches must be viewed in page size 1 with one "
                         f"shape but their last dim, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if page_table.dim() != 2 or cache_seqlens.dim() != 1 or cu_seqlens_q.dim() != 1:
        raise ValueError("expand_attention: page_table must be [rows, W], cache_seqlens [rows] "
                         "and cu_seqlens_q [rows + 1]")


@torch.library.custom_op("fa3_spec::expand_attention", mutates_args=())
def expand_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_table: torch.Tensor, cache_seqlens: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, max_seqlen_k: int,
                     softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """One expand call: ``(out [total_q, H_q, Dv], lse [H_q, total_q])``.

    ``q [total_q, H_q, D]``; caches viewed in page size 1, ``[slots, 1, H_kv,
    D]``; ``page_table`` int32 ``[rows, W]`` of slots; ``cache_seqlens`` int32
    ``[rows]``; ``cu_seqlens_q`` int32 ``[rows + 1]``, at most one query per
    row. The read rule and the rows without a key or a query: the module
    docstring. This default implementation is the reference's.
    """
    _check(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q)
    md = FA3Metadata(page_table, cache_seqlens, cu_seqlens_q, cu_seqlens_q, 1, max_seqlen_k, 1,
                     False)
    out, lse = paged_attention_reference(q, k_cache, v_cache, md, softmax_scale)
    return out.to(q.dtype), lse


@expand_attention.register_fake
def _expand_attention_fake(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q,
                           max_seqlen_k, softmax_scale):
    _check(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q)
    out = q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def expand_kernel_applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          page_table: torch.Tensor, cache_seqlens: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, max_seqlen_k: int) -> bool:
    """Whether the Triton kernel takes these tensors (layouts, dtypes and
    sizes only, never values): Triton importable; ``q`` and contiguous caches
    of at least one slot, of one dtype (bf16, fp16 or fp32), on one device; ``D == Dv`` a power of
    two from 16 to 256; ``H_q`` a multiple of ``H_kv`` with at most 16 query
    heads per KV head; int32 index tensors, ``cu_seqlens_q`` one longer than
    ``cache_seqlens`` and ``page_table`` with one row each and a unit column
    stride; ``1 <= max_seqlen_k <=`` `MAX_EXPAND_KEYS`; every element index
    below ``2**31``."""
    if not triton_available():
        return False
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        return False
    total_q, hq, d = q.shape
    slots, page, hkv, dk = k_cache.shape
    if slots == 0 or page != 1 or dk != d or d < 16 or d > 256 or d & (d - 1):
        return False
    if hkv == 0 or hq % hkv or hq // hkv > 16:
        return False
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in (
            torch.bfloat16, torch.float16, torch.float32):
        return False
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or q.stride(-1) != 1:
        return False
    rows = cache_seqlens.shape[0] if cache_seqlens.dim() == 1 else -1
    if page_table.dim() != 2 or page_table.shape[0] != rows or cu_seqlens_q.shape != (rows + 1,):
        return False
    if any(t.dtype != torch.int32 for t in (page_table, cache_seqlens, cu_seqlens_q)):
        return False
    if page_table.shape[1] == 0 or (page_table.shape[1] > 1 and page_table.stride(1) != 1):
        return False
    if not 1 <= max_seqlen_k <= MAX_EXPAND_KEYS:
        return False
    if len({t.device for t in (q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q)}) != 1:
        return False
    limit = 2 ** 31
    return max(k_cache.numel(), total_q * q.stride(0) + hq * q.stride(1),
               rows * page_table.stride(0) + page_table.shape[1], total_q * hq * d) < limit


@functools.cache
def _kernel():
    """The Triton kernel, built at first use (``(triton, kernel)``)."""
    import triton
    import triton.language as tl

    @triton.jit
    def expand_attention_kernel(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q,
                                out, lse, total_q, num_slots, width, pt_stride, max_keys,
                                q_row_stride, q_head_stride, scale_log2,
                                HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                                BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
                                IEEE: tl.constexpr, PDL: tl.constexpr):
        # Program (r, h): the query of row r, KV head h's group of query heads.
        if PDL:  # wait for the previous kernel before any load or store (pdl_launch)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        G: tl.constexpr = HQ // HKV
        r = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        start = tl.load(cu_seqlens_q + r).to(tl.int64)
        end = tl.load(cu_seqlens_q + r + 1).to(tl.int64)
        owns = (end - start >= 1) & (start >= 0) & (start < total_q)
        qi = tl.where(owns, start, 0)
        n = tl.minimum(tl.maximum(tl.load(cache_seqlens + r), 0), max_keys)

        t = tl.arange(0, BLOCK_K)
        live = t < n
        col = tl.minimum(t, width - 1)
        slot = tl.load(page_table + r * pt_stride + col, mask=live, other=0).to(tl.int64)
        slot = tl.minimum(tl.maximum(slot, 0), num_slots - 1)
        d = tl.arange(0, D)
        kv = slot[:, None] * (HKV * D) + h * D + d[None, :]
        kv_mask = live[:, None] & (d[None, :] < D)  # full-shape masks throughout
        k = tl.load(k_cache + kv, mask=kv_mask, other=0.0)  # [BLOCK_K, D]
        v = tl.load(v_cache + kv, mask=kv_mask, other=0.0)

        g = tl.arange(0, BLOCK_G)
        head = h * G + g
        in_group = g < tl.where(owns, G, 0)  # the group's heads, none if no query
        q_mask = in_group[:, None] & (d[None, :] < D)
        qv = tl.load(q + qi * q_row_stride + head[:, None] * q_head_stride + d[None, :],
                     mask=q_mask, other=0.0)  # [BLOCK_G, D]

        if IEEE:  # fp32: no TF32 rounding
            s = tl.dot(qv, tl.trans(k), input_precision="ieee") * scale_log2
        else:
            s = tl.dot(qv, tl.trans(k)) * scale_log2  # [BLOCK_G, BLOCK_K], log2 units
        s = tl.where(live[None, :], s, float("-inf"))
        m = tl.max(s, 1)
        m = tl.where(n > 0, m, 0.0)
        p = tl.exp2(s - m[:, None])
        p = tl.where(live[None, :], p, 0.0)
        total = tl.sum(p, 1)
        if IEEE:
            o = tl.dot(p, v, input_precision="ieee")
        else:
            o = tl.dot(p.to(v.dtype), v)  # probabilities in the input dtype, as FA3
        o = o / tl.where(total > 0, total, 1.0)[:, None]
        ln2: tl.constexpr = 0.6931471805599453
        lse_row = tl.where(total > 0, (m + tl.log2(tl.where(total > 0, total, 1.0))) * ln2,
                           float("-inf"))
        tl.store(out + qi * (HQ * D) + head[:, None] * D + d[None, :],
                 o.to(out.dtype.element_ty), mask=q_mask)
        tl.store(lse + head.to(tl.int64) * total_q + qi, lse_row, mask=in_group)
        # A row that claims more queries than its one: those get 0 and -inf
        # (in range only; no query is left as the allocator left it).
        extra = tl.where(owns, tl.minimum(end, total_q) - start - 1, 0)
        for e in range(0, extra):
            qe = start + 1 + e
            tl.store(out + qe * (HQ * D) + head[:, None] * D + d[None, :],
                     tl.zeros([BLOCK_G, D], dtype=out.dtype.element_ty), mask=q_mask)
            tl.store(lse + head.to(tl.int64) * total_q + qe,
                     tl.full([BLOCK_G], float("-inf"), tl.float32), mask=in_group)

    return triton, expand_attention_kernel


def expand_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            page_table: torch.Tensor, cache_seqlens: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, max_seqlen_k: int,
                            softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """`expand_attention` by the Triton kernel (``rows x H_kv`` programs); the
    tensors must pass `expand_kernel_applies` (``TypeError`` otherwise). Runs
    wherever Triton does (CUDA; CPU tensors under ``TRITON_INTERPRET=1``)."""
    if not expand_kernel_applies(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q,
                                 max_seqlen_k):
        raise TypeError("expand_attention_triton: the tensors do not fit the kernel (see "
                        f"expand_kernel_applies): q {tuple(q.shape)} {q.dtype}, k_cache "
                        f"{tuple(k_cache.shape)} {k_cache.dtype}, page_table "
                        f"{tuple(page_table.shape)} {page_table.dtype}, max_seqlen_k "
                        f"{max_seqlen_k}")
    return _launch(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, max_seqlen_k,
                   softmax_scale)


def _launch(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, max_seqlen_k,
            softmax_scale):
    triton, kernel = _kernel()
    total_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    rows = cache_seqlens.shape[0]
    out = torch.empty((total_q, hq, d), device=q.device, dtype=q.dtype)
    lse = torch.empty((hq, total_q), device=q.device, dtype=torch.float32)
    if rows == 0 or total_q == 0:
        return out, lse
    pdl = pdl_launch(q)
    with device_guard(q):
        kernel[(rows, hkv)](
            q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, out, lse,
            total_q, k_cache.shape[0], page_table.shape[1], page_table.stride(0), max_seqlen_k,
            q.stride(0), q.stride(1), softmax_scale * math.log2(math.e),
            HQ=hq, HKV=hkv, D=d, BLOCK_G=max(16, triton.next_power_of_2(hq // hkv)),
            BLOCK_K=expand_key_bound(max_seqlen_k), IEEE=q.dtype == torch.float32, PDL=pdl,
            num_warps=4,
            **pdl_kwargs(pdl))
    return out, lse


def _expand_attention_fa3(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q,
                          softmax_scale):
    return fa3_paged_attention(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, 1,
                               softmax_scale, False, 1)


def expand_attention_cuda(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q,
                          max_seqlen_k: int, softmax_scale: float):
    """The op's CUDA kernel: the Triton kernel where `expand_kernel_applies`, else FA3."""
    _check(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q)
    if expand_kernel_applies(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q,
                             max_seqlen_k):
        return _launch(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q,
                       max_seqlen_k, softmax_scale)
    return _expand_attention_fa3(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q,
                                 softmax_scale)


expand_attention.register_kernel("cuda")(expand_attention_cuda)

