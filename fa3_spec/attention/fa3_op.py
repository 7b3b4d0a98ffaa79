"""FA3 as a ``torch.library`` custom op with a fake, registered at import.

``torch.ops.fa3_spec.fa3_paged_attention`` is opaque to the compiler: its
fake gives output shapes from input shapes alone, so a whole step (metadata
builders + FA3 + merge) traces as one graph, and its real kernel runs (and
is captured) inside CUDA graphs. The FA3 provider is imported on first real
call only.
"""

from __future__ import annotations

import torch

from .providers import kvcache_forward


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """One FA3 varlen call over a paged KV cache.

    Shapes: ``q [total_q, H_q, D]``; caches ``[num_pages, page_size, H_kv, D]``;
    ``page_table`` int32 ``[rows, W]``; ``cache_seqlens`` int32 ``[rows]``;
    ``cu_seqlens_q`` int32 ``[rows + 1]``. Returns ``out [total_q, H_q, Dv]``
    (``q.dtype``) and ``lse`` float32 ``[H_q, total_q]``, raw as FA3 gives them
    (queries past ``cu_seqlens_q[-1]`` are unwritten; see
    `fa3_spec.attention.cascade` for the normalisation).
    """
    out, lse, *_ = kvcache_forward()(
        q,
        k_cache,
        v_cache,
        cache_seqlens=cache_seqlens,
        page_table=page_table,
        cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q,
        softmax_scale=softmax_scale,
        causal=causal,
        num_splits=num_splits,
        return_softmax_lse=True,
    )
    return out, lse


@fa3_paged_attention.register_fake
def _fa3_paged_attention_fake(
    q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q,
    max_seqlen_q, softmax_scale, causal, num_splits,
):
    total_q, heads = q.shape[0], q.shape[1]
    out = q.new_empty((total_q, heads, v_cache.shape[-1]))
    lse = q.new_empty((heads, total_q), dtype=torch.float32)
    return out, lse


def default_num_splits(num_rows: int, num_kv_heads: int, max_seqlen_k: int,
                       num_sms: int = 132) -> int:
    """A static split count from static bounds (FA3's fake rejects 0).

    Split the keys only when the call has too few (row, KV head) work items to
    fill the GPU and enough keys to split: ``min(16, sms / items, keys / 512)``,
    at least 1. Measured on the H200 (docs/semantics.md, "FA3 on the H200"): a topk > 1 prefix call at batch 1 ran in
    110 µs unsplit and 83 µs at 16 splits; at batch 64 splitting moved little.
    """
    items = max(1, num_rows * num_kv_heads)
    if items >= num_sms:
        return 1
    return max(1, min(16, num_sms // items, max_seqlen_k // 512))
