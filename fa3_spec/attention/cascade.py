"""Attention over fa3_spec metadata: one call, or a prefix + expand cascade."""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..metadata import CascadeMetadata, FA3Metadata
from .fa3_op import default_num_splits, fa3_paged_attention
from .merge import merge_attention_states
from .providers import fa3_available
from .reference import paged_attention_reference

BACKENDS = ("auto", "fa3", "torch")


def _check(q, k_cache, v_cache) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [total_q, H_q, D], got shape {tuple(q.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4:
            raise ValueError(f"{name} must be [num_pages, page_size, H_kv, D], got {tuple(cache.shape)}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError("k_cache and v_cache must agree on [num_pages, page_size, H_kv]")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"H_q={q.shape[1]} must be a multiple of H_kv={k_cache.shape[2]}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q head dim {q.shape[2]} != k_cache head dim {k_cache.shape[3]}")


def _resolve(backend: str, q: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "fa3" if q.is_cuda and fa3_available(q.device) else "torch"
    return backend


def _as_page_size(cache: torch.Tensor, page_size: int) -> torch.Tensor:
    """View ``cache`` ``[pages, P, H, D]`` with pages of ``page_size`` tokens."""
    if cache.shape[1] == page_size:
        return cache
    if cache.shape[1] % page_size:
        raise ValueError(f"cannot view pages of {cache.shape[1]} tokens as pages of {page_size}")
    return cache.view(-1, page_size, cache.shape[2], cache.shape[3])


def attention_call(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: FA3Metadata,
    *,
    softmax_scale: float,
    backend: str,
    num_splits: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One call: ``(out [total_q, H, Dv], lse [H, total_q])``, normalised.

    Queries that no row owns, or that see no key, get output 0 and LSE
    ``-inf`` whatever the backend (FA3 reports ``+inf`` LSE for empty rows and
    leaves unowned queries unwritten).
    """
    k_view = _as_page_size(k_cache, md.page_size)
    v_view = _as_page_size(v_cache, md.page_size)
    if backend == "torch":
        compute = torch.promote_types(q.dtype, torch.float32)  # float64 stays float64
        return paged_attention_reference(q, k_view, v_view, md, softmax_scale, compute_dtype=compute)
    splits = num_splits or default_num_splits(md.num_rows, k_cache.shape[2], md.max_seqlen_k)
    out, lse = fa3_paged_attention(
        q, k_view, v_view, md.page_table, md.cache_seqlens, md.cu_seqlens_q,
        md.max_seqlen_q, softmax_scale, md.causal, splits,
    )
    owned = torch.arange(q.shape[0], device=q.device) < md.cu_seqlens_q[-1]
    has_keys = owned.unsqueeze(0) & (lse != float("inf")) & ~torch.isnan(lse)
    lse = torch.where(has_keys, lse, float("-inf"))
    out = torch.where(has_keys.transpose(0, 1).unsqueeze(-1), out, 0)
    return out, lse


def cascade_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: Union[FA3Metadata, CascadeMetadata],
    *,
    softmax_scale: Optional[float] = None,
    backend: str = "auto",
    num_splits: Optional[int] = None,
    return_lse: bool = False,
):
    """Attention of ``q`` over the paged KV cache described by ``metadata``.

    Args:
        q: ``[total_q, H_q, D]`` in the query order of the metadata (request
            major: ``[B*K]`` draft branches, ``[B*N]`` verify tokens, ...).
        k_cache, v_cache: ``[num_pages, page_size, H_kv, D]`` (bf16/fp16 for
            FA3; any float dtype for ``"torch"``). GQA: ``H_q % H_kv == 0``.
        metadata: `FA3Metadata` (one call) or `CascadeMetadata` (prefix call
            + expand call, merged by log-sum-exp). Each call views the cache
            with its own ``page_size`` (the tree-verify expand uses 1).
        softmax_scale: default ``D ** -0.5``.
        backend: ``"fa3"`` (the custom op), ``"torch"`` (pure-PyTorch
            reference, CPU or GPU), ``"auto"`` (FA3 on sm90 if importable).
        num_splits: FA3 split count (static, >= 1); default from static bounds.
        return_lse: also return the float32 ``[H, total_q]`` LSE.

    Returns:
        ``out [total_q, H_q, D]`` in ``q.dtype`` (and ``lse``). Queries with no
        key anywhere get 0, never NaN.

    Compiles with ``fullgraph=True`` (FA3 is an opaque custom op with a fake;
    the merge is plain torch) and runs inside CUDA-graph capture.
    """
    _check(q, k_cache, v_cache)
    backend = _resolve(backend, q)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    kw = dict(softmax_scale=scale, backend=backend, num_splits=num_splits)
    if isinstance(metadata, FA3Metadata):
        out, lse = attention_call(q, k_cache, v_cache, metadata, **kw)
    elif isinstance(metadata, CascadeMetadata):
        out, lse = attention_call(q, k_cache, v_cache, metadata.prefix, **kw)
        if metadata.expand is not None:
            out_e, lse_e = attention_call(q, k_cache, v_cache, metadata.expand, **kw)
            out, lse = merge_attention_states(out, lse, out_e, lse_e)
    else:
        raise TypeError(f"metadata must be FA3Metadata or CascadeMetadata, got {type(metadata).__name__}")
    return (out, lse) if return_lse else out
