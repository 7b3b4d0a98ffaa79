"""Pure-PyTorch paged attention that reads the page table exactly as FA3 does.

For CPU tests, as the float32 oracle of GPU tests, and as the ``"torch"``
backend. It is traceable with static shapes: every row gathers
``max_seqlen_k`` keys and masks the ones past ``cache_seqlens``, and queries
are laid out as ``[rows, max_seqlen_q]`` by gathers from ``cu_seqlens_q``.
Cost is ``rows * max_seqlen_q * max_seqlen_k * H``: an oracle, not a kernel.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..metadata import FA3Metadata
from .fa3_op import attention_out_dtype


def visible_keys(
    seqlen_k: torch.Tensor,
    q_len: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool,
    window_size: tuple = (-1, -1),
) -> torch.Tensor:
    """bool ``[rows, max_seqlen_q, max_seqlen_k]``: key ``t`` visible to query ``i``.

    FA3's rule, bottom-right aligned: query ``i`` of a row's ``n = q_len``
    queries sits at position ``pos = seqlen_k - n + i``; it sees keys
    ``t < seqlen_k`` with ``pos - left <= t`` (when ``left >= 0``) and
    ``t <= pos + right`` (``right = 0`` when causal; unbounded when -1 and
    not causal). Example, ``seqlen_k = 6``, ``n = 2``, causal, ``left = 2``::

        query 0 (pos 4):  . . x x x .
        query 1 (pos 5):  . . . x x x
    """
    left, right = window_size
    if causal:
        right = 0
    t = torch.arange(max_seqlen_k, device=seqlen_k.device)
    i = torch.arange(max_seqlen_q, device=seqlen_k.device)
    visible = (t[None, None, :] < seqlen_k[:, None, None]).expand(-1, max_seqlen_q, -1)
    pos = (seqlen_k[:, None] - q_len[:, None] + i[None, :])[:, :, None]  # [rows, mq, 1]
    if left >= 0:
        visible = visible & (t[None, None, :] >= pos - left)
    if right >= 0:
        visible = visible & (t[None, None, :] <= pos + right)
    return visible


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: FA3Metadata,
    softmax_scale: float,
    *,
    compute_dtype: torch.dtype = torch.float32,
    softcap: float = 0.0,
    window_size: tuple = (-1, -1),
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FA3's read rule in torch: ``(out [total_q, H, Dv], lse [H, total_q])``.

    ``k_cache``/``v_cache`` must already be viewed in ``md.page_size``. Keys of
    row ``b``: ``t < cache_seqlens[b]`` at page ``page_table[b, t // P]``;
    causal masks and ``window_size`` are bottom-right aligned (see
    `visible_keys`). ``softcap > 0`` caps the scaled scores elementwise,
    ``softcap * tanh(score / softcap)``, as FA3 does. FP8 (``float8_e4m3fn``)
    ``q`` and caches are dequantised with their float32 ``[rows, H_kv]``
    descales (row ``b``'s scale of KV head ``h`` multiplies its keys, values,
    and the queries of the query heads that read it); the output is then bf16.

    Rows with no visible key, and queries past ``cu_seqlens_q[-1]``, give
    output 0 and LSE ``-inf``. Page ids are clamped into the cache, so any
    metadata is safe to evaluate.
    """
    total_q, hq, _ = q.shape
    num_pages, p, hkv, _ = k_cache.shape
    rows, width = md.page_table.shape
    mq, mk = md.max_seqlen_q, md.max_seqlen_k
    device = q.device
    out_dtype = attention_out_dtype(q.dtype)
    if rows == 0 or mq == 0 or total_q == 0:
        out_q = q.new_zeros((total_q, hq, v_cache.shape[-1]), dtype=out_dtype)
        return out_q, torch.full((hq, total_q), float("-inf"), device=device)
    group = hq // hkv

    def per_row(scale: Optional[torch.Tensor], heads: int) -> Optional[torch.Tensor]:
        # [rows, H_kv] -> [rows, 1, heads, 1], broadcast over tokens and dims.
        if scale is None:
            return None
        return scale.to(compute_dtype).repeat_interleave(heads // hkv, dim=1)[:, None, :, None]

    # Keys: [rows, mk] slots -> [rows, mk, Hkv, D]
    t = torch.arange(mk, device=device)
    col = (t // p).clamp(max=width - 1)
    pages = md.page_table.to(torch.int64)[:, col].clamp(0, num_pages - 1)
    slots = pages * p + t % p
    kf = k_cache.reshape(num_pages * p, hkv, -1)[slots].to(compute_dtype)
    vf = v_cache.reshape(num_pages * p, hkv, -1)[slots].to(compute_dtype)
    if k_descale is not None:
        kf = kf * per_row(k_descale, hkv)
    if v_descale is not None:
        vf = vf * per_row(v_descale, hkv)
    kf = kf.repeat_interleave(group, dim=2)  # [rows, mk, Hq, D]
    vf = vf.repeat_interleave(group, dim=2)

    # Queries: [rows, mq] indices into q.
    cu = md.cu_seqlens_q.to(torch.int64)
    q_len = cu[1:] - cu[:-1]
    i = torch.arange(mq, device=device)
    q_index = cu[:-1, None] + i  # [rows, mq]
    q_valid = (i < q_len[:, None]) & (q_index < total_q)
    qf = q[q_index.clamp(0, max(total_q - 1, 0))].to(compute_dtype)  # [rows, mq, Hq, D]
    if q_descale is not None:
        qf = qf * per_row(q_descale, hq)

    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * softmax_scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    visible = visible_keys(md.cache_seqlens.to(torch.int64), q_len, mq, mk,
                           causal=md.causal, window_size=window_size)
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
    out_q = torch.where(owned[:, None, None], out[row, slot], 0).to(out_dtype)
    # [Hq, total_q], gathered in that order (not a transposed copy of
    # [total_q, Hq]: with one query per batch row, that copy's layout check
    # guards the batch against 1 under size-oblivious sizes).
    lse_q = torch.where(owned[None, :], lse.transpose(0, 1)[:, row, slot], float("-inf"))
    return out_q, lse_q
