"""Pure-PyTorch paged attention that reads the page table exactly as FA3 does.

For CPU tests, as the float32 oracle of GPU tests, and as the ``"torch"``
backend. It is traceable with static shapes: every row gathers
``max_seqlen_k`` keys and masks the ones past ``cache_seqlens``, and queries
are laid out as ``[rows, max_seqlen_q]`` by gathers from ``cu_seqlens_q``.
Cost is ``rows * max_seqlen_q * max_seqlen_k * H``: an oracle, not a kernel.
"""

from __future__ import annotations

import torch

from ..metadata import FA3Metadata


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: FA3Metadata,
    softmax_scale: float,
    *,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FA3's read rule in torch: ``(out [total_q, H, Dv], lse [H, total_q])``.

    ``k_cache``/``v_cache`` must already be viewed in ``md.page_size``. Keys of
    row ``b``: ``t < cache_seqlens[b]`` at page ``page_table[b, t // P]``;
    causal masks are bottom-right aligned. Rows with no visible key, and
    queries past ``cu_seqlens_q[-1]``, give output 0 and LSE ``-inf``. Page
    ids are clamped into the cache, so any metadata is safe to evaluate.
    """
    total_q, hq, _ = q.shape
    num_pages, p, hkv, _ = k_cache.shape
    rows, width = md.page_table.shape
    mq, mk = md.max_seqlen_q, md.max_seqlen_k
    device = q.device
    if rows == 0 or mq == 0 or total_q == 0:
        out_q = q.new_zeros((total_q, hq, v_cache.shape[-1]))
        return out_q, torch.full((hq, total_q), float("-inf"), device=device)

    # Keys: [rows, mk] slots -> [rows, mk, Hkv, D]
    t = torch.arange(mk, device=device)
    col = (t // p).clamp(max=width - 1)
    pages = md.page_table.to(torch.int64)[:, col].clamp(0, num_pages - 1)
    slots = pages * p + t % p
    kf = k_cache.reshape(num_pages * p, hkv, -1)[slots].to(compute_dtype)
    vf = v_cache.reshape(num_pages * p, hkv, -1)[slots].to(compute_dtype)
    group = hq // hkv
    kf = kf.repeat_interleave(group, dim=2)  # [rows, mk, Hq, D]
    vf = vf.repeat_interleave(group, dim=2)

    # Queries: [rows, mq] indices into q.
    cu = md.cu_seqlens_q.to(torch.int64)
    q_len = cu[1:] - cu[:-1]
    i = torch.arange(mq, device=device)
    q_index = cu[:-1, None] + i  # [rows, mq]
    q_valid = (i < q_len[:, None]) & (q_index < total_q)
    qf = q[q_index.clamp(0, max(total_q - 1, 0))].to(compute_dtype)  # [rows, mq, Hq, D]

    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * softmax_scale
    seqlen_k = md.cache_seqlens.to(torch.int64)
    visible = t[None, None, :] < seqlen_k[:, None, None]  # [rows, 1, mk]
    if md.causal:
        limit = seqlen_k[:, None] - q_len[:, None] + i[None, :]  # [rows, mq]
        visible = visible & (t[None, None, :] <= limit[:, :, None])
    visible = visible & q_valid[:, :, None]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [rows, Hq, mq]; -inf when empty
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0)[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vf)  # [rows, mq, Hq, Dv]

    # Back to packed query order: query j belongs to row r(j), slot j - cu[r].
    j = torch.arange(total_q, device=device)
    row = md.query_rows(total_q).clamp(max=max(rows - 1, 0))
    slot = (j - cu[row]).clamp(0, max(mq - 1, 0))
    owned = j < cu[-1]
    out_q = torch.where(owned[:, None, None], out[row, slot], 0).to(q.dtype)
    lse_q = torch.where(owned[:, None], lse[row, :, slot], float("-inf"))
    return out_q, lse_q.transpose(0, 1).contiguous()
