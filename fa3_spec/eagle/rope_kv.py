"""RoPE on a layer's queries and keys, and the K/V write into the paged cache, as one op.

After the fused QKV projection a layer rotates ``q`` and ``k`` and writes
``k`` and ``v`` at the tokens' slots: on CUDA under inductor that was two
kernels per layer and forward (inductor's fused RoPE, then
`fa3_spec.attention.store_kv`'s), each with the gap in front of it.
`rope_store_kv` does both in one launch on CUDA with Triton; everywhere
else it is the same two steps in plain torch.

Layout, the fused QKV output viewed per head (``D`` = head_dim)::

    qkv [T, H_q + 2 H_kv, D]   heads 0 .. H_q-1: queries,
                               then H_kv key heads, then H_kv value heads
    cos, sin [T, D/2]          each token's RoPE row (`fa3_spec.eagle.models.RopeTable.at`)
    slots [T]                  flat slots into the caches ``[..., H_kv, D]``
                               (every leading dim flattened), clamped by the caller

    -> q [T, H_q, D]  rotated, a new tensor
       k_cache.view(-1, H_kv, D)[slots] = rotate(k);  v_cache...[slots] = v

Rotate-half RoPE (Llama): with ``x1, x2`` the two halves of a head,
``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)`` in ``cos``'s dtype,
rounded back to ``qkv``'s. The Triton kernel computes the same products in
float32; it may round a product sum 1 ulp differently (FMA contraction),
so it matches the default to within one unit of the output dtype, not
bitwise (``compile_tests/test_gpu_rope_kv.py`` checks that bound).

`rope_and_store` is what the layers call: on CPU plain `apply_rope` and the
``fa3_spec::store_kv`` op (inductor and the CPU suite see what they saw
before this op), on CUDA this op, whose CUDA kernel is `rope_store_kv_cuda`
(`fa3_spec.eagle.kernels.select_kernels` registers the plain-torch
`rope_store_kv_split` in its place, a benchmark's other arm). The kernel writes only inside its tensors whatever ``slots``
holds: a slot outside the caches writes nothing. The plain-torch path
writes with ``index_copy_``, which raises on such a slot (a device assert on
CUDA); the layers clamp every slot before either.
"""

from __future__ import annotations

import functools

import torch

from ..attention.kv_store import store_kv, store_kv_index_copy
from ..triton_support import device_guard, pdl_kwargs, pdl_launch, triton_available

#: The implementations `fa3_spec.eagle.kernels.select_kernels` can register for CUDA.
ROPE_KV_IMPLS = ("split", "fused")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Llama) of ``x [T, H, D]`` with the ``[T, D/2]`` rows of
    `RopeTable.at`: ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``."""
    half = x.shape[-1] // 2
    xf = x.to(cos.dtype)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(x.dtype)


def _check(k_cache, v_cache, slots, qkv, cos, sin, num_heads) -> None:
    """Shapes, dtypes and devices (never values); the op, its fake, the
    fused path and `rope_and_store` all run it."""
    if qkv.dim() != 3:
        raise ValueError(f"rope_store_kv: qkv must be [T, H_q + 2 H_kv, D], got {tuple(qkv.shape)}")
    t, heads, d = qkv.shape
    if k_cache.dim() < 2 or k_cache.shape[-1] != d or v_cache.shape[-2:] != k_cache.shape[-2:]:
        raise ValueError(f"rope_store_kv: k_cache and v_cache must end in [H_kv, D] with qkv's D = {d}, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    hkv = k_cache.shape[-2]
    if hkv < 1:
        raise ValueError(f"rope_store_kv: the caches must have H_kv >= 1 heads, got {tuple(k_cache.shape)}")
    if num_heads < 1 or heads != num_heads + 2 * hkv:
        raise ValueError(f"rope_store_kv: qkv has {heads} heads, not num_heads ({num_heads}) + 2 x "
                         f"the caches' H_kv ({hkv})")
    if d < 2 or d % 2:
        raise ValueError(f"rope_store_kv: the head dim must be even and >= 2, got {d}")
    if cos.shape != (t, d // 2) or sin.shape != cos.shape:
        raise ValueError(f"rope_store_kv: cos and sin must be [T, D/2] = {(t, d // 2)}, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if slots.shape != (t,):
        raise ValueError(f"rope_store_kv: slots must be [T] = [{t}], got {tuple(slots.shape)}")
    if slots.dtype != torch.int64:
        raise TypeError(f"rope_store_kv: slots must be int64, got {slots.dtype}")
    if not (k_cache.dtype == v_cache.dtype == qkv.dtype):
        raise TypeError(f"rope_store_kv: k_cache, v_cache and qkv must share a dtype, got "
                        f"{k_cache.dtype}, {v_cache.dtype} and {qkv.dtype}")
    if cos.dtype != sin.dtype or not cos.is_floating_point():
        raise TypeError(f"rope_store_kv: cos and sin must share a floating dtype, got {cos.dtype} and {sin.dtype}")
    devices = {x.device for x in (k_cache, v_cache, slots, qkv, cos, sin)}
    if len(devices) != 1:
        raise ValueError(f"rope_store_kv: every tensor must be on one device, got {sorted(map(str, devices))}")


@torch.library.custom_op("fa3_spec::rope_store_kv", mutates_args=("k_cache", "v_cache"))
def rope_store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  num_heads: int) -> torch.Tensor:
    """Rotate ``q`` and ``k`` of ``qkv [T, H_q + 2 H_kv, D]``, write ``k`` and
    ``v`` into the caches at ``slots [T]`` and return ``q [T, H_q, D]`` (see
    the module docstring; ``num_heads`` is ``H_q``, ``H_kv`` the caches')."""
    _check(k_cache, v_cache, slots, qkv, cos, sin, num_heads)
    return rope_store_kv_split(k_cache, v_cache, slots, qkv, cos, sin, num_heads)


@rope_store_kv.register_fake
def _rope_store_kv_fake(k_cache, v_cache, slots, qkv, cos, sin, num_heads):
    _check(k_cache, v_cache, slots, qkv, cos, sin, num_heads)
    return qkv.new_empty(qkv.shape[0], num_heads, qkv.shape[2])


def _rotate_and_store(store, k_cache, v_cache, slots, qkv, cos, sin, num_heads) -> torch.Tensor:
    """`apply_rope` on q and k, ``store(k_cache, v_cache, slots, k, v)``, q back."""
    hkv = (qkv.shape[1] - num_heads) // 2
    q, k, v = qkv.split([num_heads, hkv, hkv], dim=1)
    store(k_cache, v_cache, slots, apply_rope(k, cos, sin), v)
    return apply_rope(q, cos, sin)


def rope_store_kv_split(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                        qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        num_heads: int) -> torch.Tensor:
    """The default implementation of `rope_store_kv`: `apply_rope` twice and
    two ``index_copy_`` (`fa3_spec.attention.store_kv_index_copy`; a slot
    outside the caches raises on CPU and trips a device assert on CUDA). A
    plain function, not an op: inside ``torch.compile`` call the op or
    `rope_and_store`."""
    return _rotate_and_store(store_kv_index_copy, k_cache, v_cache, slots, qkv, cos, sin, num_heads)


def fused_rope_kv_applies(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                          qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          num_heads: int) -> bool:
    """Whether `rope_store_kv_fused` takes these tensors (shapes, layouts and
    dtypes only, never values): what `rope_store_kv` accepts, with contiguous
    caches of one shape, ``qkv`` in bf16, fp16 or fp32 with unit stride along
    ``D``, float32 ``cos``/``sin`` with unit stride along ``D/2``, unit-stride
    ``slots``, and at most 65535 heads (the grid's second dimension)."""
    try:
        _check(k_cache, v_cache, slots, qkv, cos, sin, num_heads)
    except (ValueError, TypeError):
        return False
    return _fused_layout_ok(k_cache, v_cache, slots, qkv, cos, sin)


def _fused_layout_ok(k_cache, v_cache, slots, qkv, cos, sin) -> bool:
    """`fused_rope_kv_applies` for tensors `_check` already took (so that a
    call checks its shapes once)."""
    if not triton_available():
        return False
    t, heads, d = qkv.shape
    if qkv.dtype not in (torch.bfloat16, torch.float16, torch.float32) or cos.dtype != torch.float32:
        return False
    if k_cache.shape != v_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    if d > 2 and (cos.stride(1) != 1 or sin.stride(1) != 1):
        return False
    if qkv.stride(2) != 1 or (t > 1 and slots.stride(0) != 1):
        return False
    return heads <= 65535


@functools.cache
def _kernel():
    """The Triton kernel, built at first use (``(triton, kernel)``)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rope_store_kv_kernel(qkv, cos, sin, slots, q_out, k_cache, v_cache, num_rows,
                             qkv_row_stride, qkv_head_stride, cos_row_stride, sin_row_stride,
                             HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                             BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # wait for the previous kernel before any load or store (pdl_launch)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        # Program (t, h): head h of token t. Heads below HQ are queries
        # (rotated into q_out), the next HKV keys (rotated into k_cache), the
        # last HKV values (copied into v_cache).
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        i = tl.arange(0, BLOCK)
        in_half = i < HALF
        src = qkv + t * qkv_row_stride + h.to(tl.int64) * qkv_head_stride
        x1 = tl.load(src + i, mask=in_half, other=0.0)
        x2 = tl.load(src + HALF + i, mask=in_half, other=0.0)
        if h < HQ + HKV:  # a query or key head: rotate
            c = tl.load(cos + t * cos_row_stride + i, mask=in_half, other=0.0)
            s = tl.load(sin + t * sin_row_stride + i, mask=in_half, other=0.0)
            a = x1.to(tl.float32)
            b = x2.to(tl.float32)
            x1 = (a * c - b * s).to(x1.dtype)
            x2 = (b * c + a * s).to(x2.dtype)
        if h < HQ:
            q_dst = q_out + (t * HQ + h) * (2 * HALF)
            tl.store(q_dst + i, x1, mask=in_half)
            tl.store(q_dst + HALF + i, x2, mask=in_half)
        else:
            slot = tl.load(slots + t).to(tl.int64) + 0 * i  # the slot, broadcast to the block
            ok = in_half & (slot >= 0) & (slot < num_rows)
            kv = h - HQ
            cache = k_cache
            if kv >= HKV:
                kv = kv - HKV
                cache = v_cache
            kv_dst = cache + (tl.where(ok, slot, 0) * HKV + kv) * (2 * HALF)
            tl.store(kv_dst + i, x1, mask=ok)
            tl.store(kv_dst + HALF + i, x2, mask=ok)

    return triton, rope_store_kv_kernel


def rope_store_kv_fused(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                        qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        num_heads: int) -> torch.Tensor:
    """`rope_store_kv` as one Triton launch (``T x (H_q + 2 H_kv)`` programs).
    Bad shapes raise as the op does; tensors that `fused_rope_kv_applies`
    refuses for their layout or dtype raise ``TypeError``.
    Slots outside the caches' rows are dropped. Runs wherever Triton does
    (CUDA; CPU tensors under ``TRITON_INTERPRET=1``)."""
    _check(k_cache, v_cache, slots, qkv, cos, sin, num_heads)
    if not _fused_layout_ok(k_cache, v_cache, slots, qkv, cos, sin):
        raise TypeError("rope_store_kv_fused: the tensors' layouts or dtypes do not fit the fused "
                        "kernel (see fused_rope_kv_applies)")
    return _launch(k_cache, v_cache, slots, qkv, cos, sin, num_heads)


def _launch(k_cache, v_cache, slots, qkv, cos, sin, num_heads) -> torch.Tensor:
    t, heads, d = qkv.shape
    hkv = k_cache.shape[-2]
    q = torch.empty(t, num_heads, d, device=qkv.device, dtype=qkv.dtype)
    if t == 0:
        return q
    triton, kernel = _kernel()
    pdl = pdl_launch(qkv)
    with device_guard(qkv):  # a custom op gets no device guard (`store_kv` says why)
        kernel[(t, heads)](
            qkv, cos, sin, slots, q, k_cache, v_cache, k_cache.numel() // (hkv * d),
            qkv.stride(0), qkv.stride(1), cos.stride(0), sin.stride(0),
            HQ=num_heads, HKV=hkv, HALF=d // 2, BLOCK=triton.next_power_of_2(d // 2),
            PDL=pdl, num_warps=1, **pdl_kwargs(pdl))
    return q


def rope_store_kv_cuda(k_cache, v_cache, slots, qkv, cos, sin, num_heads):
    """The op's CUDA kernel: the Triton kernel where its layout rules hold, else
    `rope_store_kv_split`."""
    _check(k_cache, v_cache, slots, qkv, cos, sin, num_heads)  # once per call
    if _fused_layout_ok(k_cache, v_cache, slots, qkv, cos, sin):
        return _launch(k_cache, v_cache, slots, qkv, cos, sin, num_heads)
    return rope_store_kv_split(k_cache, v_cache, slots, qkv, cos, sin, num_heads)


rope_store_kv.register_kernel("cuda")(rope_store_kv_cuda)


def rope_and_store(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   num_heads: int) -> torch.Tensor:
    """What the layers call (arguments and result as `rope_store_kv`).

    CPU: `apply_rope` and the
    ``fa3_spec::store_kv`` op, which inductor sees through. CUDA: the op
    ``fa3_spec::rope_store_kv``. The branch is on the device, never on a
    value.
    """
    if qkv.device.type != "cuda":
        _check(k_cache, v_cache, slots, qkv, cos, sin, num_heads)
        return _rotate_and_store(store_kv, k_cache, v_cache, slots, qkv, cos, sin, num_heads)
    return rope_store_kv(k_cache, v_cache, slots, qkv, cos, sin, num_heads)
