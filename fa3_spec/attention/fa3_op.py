"""FA3 as a ``torch.library`` custom op with a fake, registered at import.

``torch.ops.fa3_spec.fa3_paged_attention`` is opaque to the compiler: its
fake gives output shapes from input shapes alone, so a whole step (metadata
builders + FA3 + merge) traces as one graph, and its real kernel runs (and
is captured) inside CUDA graphs. The FA3 provider is imported on first real
call only.
"""

from __future__ import annotations

from typing import Optional

import torch

from .providers import kvcache_forward, scheduler_planner


def attention_out_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """Output dtype of an FA3 call on ``q``: bf16 for FP8 queries, else ``q``'s."""
    return torch.bfloat16 if q_dtype == torch.float8_e4m3fn else q_dtype


@torch.library.custom_op("fa3_spec::fa3_paged_attention", mutates_args=())
def fa3_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    causal: bool,
    num_splits: int,
    softcap: float = 0.0,
    window_left: int = -1,
    window_right: int = -1,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    scheduler_metadata: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One FA3 varlen call over a paged KV cache (``flash_attn_with_kvcache``).

    Shapes: ``q [total_q, H_q, D]``; caches ``[num_pages, page_size, H_kv, D]``;
    ``page_table`` int32 ``[rows, W]``; ``cache_seqlens`` int32 ``[rows]``;
    ``cu_seqlens_q`` int32 ``[rows + 1]``. Per-layer arguments keep FA3's
    names: ``softcap`` (0 = off), ``window_size = (window_left,
    window_right)`` (-1 = unbounded, bottom-right aligned), and for FP8 KV
    (``q`` and caches ``float8_e4m3fn``) the float32 ``[rows, H_kv]``
    descales. ``scheduler_metadata``: a plan from `fa3_scheduler_plan` made
    with this call's arguments (None: FA3 plans inside the call, one extra
    kernel). Only arguments that differ from FA3's defaults are passed on,
    so a provider that predates one still serves calls that do not use it.

    Returns ``out [total_q, H_q, Dv]`` (``q.dtype``; bf16 for FP8) and ``lse``
    float32 ``[H_q, total_q]``, raw as FA3 gives them (queries past
    ``cu_seqlens_q[-1]`` are unwritten and empty rows have a non-finite LSE;
    see `fa3_spec.attention.cascade.attention_call` for the normalisation).
    """
    kw = dict(
        cache_seqlens=cache_seqlens,
        page_table=page_table,
        cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q,
        softmax_scale=softmax_scale,
        causal=causal,
        num_splits=num_splits,
        return_softmax_lse=True,
    )
    if softcap != 0.0:
        kw["softcap"] = softcap
    if (window_left, window_right) != (-1, -1):
        kw["window_size"] = (window_left, window_right)
    for name, scale in (("q_descale", q_descale), ("k_descale", k_descale),
                        ("v_descale", v_descale)):
        if scale is not None:
            kw[name] = scale
    if scheduler_metadata is not None:
        kw["scheduler_metadata"] = scheduler_metadata
    out, lse, *_ = kvcache_forward()(q, k_cache, v_cache, **kw)
    return out, lse


@fa3_paged_attention.register_fake
def _fa3_paged_attention_fake(
    q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q,
    max_seqlen_q, softmax_scale, causal, num_splits,
    softcap=0.0, window_left=-1, window_right=-1,
    q_descale=None, k_descale=None, v_descale=None, scheduler_metadata=None,
):
    if isinstance(num_splits, int) and num_splits < 1:  # a symbolic count is >= 1 by construction
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits}")
    total_q, heads = q.shape[0], q.shape[1]
    out = q.new_empty((total_q, heads, v_cache.shape[-1]), dtype=attention_out_dtype(q.dtype))
    lse = q.new_empty((heads, total_q), dtype=torch.float32)
    return out, lse


def plan_entries(num_rows, *, causal: bool, max_seqlen_q: int, max_seqlen_k: int,
                 head_dim: int, window_left: int = -1, window_right: int = -1):
    """int32 entries of FA3's scheduler plan for a paged call of ``num_rows``
    rows: a tile counter, then 2 per-row vectors, one more unless the call is
    local (windowed), and one more if it is causal or local, each padded to a
    multiple of 4 rows: ``1 + 3 * round_up(num_rows, 4)`` for a plain call,
    ``1 + 4 * round_up(num_rows, 4)`` for a causal one.

    "Causal" and "local" are FA3's own reading of the arguments, restated
    here from its source (``get_scheduler_metadata``): a window side at
    least the call's extent (``max_seqlen_k - 1`` keys left,
    ``max_seqlen_q - 1`` queries right) is dropped; a one-query call with no
    window is not causal unless ``64 < head_dim <= 128``; a causal call's
    right window is 0; causal means no left window and a right window of 0,
    local any other window.

    This is FA3's internal layout, not an API: the GPU tests check it against
    the installed build (``compile_tests/test_gpu_attention.py``, head dims,
    windows, row and split counts). A wrong size fails loudly
    under inductor, which asserts a custom op's output size; eagerly FA3
    gets its own plan whatever this says. ``num_rows`` may be symbolic
    (integer arithmetic only); the other arguments are static.
    """
    left = -1 if window_left >= max_seqlen_k - 1 else window_left
    right = -1 if window_right >= max_seqlen_q - 1 else window_right
    if max_seqlen_q == 1 and left == -1 and right == -1 and not 64 < head_dim <= 128:
        causal = False
    if causal:
        right = 0
    is_causal = left < 0 and right == 0
    is_local = (left >= 0 or right >= 0) and not is_causal
    vectors = 2 + (0 if is_local else 1) + (1 if is_causal or is_local else 0)
    return 1 + vectors * ((num_rows + 3) // 4 * 4)


@torch.library.custom_op("fa3_spec::fa3_scheduler_plan", mutates_args=())
def fa3_scheduler_plan(
    cache_seqlens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    head_dim_v: int,
    qkv_dtype: torch.dtype,
    page_size: int,
    causal: bool,
    num_splits: int,
    has_softcap: bool = False,
    window_left: int = -1,
    window_right: int = -1,
) -> torch.Tensor:
    """FA3's scheduler plan (``get_scheduler_metadata``) for calls of one
    shape: int32 ``[plan_entries(rows, ...)]``, ``rows =
    cache_seqlens.shape[0]``.

    Every `fa3_paged_attention` call with these arguments (the same
    ``cache_seqlens``, ``cu_seqlens_q``, ``num_splits``, causality, window
    and head shapes: the layers of one forward) may take it as its
    ``scheduler_metadata`` instead of planning inside the call: one small
    kernel per forward instead of one per layer. ``max_seqlen_k`` is the
    bound FA3 takes from a paged call itself (page-table width times
    ``page_size``), so the plan is the one the call would make. Build it
    with `fa3_spec.attention.fa3_plans`, which takes these from the
    metadata and the call.

    The calls sharing a plan must run one after another on one stream (the
    layers of a forward do): each resets and counts in its tile counter.
    """
    return scheduler_planner()(
        cache_seqlens.shape[0], max_seqlen_q, max_seqlen_k, num_heads, num_kv_heads, head_dim,
        cache_seqlens, qkv_dtype, headdim_v=head_dim_v, cu_seqlens_q=cu_seqlens_q,
        page_size=page_size, causal=causal, window_size=(window_left, window_right),
        has_softcap=has_softcap, num_splits=num_splits)


@fa3_scheduler_plan.register_fake
def _fa3_scheduler_plan_fake(cache_seqlens, cu_seqlens_q, max_seqlen_q, max_seqlen_k, num_heads,
                             num_kv_heads, head_dim, head_dim_v, qkv_dtype, page_size, causal,
                             num_splits, has_softcap=False, window_left=-1, window_right=-1):
    size = plan_entries(cache_seqlens.shape[0], causal=causal, max_seqlen_q=max_seqlen_q,
                        max_seqlen_k=max_seqlen_k, head_dim=head_dim, window_left=window_left,
                        window_right=window_right)
    return cache_seqlens.new_empty((size,), dtype=torch.int32)


#: Fewest keys per split in `default_num_splits`.
KEYS_PER_SPLIT = 128


def default_num_splits(num_rows, num_kv_heads: int, max_seqlen_k: int, num_sms: int = 132):
    """A split count from the call's bounds: ``max(1, min(16, sms // items,
    keys // KEYS_PER_SPLIT))`` with ``items = max(1, rows * kv_heads)`` (FA3's
    fake rejects 0).

    Split the keys only when the call has too few (row, KV head) work items to
    fill the GPU and enough keys to split; from ``items >= sms`` on it is 1
    (``sms // items <= 1``). A split shorter than `KEYS_PER_SPLIT` keys costs
    more in its combine than it saves (the kernel benchmark compares split
    counts at decode and prefix shapes).

    Written without a comparison (`_min_static`, `_at_least_one`: integer
    floor divisions only), so that with a batch dimension marked dynamic
    ``num_rows`` may be symbolic: the count is then an expression of the
    batch that the compiled graph evaluates per call (each captured bucket
    gets its own value) instead of a guard that splits the batch range into
    several compiled frames. With plain ints it is plain integer arithmetic.
    """
    work = num_rows * num_kv_heads
    items = work + 1 // (work + 1)  # max(1, work) for work >= 0
    per_sm = num_sms // items
    key_blocks = _key_blocks(max_seqlen_k)  # static
    if key_blocks == 0:
        return 1
    return _at_least_one(_min_static(_min_static(per_sm, 16), key_blocks))


def _key_blocks(max_seqlen_k: int) -> int:
    """All `default_num_splits` reads of the key bound: its whole blocks of
    `KEYS_PER_SPLIT` keys."""
    return max_seqlen_k // KEYS_PER_SPLIT


def same_split_key_bound(max_seqlen_k: int) -> int:
    """The largest key bound `default_num_splits` reads as ``max_seqlen_k``
    (the last bound of its block of `KEYS_PER_SPLIT` keys): 1-127 give 127,
    1000 gives 1023."""
    return (_key_blocks(max_seqlen_k) + 1) * KEYS_PER_SPLIT - 1


def _min_static(x, bound: int):
    """``min(x, bound)`` for an int (or SymInt) ``x >= 0`` and a static
    ``bound >= 1``, without a comparison: ``x >= bound`` exactly when
    ``x // bound >= 1``, and ``1 - 1 // (q + 1)`` is that indicator for ``q >= 0``."""
    reached = 1 - 1 // (x // bound + 1)
    return x - (x - bound) * reached


def _at_least_one(x):
    """``max(x, 1)`` for ``x >= 0`` without a comparison."""
    return x + 1 // (x + 1)
