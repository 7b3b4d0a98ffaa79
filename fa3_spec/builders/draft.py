"""Modes 2 and 3: draft decode, chain (topk = 1) or tree (topk > 1).

topk = 1, step i: the draft tokens follow the prefix in the request's own
row, so one causal call over ``seq_len + i + 1`` tokens suffices.

topk > 1, step i (``d = i + 1``): a cascade of two non-causal calls::

    prefix call   row b      K queries (b's branches)  keys: whole pages of the
                                                        prefix, seq_len - last
    expand call   row b*K+t  1 query (branch t)        keys: last tail tokens
                                                        (copied into the branch's
                                                        first page) + d drafts

With ``P == 1`` there is no tail (``last = 0``) and the prefix call reads all
``seq_len`` tokens. The prefix call is identical in every step of an
iteration: build it once and reuse it (`build_draft_prefix_metadata`).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .. import _validate
from .._paged import BatchView, cdiv_tensor, cu_seqlens, in_pool, repeat_rows, uniform_cu_seqlens
from ..config import SpecConfig
from ..expand import draft_expand_page_table, draft_expand_tables
from ..metadata import PAGE_SENTINEL, CascadeMetadata, FA3Metadata
from ._common import request_call


def build_draft_prefix_metadata(
    cfg: SpecConfig,
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
) -> FA3Metadata:
    """Prefix call of a topk > 1 draft step; the same for every step.

    One row per request with ``topk`` queries, not causal; keys are the whole
    pages of the prefix (``seq_len - seq_len % P``; all ``seq_len`` when
    ``P == 1``). Shapes: page table ``[B, cfg.max_pages]``, ``cu_seqlens_q =
    arange(0, B*K + 1, K)``.
    """
    _validate.batch(cfg, req_to_token, req_pool_indices, seq_lens)
    view = BatchView(cfg, req_to_token, req_pool_indices, seq_lens)
    return _prefix(view)


def _prefix(view: BatchView) -> FA3Metadata:
    cfg = view.cfg
    return request_call(
        view,
        view.seq_lens - view.last_page_lens,
        queries_per_row=cfg.topk,
        max_seqlen_k=cfg.max_context_len,
        causal=False,
    )


def _draft_slots(cfg: SpecConfig, out_cache_loc: object, bs: int) -> torch.Tensor:
    """``out_cache_loc`` (flat, ``[B, K, S]`` or ``[B*K, S]``) as ``[B*K, S]``."""
    loc = _validate.tensor("out_cache_loc", out_cache_loc)
    rows, steps = bs * cfg.topk, cfg.num_steps
    if loc.numel() != rows * steps or loc.dim() not in (1, 2, 3):
        raise ValueError(
            f"out_cache_loc must hold B*topk*num_steps = {bs}*{cfg.topk}*"
            f"{steps} = {rows * steps} slots (flat, [B, K, S] or [B*K, S]), "
            f"got shape {tuple(loc.shape)}"
        )
    if loc.dim() > 1 and loc.shape[-1] != steps:
        raise ValueError(
            f"out_cache_loc's last dimension must be num_steps={steps}, "
            f"got shape {tuple(loc.shape)}"
        )
    return loc.reshape(rows, steps)


def build_draft_decode_metadata(
    cfg: SpecConfig,
    step: int,
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: Optional[torch.Tensor] = None,
    prefix: Optional[FA3Metadata] = None,
) -> Union[FA3Metadata, CascadeMetadata]:
    """Metadata of draft-decode ``step`` (``0 <= step <= num_steps - 2``).

    Args:
        cfg: static configuration.
        step: static draft step; ``decode_length = step + 1``.
        req_to_token, req_pool_indices, seq_lens: as in `build_decode_metadata`.
        out_cache_loc: int ``B*K*S`` draft slots in upstream's row-major
            ``[B, K, S]`` order (flat or shaped). Required when topk > 1,
            ignored when topk = 1 (drafts then follow the prefix in the row).
        prefix: the step-invariant prefix call from
            `build_draft_prefix_metadata`, to reuse across steps (topk > 1).

    Returns:
        topk = 1: `FA3Metadata`, one query per request, causal,
        ``cache_seqlens = seq_len + step + 1``.

        topk > 1: `CascadeMetadata` whose ``expand`` has ``B*K`` rows, one
        query each, page table ``[B*K, step + 2]`` from
        `draft_expand_page_table`, ``max_seqlen_k = d + P - 1``.

    Padding rows (``seq_len == 0``) read nothing in either call.
    """
    d = cfg.decode_length(step)
    bs = _validate.batch(cfg, req_to_token, req_pool_indices, seq_lens)
    view = BatchView(cfg, req_to_token, req_pool_indices, seq_lens)
    if cfg.topk == 1:
        return request_call(
            view,
            view.seq_lens + d,
            queries_per_row=1,
            max_seqlen_k=cfg.max_context_len + d,
            causal=True,
        )
    if out_cache_loc is None:
        raise ValueError("out_cache_loc is required when topk > 1")
    loc = _draft_slots(cfg, out_cache_loc, bs)
    _validate.same_device(out_cache_loc=loc, seq_lens=seq_lens)
    if prefix is None:
        prefix = _prefix(view)
    elif not isinstance(prefix, FA3Metadata) or prefix.num_rows != bs:
        raise ValueError("prefix must be the FA3Metadata of this batch's prefix call")

    k, p = cfg.topk, cfg.page_size
    cache_seqlens, page_table = draft_expand_page_table(
        loc, view.last_page_lens, decode_length=d, topk=k, page_size=p, num_pages=cfg.num_pages
    )
    cache_seqlens = view.mask_padding(cache_seqlens, k)
    expand = _expand_call(cfg, d, view.mask_padding(page_table, k), cache_seqlens,
                          uniform_cu_seqlens(bs * k, 1, loc.device), cu_seqlens(cache_seqlens))
    return CascadeMetadata(prefix=prefix, expand=expand)


def _expand_call(cfg: SpecConfig, d: int, page_table, cache_seqlens, cu_seqlens_q,
                 cu_seqlens_k) -> FA3Metadata:
    """The expand call of draft step ``d - 1``: one query per branch, not causal."""
    return FA3Metadata(
        page_table=page_table,
        cache_seqlens=cache_seqlens,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=1,
        max_seqlen_k=d + cfg.page_size - 1,
        page_size=cfg.page_size,
        causal=False,
    )


def build_draft_iteration_metadata(
    cfg: SpecConfig,
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: Optional[torch.Tensor] = None,
) -> Tuple[Union[FA3Metadata, CascadeMetadata], ...]:
    """Metadata of all ``num_steps - 1`` draft steps of one iteration, built together.

    Same values, in every column FA3 reads, as calling
    `build_draft_decode_metadata` for steps ``0 .. S-2`` (parity is tested),
    but the work shared between steps is done once: the request rows and
    prefix are gathered once, and every step's table is a slice of one
    stacked tensor (one fused kernel for all steps instead of several per
    step). Use it inside a compiled, captured draft iteration.

    Returns a tuple with one entry per step: `FA3Metadata` (topk = 1) or
    `CascadeMetadata` (topk > 1) sharing one ``prefix``. Step ``i``'s page
    table is a view ``tables[i, :, :width]`` of the stacked tensor, so its
    row stride may exceed its width (FA3 needs only a unit column stride);
    call ``.contiguous()`` on it if your consumer needs more.
    """
    bs = _validate.batch(cfg, req_to_token, req_pool_indices, seq_lens)
    view = BatchView(cfg, req_to_token, req_pool_indices, seq_lens)
    steps = cfg.num_steps - 1
    if cfg.topk == 1:
        return _chain_iteration(view, steps)
    if out_cache_loc is None:
        raise ValueError("out_cache_loc is required when topk > 1")
    loc = _draft_slots(cfg, out_cache_loc, bs)
    _validate.same_device(out_cache_loc=loc, seq_lens=seq_lens)
    k, p = cfg.topk, cfg.page_size
    prefix = _prefix(view)
    cache_seqlens, tables = draft_expand_tables(
        loc, view.last_page_lens, num_draft_steps=steps, topk=k, page_size=p,
        num_pages=cfg.num_pages,
    )
    live = repeat_rows(view.live, k)
    cache_seqlens = torch.where(live, cache_seqlens, 0)
    tables = torch.where(live.view(1, -1, 1), tables, 0)
    cu_k = _stacked_cu_seqlens(cache_seqlens)
    cu_q = uniform_cu_seqlens(bs * k, 1, loc.device)
    return tuple(
        CascadeMetadata(prefix=prefix, expand=_expand_call(
            cfg, i + 1, tables[i, :, : i + 2], cache_seqlens[i], cu_q, cu_k[i]))
        for i in range(steps)
    )


def _chain_iteration(view: BatchView, steps: int) -> Tuple[FA3Metadata, ...]:
    """topk = 1: step ``i`` is one causal call over ``seq_len + i + 1`` tokens.

    The page table is gathered once over the longest step's length and
    masked per step (one kernel for all steps' tables).
    """
    cfg = view.cfg
    d = torch.arange(1, steps + 1, device=view.seq_lens.device).view(steps, 1)
    lengths = torch.where(view.live, view.seq_lens + d, 0)  # [steps, B]
    pages = view.page_table(lengths[-1], cfg.max_pages)  # sentinel past the longest
    used = torch.arange(cfg.max_pages, device=d.device) < cdiv_tensor(lengths, cfg.page_size).unsqueeze(2)
    tables = torch.where(used, pages.unsqueeze(0), PAGE_SENTINEL)
    cache_seqlens = lengths.to(torch.int32)
    cu_k = _stacked_cu_seqlens(cache_seqlens)
    cu_q = uniform_cu_seqlens(view.batch_size, 1, d.device)
    return tuple(
        FA3Metadata(
            page_table=tables[i],
            cache_seqlens=cache_seqlens[i],
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k[i],
            max_seqlen_q=1,
            max_seqlen_k=cfg.max_context_len + i + 1,
            page_size=cfg.page_size,
            causal=True,
        )
        for i in range(steps)
    )


def _stacked_cu_seqlens(cache_seqlens: torch.Tensor) -> torch.Tensor:
    """int32 ``[steps, n + 1]`` exclusive prefix sums of each row of ``[steps, n]``."""
    return F.pad(torch.cumsum(cache_seqlens, 1, dtype=torch.int32), (1, 0))


def draft_tail_copy_slots(
    cfg: SpecConfig, *, seq_lens: torch.Tensor, out_cache_loc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots to copy so every branch's first page starts with the prefix tail.

    With ``P > 1`` and ``topk > 1`` draft token 0 of branch ``t`` sits at
    in-page offset ``last = seq_len % P`` of the branch's first page; offsets
    ``0 .. last-1`` of that page must hold the prefix's partial last page
    (branch 0's first page *is* that page). Returns ``(src, dst)``, int64
    ``[B * K * (P - 1)]``: copy K/V of slot ``src[i]`` to ``dst[i]``. Entries
    with nothing to copy have ``dst == src`` (a no-op copy), so the shapes are
    static; padding rows copy slot 0 onto itself.

    For ``P == 1`` or ``topk == 1`` there is no tail: both are empty.
    """
    p, k = cfg.page_size, cfg.topk
    sl = _validate.tensor("seq_lens", seq_lens, ndim=1)
    bs = sl.shape[0]
    loc = _draft_slots(cfg, out_cache_loc, bs).view(bs, k, cfg.num_steps).to(torch.int64)
    if p == 1 or k == 1:
        empty = torch.zeros(0, dtype=torch.int64, device=loc.device)
        return empty, empty
    last = torch.remainder(sl.to(torch.int64).clamp(min=0), p).view(bs, 1, 1)
    offset = torch.arange(p - 1, device=loc.device).view(1, 1, p - 1)
    first = loc[:, :, :1] - last  # slot of offset 0 in each branch's first page
    src = (first[:, :1] + offset).expand(bs, k, p - 1)
    dst = first + offset
    dst = torch.where((offset < last) & (sl.view(bs, 1, 1) > 0), dst, src)
    src, dst = src.clamp(min=0).reshape(-1), dst.clamp(min=0).reshape(-1)
    return in_pool(src, p, cfg.num_pages), in_pool(dst, p, cfg.num_pages)
