"""Draft decode, chain (topk = 1) or tree (topk > 1) (docs/semantics.md, "Draft decode").

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

That is the ``"branch"`` semantics (sglang's): branch ``t`` reads its own
slots, whichever leaf now occupies it. Under ``"ancestors"``
(`fa3_spec.builders.ancestors`), which reads ``ancestor_slots`` instead of
``out_cache_loc``, a leaf attends its true ancestors: the prefix call reads
all ``seq_len`` tokens and the expand call the leaf's path, from any slots.
The caller states the semantics (`draft_slots`).

One implementation serves both entry points: `build_draft_iteration_metadata`
builds steps ``0 .. S-2`` together, and `build_draft_decode_metadata` (one
step) is the last step of the same construction truncated after ``step``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .. import _validate
from ..offsets import cdiv_tensor, cu_seqlens, exclusive_sums, repeat_rows, uniform_cu_seqlens
from ..batch import SpecBatch
from ..config import SpecConfig, check_draft_attention, check_config
from ..expand import draft_expand_tables
from ..invariants import ancestor_flags, draft_layout_flags, page_flags
from ..metadata import PAGE_SENTINEL, CascadeMetadata, DraftPrefixMetadata, FA3Metadata, Metadata
from ..paged import BatchView, in_pool
from ._common import request_call
from .ancestors import ancestor_step
from .interface import Mode
from .window import window_call, window_cascade

def build_draft_prefix_metadata(
    cfg: SpecConfig,
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    draft_attention: str,
) -> DraftPrefixMetadata:
    """Prefix call of a tree draft step; the same for every step.

    One row per request with ``topk`` queries, not causal. Keys:
    ``draft_attention="branch"``, the whole pages of the prefix
    (``seq_len - seq_len % P``; all ``seq_len`` when ``P == 1``: every branch
    re-reads the partial last page from its own first page);
    ``"ancestors"``, all ``seq_len`` tokens. Shapes: page table
    ``[B, cfg.page_table_width]``, ``cu_seqlens_q = arange(0, B*K + 1, K)``.
    Pass it as ``prefix=`` to the steps of the same semantics (a step refuses
    the other's).
    """
    batch = SpecBatch.create(cfg, req_to_token=req_to_token, req_pool_indices=req_pool_indices,
                             seq_lens=seq_lens)
    return _prefix(batch.view(), check_draft_attention(draft_attention))


def _prefix_length(view: BatchView, draft_attention: str) -> torch.Tensor:
    """int64 ``[B]``: the prefix call's keys. ``"branch"``: the prefix's whole
    pages, ``seq_len - seq_len % P`` (all ``seq_len`` when ``P == 1``);
    ``"ancestors"``: all ``seq_len``."""
    if draft_attention == "ancestors":
        return view.seq_lens
    return view.seq_lens - view.last_page_lens


def _prefix(view: BatchView, draft_attention: str) -> DraftPrefixMetadata:
    cfg = view.cfg
    md = request_call(view, _prefix_length(view, draft_attention), queries_per_row=cfg.topk,
                      max_seqlen_k=cfg.max_context_len, causal=False)
    return DraftPrefixMetadata.of(md, draft_attention)


def draft_attention_of(batch: SpecBatch, step: Optional[int] = None) -> str:
    """The draft semantics ``batch`` asks for: ``"ancestors"`` when it holds
    ``ancestor_slots``, else ``"branch"``.

    Raises `ValueError` when it holds both ``out_cache_loc`` and
    ``ancestor_slots``, neither with topk > 1, or (``step`` given)
    ``ancestor_slots`` narrower than ``step + 1`` columns.
    """
    cfg = batch.cfg
    refuse_both(batch.out_cache_loc, batch.ancestor_slots)
    if batch.ancestor_slots is None:
        if cfg.topk > 1 and batch.out_cache_loc is None:
            raise ValueError(
                "draft decode with topk > 1 needs out_cache_loc (each branch attends its own "
                "slots, sglang's semantics) or ancestor_slots (each leaf attends its true "
                "ancestors); neither was given")
        return "branch"
    if step is not None and batch.ancestor_slots.shape[1] < step + 1:
        raise ValueError(f"ancestor_slots has {batch.ancestor_slots.shape[1]} columns, fewer "
                         f"than the {step + 1} depths (step + 1) that step={step} reads")
    return "ancestors"


def refuse_both(out_cache_loc, ancestor_slots) -> None:
    """`ValueError` when a draft step is given both kinds of draft slots."""
    if out_cache_loc is not None and ancestor_slots is not None:
        raise ValueError(
            "pass out_cache_loc (each branch attends its own slots) or ancestor_slots (each "
            "leaf attends its true ancestors), not both")


#: The draft-slot input each ``draft_attention`` reads.
SLOTS_OF = {"branch": "out_cache_loc", "ancestors": "ancestor_slots"}


def draft_slots(cfg: SpecConfig, draft_attention: str, inputs: dict) -> dict:
    """``inputs`` (a draft-decode step's keywords) with only the draft slots
    ``draft_attention`` reads: ``out_cache_loc`` for ``"branch"``,
    ``ancestor_slots`` for ``"ancestors"``.

    The semantics is the caller's choice, never guessed from which tensor
    came: `ValueError` when the other kind is given, or when the needed one
    is missing with topk > 1 (a chain's drafts follow the prefix in its row).
    """
    wanted = SLOTS_OF[check_draft_attention(draft_attention)]
    other = SLOTS_OF["ancestors" if draft_attention == "branch" else "branch"]
    if inputs.get(other) is not None:
        raise ValueError(f"{other} is not read with draft_attention={draft_attention!r}; "
                         f"pass {wanted}")
    if inputs.get(wanted) is None and check_config(cfg).topk > 1:
        raise ValueError(f"{wanted} is required for a draft-decode step with topk > 1 "
                         f"(draft_attention={draft_attention!r})")
    return {k: v for k, v in inputs.items() if k != other}


def build_draft_decode_metadata(
    cfg: SpecConfig,
    step: int,
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    draft_attention: str,
    out_cache_loc: Optional[torch.Tensor] = None,
    ancestor_slots: Optional[torch.Tensor] = None,
    prefix: Optional[FA3Metadata] = None,
) -> Metadata:
    """Metadata of draft-decode ``step`` (``0 <= step <= num_steps - 2``).

    Args:
        cfg: static configuration.
        step: static draft step; ``decode_length = step + 1``.
        draft_attention: what a draft leaf attends besides the prefix:
            ``"branch"`` (sglang's semantics, reads ``out_cache_loc``) or
            ``"ancestors"`` (reads ``ancestor_slots``). Required here, so
            that the semantics is stated, not read off the tensor passed;
            `fa3_spec.MetadataBuilder` binds it once.
        req_to_token, req_pool_indices, seq_lens: as in `build_decode_metadata`.
        out_cache_loc: int ``B*K*S`` draft slots in upstream's row-major
            ``[B, K, S]`` order (flat or shaped), in the layout of
            `draft_positions`: each branch attends its own first ``d``
            slots (sglang's semantics). Its values are ignored when topk = 1
            (the drafts then follow the prefix in the row), but it is still
            refused together with ``ancestor_slots``.
        ancestor_slots: int64 ``[B, K, d']`` or ``[B*K, d']``, ``d' >= d``
            (only the first ``d`` columns are read, so one ``[B, K, S-1]``
            buffer serves every step): per leaf, the slots of its ancestors
            at draft depths ``0 .. d-2`` and its own at depth ``d-1``
            (`draft_ancestor_slots`), anywhere in the pool. Each leaf
            attends the whole prefix and exactly those slots. Also works
            with topk = 1 (a chain on any slots). Give this or
            ``out_cache_loc``, never both; one of them when topk > 1.
            Without ``num_pages`` the builder trusts these values (as it
            trusts ``req_to_token``): they are cast to int32 page ids, so a
            slot >= 2**31 wraps; give ``num_pages`` to clamp them into the
            pool, and check them with `error_flags`.
        prefix: the step-invariant prefix call from
            `build_draft_prefix_metadata` of the same semantics
            (``draft_attention="ancestors"`` with ``ancestor_slots``), to
            reuse across steps.

    Returns:
        Branch, topk = 1: `FA3Metadata`, one query per request, causal,
        ``cache_seqlens = seq_len + step + 1``.

        Branch, topk > 1: `CascadeMetadata` whose ``expand`` has ``B*K``
        rows, one query each, page table ``[B*K, step + 2]`` from
        `draft_expand_page_table`, ``max_seqlen_k = d + P - 1``.

        Ancestors: `CascadeMetadata`; ``prefix`` over all ``seq_len`` tokens,
        ``expand`` ``B*K`` rows at ``page_size = 1``, page table ``[B*K, d]``
        of the ancestor slots (clamped into the pool when ``cfg.num_pages``
        is set), ``cache_seqlens = d``.

    Padding rows (``seq_len == 0``) read nothing in either call. Compiles to
    one graph with no host sync; capture-safe. Inside a captured branch-mode
    draft loop prefer `build_draft_iteration_metadata` (all steps at once);
    ancestor steps depend on the previous step's selection, so each is built
    in its turn.
    """
    slots = draft_slots(cfg, draft_attention, dict(out_cache_loc=out_cache_loc,
                                                   ancestor_slots=ancestor_slots))
    out_cache_loc, ancestor_slots = slots.get("out_cache_loc"), slots.get("ancestor_slots")
    batch = SpecBatch.create(cfg, req_to_token=req_to_token, req_pool_indices=req_pool_indices,
                             seq_lens=seq_lens,
                             out_cache_loc=out_cache_loc if cfg.topk > 1 else None,
                             ancestor_slots=ancestor_slots)
    return draft_decode_metadata(batch, step, prefix=prefix)


def draft_decode_metadata(batch: SpecBatch, step: int, *,
                          prefix: Optional[FA3Metadata] = None) -> Metadata:
    """`build_draft_decode_metadata` on a validated `SpecBatch`."""
    step = batch.cfg.check_step(step)
    attention = draft_attention_of(batch, step)
    if prefix is not None:
        _check_prefix(prefix, batch, attention)
    if attention == "ancestors":
        view = batch.view()
        return ancestor_step(view, _draft_path(batch, step),
                             prefix if prefix is not None else _prefix(view, attention))
    return _draft_steps(batch, step + 1, prefix=prefix)[step]


def _check_prefix(prefix: object, batch: SpecBatch, attention: str) -> None:
    if not isinstance(prefix, FA3Metadata) or prefix.num_rows != batch.batch_size:
        raise ValueError("prefix must be the FA3Metadata of this batch's prefix call")
    built_for = getattr(prefix, "draft_attention", None)
    if built_for != attention and (built_for is not None or attention == "ancestors"):
        raise ValueError(
            f"prefix was built for draft_attention={built_for!r} but this step attends "
            f"{attention!r}: build it with build_draft_prefix_metadata(..., "
            f"draft_attention={attention!r}) (the two read different prefix keys)")


def _draft_path(batch: SpecBatch, step: int) -> torch.Tensor:
    """int64 ``[B*K, d]``: each query's draft path at ``step`` (the branch's first
    ``d`` slots, or the leaf's ancestors), clamped into the pool."""
    cfg = batch.cfg
    slots = batch.ancestor_slots if batch.ancestor_slots is not None else batch.out_cache_loc
    return in_pool(slots[:, : cfg.decode_length(step)], cfg.page_size, cfg.num_pages)


def build_draft_iteration_metadata(
    cfg: SpecConfig,
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: Optional[torch.Tensor] = None,
) -> Tuple[Metadata, ...]:
    """Metadata of all ``num_steps - 1`` draft steps of one iteration, built together.

    Equal, bitwise, to `build_draft_decode_metadata` for steps ``0 .. S-2``
    (one implementation builds both), but the work shared between steps is
    done once: the request rows and prefix are gathered once, and every
    step's table is a slice of one stacked tensor (one fused kernel for all
    steps instead of several per step). Use it inside a compiled, captured
    draft iteration.

    Returns a tuple with one entry per step (empty when ``num_steps == 1``):
    `FA3Metadata` (topk = 1) or `CascadeMetadata` (topk > 1) sharing one
    ``prefix``. Step ``i``'s page table is a view ``tables[i, :, :width]`` of
    the stacked tensor, so its row stride may exceed its width (FA3 needs
    only a unit column stride); call ``.contiguous()`` on it if your
    consumer needs more.
    """
    batch = SpecBatch.create(cfg, req_to_token=req_to_token, req_pool_indices=req_pool_indices,
                             seq_lens=seq_lens,
                             out_cache_loc=out_cache_loc if check_config(cfg).topk > 1 else None)
    return draft_iteration_metadata(batch)


def draft_iteration_metadata(batch: SpecBatch) -> Tuple[Metadata, ...]:
    """`build_draft_iteration_metadata` on a validated `SpecBatch`."""
    if batch.ancestor_slots is not None:
        raise ValueError(
            "build_draft_iteration_metadata cannot prebuild ancestor steps: each step's "
            "ancestors depend on the previous step's selection; build each with "
            "build_draft_decode_metadata(..., ancestor_slots=...)")
    return _draft_steps(batch, batch.cfg.num_draft_decode_steps)


def _draft_steps(batch: SpecBatch, count: int,
                 prefix: Optional[FA3Metadata] = None) -> Tuple[Metadata, ...]:
    """Draft steps ``0 .. count-1``: the one implementation of draft decode."""
    view = batch.view()
    if view.cfg.topk == 1:
        return _chain_steps(view, count)
    batch.require("out_cache_loc", mode="draft_decode", condition="topk > 1")
    return _tree_steps(view, batch.out_cache_loc, count, prefix)


def _tree_steps(view: BatchView, loc: torch.Tensor, count: int,
                prefix: Optional[FA3Metadata]) -> Tuple[CascadeMetadata, ...]:
    """topk > 1: a shared prefix call, and per step an expand call whose
    table is ``tables[i, :, :expand_width(i)]`` of one stacked tensor."""
    cfg = view.cfg
    k, bs = cfg.topk, view.batch_size
    if prefix is None:
        prefix = _prefix(view, "branch")
    if count == 0:
        return ()
    cache_seqlens, tables = draft_expand_tables(
        loc[:, :count], view.last_page_lens, num_draft_steps=count, topk=k,
        page_size=cfg.page_size, num_pages=cfg.num_pages)
    live = repeat_rows(view.live, k)
    cache_seqlens = torch.where(live, cache_seqlens, 0)
    tables = torch.where(live.view(1, -1, 1), tables, PAGE_SENTINEL)
    cu_k = _branch_cu_seqlens(cache_seqlens.view(count, bs, k)[:, :, 0], k)
    cu_q = uniform_cu_seqlens(bs * k, 1, loc.device)
    return tuple(
        CascadeMetadata(prefix=prefix, expand=FA3Metadata(
            page_table=tables[i, :, : cfg.expand_width(i)],
            cache_seqlens=cache_seqlens[i],
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k[i],
            max_seqlen_q=1,
            max_seqlen_k=cfg.expand_max_seqlen_k(i),
            page_size=cfg.page_size,
            causal=False,
        ))
        for i in range(count)
    )


def _chain_steps(view: BatchView, count: int) -> Tuple[FA3Metadata, ...]:
    """topk = 1: step ``i`` is one causal call over ``seq_len + i + 1`` tokens.

    The page table is gathered once over the longest step's length and
    masked per step (one kernel for all steps' tables).
    """
    cfg = view.cfg
    if count == 0:
        return ()
    d = torch.arange(1, count + 1, device=view.seq_lens.device).view(count, 1)
    lengths = torch.where(view.live, view.seq_lens + d, 0)  # [count, B]
    pages = view.page_table(lengths[-1], cfg.page_table_width)  # sentinel past the longest
    used = torch.arange(cfg.page_table_width, device=d.device) < cdiv_tensor(lengths, cfg.page_size).unsqueeze(2)
    tables = torch.where(used, pages.unsqueeze(0), PAGE_SENTINEL)
    cache_seqlens = lengths.to(torch.int32)
    cu_k = cu_seqlens(cache_seqlens)  # [count, B + 1]
    cu_q = uniform_cu_seqlens(view.batch_size, 1, d.device)
    return tuple(
        FA3Metadata(
            page_table=tables[i],
            cache_seqlens=cache_seqlens[i],
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k[i],
            max_seqlen_q=1,
            max_seqlen_k=cfg.max_context_len + cfg.decode_length(i),
            page_size=cfg.page_size,
            causal=True,
        )
        for i in range(count)
    )


def _branch_cu_seqlens(per_request: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 ``[steps, B*K + 1]`` ``cu_seqlens_k`` of expand calls whose ``K``
    branch rows of request ``b`` all read ``per_request[:, b]`` keys.

    Row ``m = r*K + t`` starts after ``r`` whole requests and ``t`` branches
    of request ``r``: ``K * sum(per_request[:, :r]) + t * per_request[:, r]``.
    The prefix sum runs over requests (``[steps, B + 1]``, a comparison-sum,
    `exclusive_sums`) instead of a scan over all ``B*K`` rows; bitwise equal
    to ``pad(cumsum(cache_seqlens, 1, dtype=int32), (1, 0))``.
    """
    steps, bs = per_request.shape
    whole = exclusive_sums(per_request)  # int64 [steps, B + 1]
    own = F.pad(per_request.to(torch.int64), (0, 1))  # row B (t = 0 there) reads 0
    m = torch.arange(bs * topk + 1, device=per_request.device)
    r, t = torch.div(m, topk, rounding_mode="floor"), torch.remainder(m, topk)
    return (topk * whole[:, r] + t * own[:, r]).to(torch.int32)


def draft_positions(cfg: SpecConfig, seq_lens: torch.Tensor,
                    draft_attention: str) -> torch.Tensor:
    """Row positions of one iteration's draft tokens, for an allocator that keeps
    them in the request's ``req_to_token`` row.

    ``draft_attention="branch"``: int64 ``[B, K, S]``, the layout the branch
    semantics needs (docs/semantics.md, "Draft slot layout", and what checked
    mode's ``DRAFT_LAYOUT`` bit checks): the slot of draft token ``s`` of
    branch ``t`` of request ``b`` is
    ``req_to_token[row_b, draft_positions(cfg, seq_lens, "branch")[b, t, s]]``, and
    ``out_cache_loc`` lists those slots in this order.

    * ``P > 1`` and ``K > 1``: branch ``t`` owns ``ceil((last + S) / P)``
      pages starting at row position ``seq_len - last + t * that * P``
      (``last = seq_len % P``), its token ``s`` at offset ``last + s``; so
      branch 0's drafts follow the prefix on its partial last page, and every
      other branch's first page begins with ``last`` slots for a copy of it
      (`draft_tail_copy_slots`).
    * Otherwise the ``K * S`` drafts follow the prefix, branch-major.

    ``"ancestors"``: int64 ``[B, K, S - 1]``, the own slot of leaf ``t`` at
    draft step ``i`` at position ``seq_len + i * K + t`` (step-major, right
    after the prefix: the ``cfg.ancestor_draft_slots`` positions). Any other
    placement works as well; this one is compact.

    Rows must be `SpecConfig.draft_row_len_for` ``(draft_attention)`` long to
    hold them. Traceable, pure arithmetic on ``seq_lens`` (int ``[B]``).

        >>> cfg = SpecConfig(page_size=2, topk=2, num_steps=4, num_draft_tokens=4,
        ...                  max_bs=1, max_context_len=8)
        >>> draft_positions(cfg, torch.tensor([5]), "branch").tolist()   # last = 1, 3 pages a branch; ok-host: doctest
        [[[5, 6, 7, 8], [11, 12, 13, 14]]]
        >>> draft_positions(cfg, torch.tensor([5]), "ancestors").tolist()  # ok-host: doctest
        [[[5, 7, 9], [6, 8, 10]]]
    """
    cfg = check_config(cfg)
    p, k, s = cfg.page_size, cfg.topk, cfg.num_steps
    seq = _validate.tensor("seq_lens", seq_lens, ndim=1).to(torch.int64).view(-1, 1, 1)
    t = torch.arange(k, device=seq.device).view(1, k, 1)
    if check_draft_attention(draft_attention) == "ancestors":
        return seq + torch.arange(s - 1, device=seq.device).view(1, 1, s - 1) * k + t
    step = torch.arange(s, device=seq.device).view(1, 1, s)
    if p > 1 and k > 1:
        last = torch.remainder(seq, p)
        region = torch.div(last + s + p - 1, p, rounding_mode="floor") * p
        return seq - last + t * region + last + step
    return seq + t * s + step


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
    cfg = check_config(cfg)
    p, k = cfg.page_size, cfg.topk
    sl = _validate.tensor("seq_lens", seq_lens, ndim=1)
    bs = sl.shape[0]
    loc = _validate.draft_slots(cfg, out_cache_loc, bs).view(bs, k, cfg.num_steps).to(torch.int64)
    if p == 1 or k == 1:
        empty = torch.zeros(0, dtype=torch.int64, device=loc.device)
        return empty, empty
    last = torch.remainder(sl.to(torch.int64).clamp(min=0), p).view(bs, 1, 1)
    offset = torch.arange(p - 1, device=loc.device).view(1, 1, p - 1)
    first = loc[:, :, :1] - last  # slot of offset 0 in each branch's first page
    src = (first[:, :1] + offset).expand(bs, k, p - 1)
    dst = first + offset
    live = sl.view(bs, 1, 1) > 0
    dst = torch.where(offset < last, dst, src)
    # Padding rows copy slot 0 onto itself, whatever their (stale) draft slots hold.
    src, dst = torch.where(live, src, 0), torch.where(live, dst, 0)
    src, dst = src.clamp(min=0).reshape(-1), dst.clamp(min=0).reshape(-1)
    return in_pool(src, p, cfg.num_pages), in_pool(dst, p, cfg.num_pages)


class DraftDecodeMode(Mode):
    """``draft_decode``, per step: K queries per request (one per leaf). Branch
    semantics (``out_cache_loc``): a causal call over the row (topk = 1) or a
    prefix + expand cascade over each branch's slots (topk > 1). Ancestor
    semantics (``ancestor_slots``, any topk): a whole-prefix call + an expand
    call over each leaf's ancestor slots."""

    name = "draft_decode"
    inputs = ("out_cache_loc", "ancestor_slots")
    per_step = True
    required_when = "topk > 1"

    def required(self, cfg: SpecConfig) -> Tuple[str, ...]:
        return ()  # one of the two, when topk > 1: `check`

    def unused(self, cfg: SpecConfig) -> Tuple[str, ...]:
        # topk = 1: the drafts follow the prefix in the row
        return ("out_cache_loc",) if cfg.topk == 1 else ()

    def batch(self, cfg: SpecConfig, *, step: int = 0, **kwargs) -> SpecBatch:
        refuse_both(kwargs.get("out_cache_loc"), kwargs.get("ancestor_slots"))
        return super().batch(cfg, step=step, **kwargs)

    def check(self, batch: SpecBatch, step: int) -> None:
        draft_attention_of(batch, batch.cfg.check_step(step))

    def queries_per_request(self, cfg: SpecConfig) -> int:
        return cfg.topk

    def build(self, batch: SpecBatch, step: int) -> Metadata:
        return draft_decode_metadata(batch, step)

    def window(self, batch: SpecBatch, step: int, window_left: int) -> Metadata:
        view = batch.view()  # every leaf's query at seq_len + step
        cfg = view.cfg
        d = cfg.decode_length(step)
        if cfg.topk == 1 and draft_attention_of(batch, step) == "branch":
            return window_call(view, view.seq_lens + d, 1, window_left, cfg.max_context_len + d)
        path = _draft_path(batch, step)  # [B*K, d]: positions seq_len .. seq_len + d - 1
        depth = torch.full((path.shape[0],), d - 1, dtype=torch.int64, device=path.device)
        return window_cascade(view, path, depth, cfg.topk, cfg.num_steps - 2, window_left)

    def read_length(self, batch: SpecBatch, view: BatchView, step: int) -> torch.Tensor:
        attention = draft_attention_of(batch, step)
        if view.cfg.topk == 1 and attention == "branch":  # the drafts follow the prefix in the row
            return view.seq_lens + (step + 1)
        return _prefix_length(view, attention)

    def flags(self, batch: SpecBatch, view: BatchView, step: int,
              num_pages: Optional[int]) -> torch.Tensor:
        cfg = view.cfg
        d = cfg.decode_length(step)
        live = repeat_rows(view.live, cfg.topk)
        if draft_attention_of(batch, step) == "ancestors":  # page-size-1 slot ids
            path = batch.ancestor_slots[:, :d]
            pool_slots = None if num_pages is None else num_pages * cfg.page_size
            return (ancestor_flags(cfg, view, path, num_pages)
                    | page_flags(path, 1, pool_slots, live))
        if cfg.topk == 1:
            return super().flags(batch, view, step, num_pages)
        loc = batch.out_cache_loc[:, :d].to(torch.int64)
        return draft_layout_flags(cfg, view, loc) | page_flags(loc, cfg.page_size, num_pages, live)


MODE = DraftDecodeMode()
