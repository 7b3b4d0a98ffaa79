"""Writing K/V into the paged cache: a mutating custom op, registered at import.

Why an op and not plain ``index_copy_``: inside ``torch.compile`` an in-place
write into a cache the graph does not own (a lifted input) is functionalized,
and inductor then materialises a copy of the *whole* cache per write, a cost
that grows with the cache instead of the tokens written. A custom op that
declares ``mutates_args`` is re-inplaced by inductor and writes only the
``T`` rows. Slots are clamped in plain torch by the callers.

Two implementations, which write the same bytes for slots in range (the
callers clamp every slot, so the loop never passes one outside):

- the default (CPU, and CUDA without Triton): two ``index_copy_``, one per
  cache. An out-of-range slot raises (CPU) or trips a device assert (CUDA);
- CUDA with Triton: one kernel writes the K and the V rows of a token
  together (one launch per layer instead of two). A slot outside ``[0, rows)`` writes
  nothing, so whatever ``slots`` holds the kernel stays inside the caches.
  It takes ``k``/``v`` with any row and head strides (``v`` is usually a view
  of the fused QKV output) and needs unit stride along ``D``; anything else
  (a non-contiguous cache, mixed dtypes) goes to the default.

`store_kv_cuda` is the op's CUDA kernel; `fa3_spec.eagle.kernels.select_kernels`
registers `store_kv_index_copy` in its place (a benchmark's other arm).
"""

from __future__ import annotations

import functools

import torch

from ..triton_support import device_guard, pdl_kwargs, pdl_launch, triton_available

#: The implementations `fa3_spec.eagle.kernels.select_kernels` can register for CUDA.
STORE_KV_IMPLS = ("index_copy", "triton")


def fused_store_available() -> bool:
    """Whether Triton imports, so that `store_kv_fused` can run
    (`fa3_spec.triton_support.triton_available`: asked once per process, never at
    ``import fa3_spec``)."""
    return triton_available()


@torch.library.custom_op("fa3_spec::store_kv", mutates_args=("k_cache", "v_cache"))
def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """``k_cache.view(-1, H, D)[slots] = k`` (and the same for v), in place.

    ``slots``: int64 ``[T]`` flat slot indices into the whole cache (any
    leading dims flattened, e.g. ``layer * slots_per_layer + slot``), which the
    caller has clamped into range. ``k``, ``v``: ``[T, H_kv, D]``.
    """
    store_kv_index_copy(k_cache, v_cache, slots, k, v)


@store_kv.register_fake
def _store_kv_fake(k_cache, v_cache, slots, k, v) -> None:
    return None


def store_kv_index_copy(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                        k: torch.Tensor, v: torch.Tensor) -> None:
    """The default implementation of `store_kv`: one ``index_copy_`` per cache
    over its rows viewed flat, or, for a cache no flat view can alias (a
    transposed or strided one), an ``index_put_`` at the slots unravelled over
    its leading dims. A plain function, not an op: inside ``torch.compile``
    call the op (see the module docstring for why)."""
    for cache, x in ((k_cache, k), (v_cache, v)):
        rows = cache.shape[:-2].numel()
        flat = cache.view(rows, *x.shape[-2:]) if cache.is_contiguous() else None
        if flat is not None:
            flat.index_copy_(0, slots, x)
        else:
            cache.index_put_(torch.unravel_index(slots, cache.shape[:-2]), x)


def fused_store_applies(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                        k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `store_kv_fused` takes these tensors (layouts and dtypes only,
    never values): contiguous caches of one shape and dtype, ``k``/``v``
    ``[T, H, D]`` of that dtype with unit stride along ``D``, 1-D integer
    ``slots`` of ``T``, all on one device, and ``H * D`` a whole number of
    cache rows."""
    if not fused_store_available():
        return False
    if k.dim() != 3 or v.shape != k.shape or slots.dim() != 1 or slots.shape[0] != k.shape[0]:
        return False
    if slots.dtype not in (torch.int32, torch.int64):
        return False
    if not (k_cache.dtype == v_cache.dtype == k.dtype == v.dtype):
        return False
    if k_cache.shape != v_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    # Unit strides where they matter (a size-1 dimension's stride means nothing).
    t, _, d = k.shape
    if d > 1 and (k.stride(-1) != 1 or v.stride(-1) != 1):
        return False
    if t > 1 and slots.stride(0) != 1:
        return False
    row = k.shape[1] * k.shape[2]
    if row == 0 or k_cache.numel() % row:
        return False
    return len({x.device for x in (k_cache, v_cache, slots, k, v)}) == 1


@functools.cache
def _kernel():
    """The Triton kernel, built at first use (``(triton, kernel)``)."""
    import triton
    import triton.language as tl

    @triton.jit
    def store_kv_kernel(k_cache, v_cache, slots, k, v, num_rows,
                        k_row_stride, k_head_stride, v_row_stride, v_head_stride,
                        H: tl.constexpr, D: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        # One program per token: its H x D K row and V row.
        if PDL:  # wait for the previous kernel before any load or store (pdl_launch)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots + t).to(tl.int64)
        h = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]  # int64: a head stride times h
        d = tl.arange(0, BLOCK_D).to(tl.int64)[None, :]  # may pass 2**31
        row = slot + 0 * (h + d)  # the slot, broadcast to the block
        mask = (h < H) & (d < D) & (row >= 0) & (row < num_rows)
        dst = tl.where(mask, row, 0) * (H * D) + h * D + d
        kr = tl.load(k + t * k_row_stride + h * k_head_stride + d, mask=mask)
        vr = tl.load(v + t * v_row_stride + h * v_head_stride + d, mask=mask)
        tl.store(k_cache + dst, kr, mask=mask)
        tl.store(v_cache + dst, vr, mask=mask)

    return triton, store_kv_kernel


def store_kv_fused(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor) -> None:
    """`store_kv` as one Triton launch (``T`` programs); the tensors must pass
    `fused_store_applies` (``TypeError`` otherwise). Slots outside the
    caches' rows are dropped. Runs wherever Triton does (CUDA; CPU tensors
    under ``TRITON_INTERPRET=1``)."""
    if not fused_store_applies(k_cache, v_cache, slots, k, v):
        raise TypeError("store_kv_fused: the tensors' layouts or dtypes do not fit the fused "
                        "kernel (see fused_store_applies)")
    _launch_fused(k_cache, v_cache, slots, k, v)


def _launch_fused(k_cache, v_cache, slots, k, v) -> None:
    """The launch of `store_kv_fused`, for tensors `fused_store_applies` took."""
    t, h, d = k.shape
    if t == 0:
        return
    triton, kernel = _kernel()
    # A custom op gets no device guard, and Triton launches on the current
    # device: make it the tensors' (an eager call on another GPU).
    pdl = pdl_launch(k_cache)
    with device_guard(k_cache):
        kernel[(t,)](
            k_cache, v_cache, slots, k, v, k_cache.numel() // (h * d),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            H=h, D=d, BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d),
            PDL=pdl, num_warps=4, **pdl_kwargs(pdl))


def store_kv_cuda(k_cache, v_cache, slots, k, v) -> None:
    """The op's CUDA kernel: the fused Triton write where it applies, else the default."""
    if fused_store_applies(k_cache, v_cache, slots, k, v):  # checked once per call
        _launch_fused(k_cache, v_cache, slots, k, v)
    else:
        store_kv_index_copy(k_cache, v_cache, slots, k, v)


store_kv.register_kernel("cuda")(store_kv_cuda)
