"""sglang adapter: fa3_spec's builders filling sglang's FA3 CUDA-graph buffers.

sglang's FlashAttention backend (``FlashAttentionBackend``, sglang 0.5.23)
keeps one set of preallocated metadata buffers per backend instance (one
instance per draft step in the draft worker) and refills them in place before
each graph replay (``_apply_cuda_graph_metadata``). The functions here take
sglang's own inputs and write into buffers of exactly those shapes, making
**the same element writes with the same values** as sglang's replay code:

* the values FA3 reads come from fa3_spec's pure builders
  (`build_draft_decode_metadata`, `build_draft_iteration_metadata`,
  `build_target_verify_metadata`, `build_draft_extend_metadata`);
* elements sglang does not write keep whatever they held (stale columns stay
  stale, init-time constants stay), and columns sglang fills with values FA3
  never reads (the prefix tables' full-width gathers, the unattended draft
  slots of tree verify) get those same values.

So after any sequence of calls on the same inputs, the buffers are bitwise
equal to sglang's, whole buffers included (tested against sglang 0.5.23's own
code, fetched at test time; see ``fa3_spec/harness/sglang_upstream.py``).
Everything is traceable with ``torch.compile(fullgraph=True)``: no host sync,
no data-dependent shape; the only side effect is the ``copy_`` into the
caller's buffers, which is what CUDA-graph capture needs.

sglang's conventions, as the adapter takes them::

    req_to_token       int32 [pool_size + 1, context_len + 4 + N]; row 0 reserved
    req_pool_indices   int64 [bs] (bs = the captured bucket); padding rows: 0
    seq_lens           int64 [bs]; padding rows: 1 (the FA3 backend's fill value)
    out_cache_loc      int64 [bs * topk * num_steps], [bs, topk, num_steps] row-major
    custom_mask        bool, flat: per request N rows of seq_len + N columns
    extend_seq_lens    int32/int64 [bs]; padding rows: N

Padding rows are ordinary rows to sglang (``seq_len = 1`` reads one token of
row 0), so the adapter reproduces them as such. The one place sglang tells a
padding row apart is tree verify, where it reads the mask of every padding
query from ``custom_mask[0]``; the adapter identifies padding rows by
``req_pool_indices == SglangConfig.pad_req_pool_index`` (row 0 is never
given to a request), or by an explicit ``live_rows`` (`real_rows`).

The domain on which bitwise equality holds: ``1 <= seq_len <= context_len``
(0 is fa3_spec's own padding convention: such a row reads nothing, where
sglang, which never pads with 0, would write ``seq_len + delta``), slots
``>= 0``, ``0 <= extend_seq_len <= N``, and a ``custom_mask`` that holds
every live request's block.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ..builders import (
    build_draft_decode_metadata,
    build_draft_extend_metadata,
    build_draft_iteration_metadata,
    build_target_verify_metadata,
)
from ..builders.verify import attended_slots
from ..checks import ErrorFlag
from ..checks import error_flags as _error_flags
from ..config import SpecConfig, cdiv
from ..frozen import FrozenModule
from ..expand import page_runs
from ..metadata import CascadeMetadata, FA3Metadata
from ..paged import BatchView
from ..tree import tree_mask_from_flat

Buffers = Dict[str, Dict[str, torch.Tensor]]

#: The buffer sets of ``FlashAttentionBackend.init_cuda_graph_state`` (0.5.23).
DECODE = "decode_cuda_graph_metadata"
DRAFT_TOPK_NORMAL = "draft_decode_metadata_topk_normal"
DRAFT_TOPK_EXPAND = "draft_decode_metadata_topk_expand"
TARGET_VERIFY = "target_verify_metadata"
TARGET_VERIFY_TOPK_NORMAL = "target_verify_metadata_topk_normal"
TARGET_VERIFY_TOPK_EXPAND = "target_verify_metadata_topk_expand"
DRAFT_EXTEND = "draft_extend_metadata"
#: The modes `metadata_views` serves.
VIEW_MODES = ("draft_decode", "target_verify", "draft_extend")


class SglangConfig(FrozenModule):
    """Static configuration, in the terms of sglang's FA3 backend.

    Immutable, equal by value, and a `fa3_spec.frozen.FrozenModule`, so its
    ints stay compile-time constants in a compiled fill that takes it as an
    argument, however many configurations one process compiles.

    Args:
        page_size: ``--page-size``.
        topk: ``--speculative-eagle-topk``.
        num_steps: ``--speculative-num-steps`` (``>= 1``; with 1 there is no
            draft-decode step, and the draft-decode fills raise `ValueError`).
        num_draft_tokens: ``--speculative-num-draft-tokens`` (``N``).
        max_bs: the largest captured batch (``init_cuda_graph_state``'s).
        context_len: the backend's ``max_context_len`` (the model's context
            length; ``req_to_token`` rows are longer, ``context_len + 4 + N``).
        pad_seq_len: ``seq_len`` of padding rows
            (``get_cuda_graph_seq_len_fill_value()``; 1 for FA3).
        pad_req_pool_index: ``req_pool_indices`` of padding rows (0: the
            reserved row).
        num_pages: KV pool size in pages; when given, page ids are clamped
            into the pool (valid inputs unchanged; sglang does not clamp).
    """

    FIELDS = ("page_size", "topk", "num_steps", "num_draft_tokens", "max_bs", "context_len",
              "pad_seq_len", "pad_req_pool_index", "num_pages")

    def __init__(self, page_size: int, topk: int, num_steps: int, num_draft_tokens: int,
                 max_bs: int, context_len: int, pad_seq_len: int = 1,
                 pad_req_pool_index: int = 0, num_pages: Optional[int] = None) -> None:
        super().__init__()
        spec = SpecConfig(page_size=page_size, topk=topk, num_steps=num_steps,
                          num_draft_tokens=num_draft_tokens, max_bs=max_bs,
                          max_context_len=context_len, num_pages=num_pages)  # validates
        for name, value in (("pad_seq_len", pad_seq_len),
                            ("pad_req_pool_index", pad_req_pool_index)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self.page_size, self.topk, self.num_steps = page_size, topk, num_steps
        self.num_draft_tokens, self.max_bs, self.context_len = num_draft_tokens, max_bs, context_len
        self.pad_seq_len, self.pad_req_pool_index = pad_seq_len, pad_req_pool_index
        self.num_pages = num_pages
        self._spec = spec
        self.freeze()

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in self.FIELDS)

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other._values() == self._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={getattr(self, name)!r}" for name in self.FIELDS)

    def spec_config(self) -> SpecConfig:
        """The fa3_spec configuration the builders run with (built once)."""
        return self._spec

    @property
    def max_num_pages(self) -> int:
        """Width of sglang's request page tables: ``ceil(context_len / P)`` (sglang's
        name; narrower than fa3_spec's ``page_table_width``, which also covers the
        tokens read past ``seq_len``, and not a pool size, which is ``num_pages``)."""
        return cdiv(self.context_len, self.page_size)

    @property
    def req_to_token_width(self) -> int:
        """Row length sglang gives ``req_to_token`` (page size 1): ``context_len + 4 + N``."""
        return self.context_len + 4 + self.num_draft_tokens


class BufferSpec(NamedTuple):
    """One buffer as ``init_cuda_graph_state`` allocates it: its ``shape``, its
    ``dtype`` and its initial values, ``start + stride * i`` at row ``i``
    (zeros: both 0; an ``arange``: ``stride`` its step; a constant: ``start``)."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    start: int = 0
    stride: int = 0


def buffer_layout(cfg: SglangConfig, *, step: int = 0) -> Dict[str, Dict[str, BufferSpec]]:
    """``{set: {name: BufferSpec}}``: every buffer `allocate_buffers` allocates for
    draft step ``step``, as plain ints (what the fill functions check at trace time).

    Only the topk > 1 draft expand set depends on ``step`` (its table is
    ``step + 2`` columns wide, and its initial ``cache_seqlens`` and
    ``cu_seqlens_k`` count ``step + 1`` slots a branch).
    """
    i32, i64 = torch.int32, torch.int64
    bs, k, n, p, c = cfg.max_bs, cfg.topk, cfg.num_draft_tokens, cfg.page_size, cfg.context_len
    w, d = cfg.max_num_pages, step + 1

    def zeros(*shape):
        return BufferSpec(shape, i32)

    def offsets(rows, per_row):  # arange(0, rows * per_row + 1, per_row)
        return BufferSpec((rows + 1,), i32, 0, per_row)

    strided = BufferSpec((cdiv(c, p),), i64, 0, p)  # arange(0, context_len, P)
    out = {DECODE: dict(cache_seqlens=zeros(bs), cu_seqlens_q=offsets(bs, 1),
                        cu_seqlens_k=zeros(bs + 1), page_table=zeros(bs, w),
                        strided_indices=strided, page_table_draft_decode=zeros(bs, w))}
    if k > 1:
        out[DRAFT_TOPK_NORMAL] = dict(cache_seqlens=zeros(bs), cu_seqlens_q=offsets(bs, k),
                                      cu_seqlens_k=zeros(bs + 1), page_table=zeros(bs, c))
        out[DRAFT_TOPK_EXPAND] = dict(cache_seqlens=BufferSpec((bs * k,), i32, d),
                                      cu_seqlens_q=offsets(bs * k, 1), cu_seqlens_k=offsets(bs * k, d),
                                      page_table=zeros(bs * k, d + 1))
    out[TARGET_VERIFY] = dict(cache_seqlens=zeros(bs), cu_seqlens_q=offsets(bs, n),
                              cu_seqlens_k=zeros(bs + 1), page_table=zeros(bs, w),
                              strided_indices=strided)
    out[DRAFT_EXTEND] = dict(cache_seqlens=zeros(bs), cu_seqlens_q=zeros(bs + 1),
                             cu_seqlens_k=zeros(bs + 1), page_table=zeros(bs, w),
                             strided_indices=strided)
    if k > 1:
        out[TARGET_VERIFY_TOPK_NORMAL] = dict(cache_seqlens=zeros(bs), cu_seqlens_q=offsets(bs, n),
                                              cu_seqlens_k=zeros(bs + 1), page_table=zeros(bs, c))
        out[TARGET_VERIFY_TOPK_EXPAND] = dict(cache_seqlens=zeros(bs * n),
                                              cu_seqlens_k=zeros(bs * n + 1),
                                              cu_seqlens_q=offsets(bs * n, 1),
                                              page_table=zeros(bs * n, n))
    return out


def allocate_buffers(cfg: SglangConfig, *, step: int = 0, device="cpu") -> Buffers:
    """The buffers ``init_cuda_graph_state`` allocates, same shapes, dtypes and values.

    One set per backend instance: the draft worker has one per draft step
    (``step`` sizes the topk > 1 expand buffers, ``step + 2`` columns). Keys
    are sglang's attribute names (`DECODE`, `DRAFT_TOPK_NORMAL`, ...) and,
    inside, its dictionary keys (`buffer_layout` lists them). Not allocated
    (not metadata of these modes, or not built by this FA3 configuration):
    the SWA, encoder, local-attention and scheduler-metadata buffers, and
    the verify mask.
    """
    def make(spec: BufferSpec) -> torch.Tensor:
        if spec.stride == 0:
            return torch.full(spec.shape, spec.start, dtype=spec.dtype, device=device)
        return spec.start + spec.stride * torch.arange(spec.shape[0], dtype=spec.dtype, device=device)

    return {name: {key: make(spec) for key, spec in specs.items()}
            for name, specs in buffer_layout(cfg, step=step).items()}


def check_buffers(cfg: SglangConfig, buffers: Buffers, mode: str, *, step: int = 0) -> None:
    """Raise unless ``buffers`` holds the sets ``mode`` uses, allocated for ``step``.

    Every buffer of those sets must have `buffer_layout`'s shape and dtype
    (else ``ValueError`` / ``TypeError`` naming the buffer and what it needs).
    Shapes and dtypes only, so under ``torch.compile`` this runs at trace time
    and costs nothing. Catches buffers allocated for another draft step (a
    topk > 1 expand table of the wrong width, which FA3 would read past) or
    another configuration, and int64 buffers (FA3 reads int32 tables).
    """
    if mode not in VIEW_MODES:
        raise ValueError(f"mode must be one of {VIEW_MODES}, got {mode!r}")
    if not isinstance(buffers, dict):
        raise TypeError(f"buffers must be a dict of buffer sets (allocate_buffers), "
                        f"got {type(buffers).__name__}")
    layout = buffer_layout(cfg, step=step)
    for name in _SETS[mode, cfg.topk > 1]:
        have = buffers.get(name)
        if not isinstance(have, dict):
            raise ValueError(f"buffers has no {name!r} set, which {mode} needs "
                             f"(allocate_buffers(cfg, step={step}))")
        for key, spec in layout[name].items():
            t = have.get(key)
            label = f"buffers[{name!r}][{key!r}]"
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{label} is missing (allocate_buffers(cfg, step={step}))")
            if t.dtype != spec.dtype:
                raise TypeError(f"{label} must have dtype {spec.dtype}, got {t.dtype}")
            if tuple(t.shape) != spec.shape:
                width = f" (width {spec.shape[-1]})" if len(spec.shape) == 2 else ""
                where = f"draft step {step}" if mode == "draft_decode" else mode
                raise ValueError(
                    f"{label} has shape {tuple(t.shape)} but {where} needs {spec.shape}{width}: "
                    f"allocate its set with allocate_buffers(cfg, step={step})")


#: The buffer sets each mode fills and reads, by (mode, topk > 1).
_SETS = {
    ("draft_decode", False): (DECODE,),
    ("draft_decode", True): (DRAFT_TOPK_NORMAL, DRAFT_TOPK_EXPAND),
    ("target_verify", False): (TARGET_VERIFY,),
    ("target_verify", True): (TARGET_VERIFY_TOPK_NORMAL, TARGET_VERIFY_TOPK_EXPAND),
    ("draft_extend", False): (DRAFT_EXTEND,),
    ("draft_extend", True): (DRAFT_EXTEND,),
}


# ----------------------------------------------------------------------- modes
def draft_decode(cfg: SglangConfig, buffers: Buffers, step: int, *, req_to_token: torch.Tensor,
                 req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                 out_cache_loc: Optional[torch.Tensor] = None) -> None:
    """Fill draft step ``step``'s buffers as ``_apply_cuda_graph_metadata`` does.

    ``buffers`` is that step's set (`allocate_buffers` with the same
    ``step``). topk = 1: `DECODE`'s ``cache_seqlens`` (``seq_len + step +
    1``), ``cu_seqlens_k`` and the live columns of ``page_table_draft_decode``.
    topk > 1: `DRAFT_TOPK_NORMAL` (prefix: ``cache_seqlens = seq_len - seq_len
    % P`` and the table's ``ceil(context_len / P)`` columns, all of them, as
    sglang gathers them) and `DRAFT_TOPK_EXPAND` (``P > 1``: ``cache_seqlens =
    step + 1 + seq_len % P`` and one column per distinct page of the branch's
    first ``step + 1`` slots; ``P == 1``: the first ``step + 1`` columns are
    the slots, ``cache_seqlens`` keeps its init value ``step + 1``).
    ``out_cache_loc``: ``bs * topk * num_steps`` slots (topk > 1 only).
    Buffers of another step or configuration are refused (`check_buffers`).
    """
    spec = cfg.spec_config()
    spec.check_step(step)
    check_buffers(cfg, buffers, "draft_decode", step=step)
    kwargs = dict(req_to_token=req_to_token, req_pool_indices=req_pool_indices, seq_lens=seq_lens)
    if cfg.topk == 1:
        _write_chain(buffers[DECODE],
                     build_draft_decode_metadata(spec, step, draft_attention="branch", **kwargs),
                     table="page_table_draft_decode")
        return
    casc = build_draft_decode_metadata(spec, step, draft_attention="branch",
                                       out_cache_loc=out_cache_loc, **kwargs)
    _write_draft_prefix(cfg, buffers, casc.prefix, req_to_token, req_pool_indices, seq_lens)
    _write_draft_expand(cfg, buffers, casc.expand, _runs(cfg, out_cache_loc, seq_lens.shape[0]),
                        step)


def draft_iteration(cfg: SglangConfig, step_buffers: Sequence[Buffers], *,
                    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                    seq_lens: torch.Tensor, out_cache_loc: Optional[torch.Tensor] = None) -> None:
    """`draft_decode` for every draft step at once (``step_buffers[i]`` is step ``i``'s set).

    The replay-time metadata of a whole draft iteration (sglang's
    ``FlashAttentionMultiStepBackend.init_forward_metadata_out_graph``),
    built with `build_draft_iteration_metadata`: the prefix once, every
    step's expand table in one fused pass. Same writes as calling
    `draft_decode` per step.
    """
    if len(step_buffers) != cfg.num_steps - 1:
        raise ValueError(f"step_buffers must hold num_steps - 1 = {cfg.num_steps - 1} sets, "
                         f"got {len(step_buffers)}")
    for step, buffers in enumerate(step_buffers):
        check_buffers(cfg, buffers, "draft_decode", step=step)
    steps = build_draft_iteration_metadata(
        cfg.spec_config(), req_to_token=req_to_token, req_pool_indices=req_pool_indices,
        seq_lens=seq_lens, out_cache_loc=out_cache_loc)
    runs = None if cfg.topk == 1 else _runs(cfg, out_cache_loc, seq_lens.shape[0])
    for step, (buffers, md) in enumerate(zip(step_buffers, steps)):
        if cfg.topk == 1:
            _write_chain(buffers[DECODE], md, table="page_table_draft_decode")
        else:
            _write_draft_prefix(cfg, buffers, md.prefix, req_to_token, req_pool_indices, seq_lens)
            _write_draft_expand(cfg, buffers, md.expand, runs, step)


def target_verify(cfg: SglangConfig, buffers: Buffers, *, req_to_token: torch.Tensor,
                  req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                  custom_mask: Optional[torch.Tensor] = None,
                  live_rows: Optional[torch.Tensor] = None) -> None:
    """Fill the target-verify buffers as ``_apply_cuda_graph_metadata`` does.

    topk = 1 (chain; ``custom_mask`` ignored): `TARGET_VERIFY`'s
    ``cache_seqlens = seq_len + N``, ``cu_seqlens_k`` and the live page
    columns. topk > 1 (tree): `TARGET_VERIFY_TOPK_NORMAL` (prefix over
    ``seq_len``: ``cache_seqlens``, ``cu_seqlens_k[1:]``, live page columns)
    and `TARGET_VERIFY_TOPK_EXPAND`: row ``b*N + j`` lists the slots of the
    draft tokens query ``j`` attends, ascending, then (columns FA3 does not
    read, written by sglang all the same) the slots of the others, ascending::

        tree 0 <- 1, 0 <- 2 <- 3      row j=2: [s0 s2 | s1 s3]   cache_seqlens 2

    ``custom_mask``: sglang's flat bool mask (required for topk > 1).
    ``live_rows``: bool ``[bs]``, False for padding rows, whose mask sglang
    reads from ``custom_mask[0]``; default `real_rows` (by request index).
    """
    spec, n = cfg.spec_config(), cfg.num_draft_tokens
    check_buffers(cfg, buffers, "target_verify")
    kwargs = dict(req_to_token=req_to_token, req_pool_indices=req_pool_indices, seq_lens=seq_lens)
    if cfg.topk == 1:
        _write_chain(buffers[TARGET_VERIFY], build_target_verify_metadata(spec, **kwargs))
        return
    if custom_mask is None:
        raise ValueError("custom_mask is required when topk > 1 (tree verify)")
    if live_rows is None:
        live_rows = real_rows(cfg, req_pool_indices)
    mask = tree_mask_from_flat(custom_mask, seq_lens, n)
    first = custom_mask[:1].view(1, 1, 1) if custom_mask.numel() else torch.zeros(
        1, 1, 1, dtype=torch.bool, device=custom_mask.device)
    mask = torch.where(live_rows.view(-1, 1, 1), mask, first)
    casc = build_target_verify_metadata(spec, tree_mask=mask, **kwargs)

    bs = seq_lens.shape[0]
    normal, expand = buffers[TARGET_VERIFY_TOPK_NORMAL], buffers[TARGET_VERIFY_TOPK_EXPAND]
    normal["cache_seqlens"][:bs].copy_(casc.prefix.cache_seqlens)
    normal["cu_seqlens_k"][1:bs + 1].copy_(casc.prefix.cu_seqlens_k[1:])
    _write_live_columns(normal["page_table"][:bs], casc.prefix)

    # Columns past cache_seqlens: the unattended draft slots, ascending, as sglang
    # writes them (its own seq_lens, slots unclamped).
    view = BatchView(spec, req_to_token, req_pool_indices, seq_lens)
    positions = seq_lens.to(torch.int64).unsqueeze(1) + torch.arange(n, device=seq_lens.device)
    every, _ = attended_slots(view.raw_slots(positions), mask)
    read = casc.expand.read_columns()
    expand["page_table"][:bs * n].copy_(
        torch.where(read, casc.expand.page_table, every.reshape(bs * n, n).to(torch.int32)))
    expand["cache_seqlens"][:bs * n].copy_(casc.expand.cache_seqlens)
    expand["cu_seqlens_k"][1:bs * n + 1].copy_(casc.expand.cu_seqlens_k[1:])


def draft_extend(cfg: SglangConfig, buffers: Buffers, *, req_to_token: torch.Tensor,
                 req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                 extend_seq_lens: torch.Tensor) -> None:
    """Fill `DRAFT_EXTEND` as sglang's draft-extend replay does (draft extend v2).

    That replay is ``_apply_cuda_graph_metadata`` (out of the graph:
    ``cache_seqlens = seq_len``, which already counts the accepted tokens,
    ``cu_seqlens_k[1:]``, ``cu_seqlens_q[1:]`` from ``extend_seq_lens``, all
    ``ceil(context_len / P)`` page columns), then the kernel recorded in the
    graph (``draft_extend_set_metadata``), which rewrites the live part with
    equal values and also writes ``cu_seqlens_q[0] = cu_seqlens_k[0] = 0``.
    """
    check_buffers(cfg, buffers, "draft_extend")
    md = build_draft_extend_metadata(
        cfg.spec_config(), req_to_token=req_to_token, req_pool_indices=req_pool_indices,
        seq_lens=seq_lens, extend_seq_lens=extend_seq_lens)
    bs, buf = seq_lens.shape[0], buffers[DRAFT_EXTEND]
    buf["cache_seqlens"][:bs].copy_(md.cache_seqlens)
    buf["cu_seqlens_k"][:bs + 1].copy_(md.cu_seqlens_k)
    buf["cu_seqlens_q"][:bs + 1].copy_(md.cu_seqlens_q)
    view = BatchView(cfg.spec_config(), req_to_token, req_pool_indices, seq_lens)
    buf["page_table"][:bs].copy_(view.full_page_table(cfg.max_num_pages))


# ---------------------------------------------------------------- read views
def metadata_views(cfg: SglangConfig, buffers: Buffers, mode: str, *, step: int = 0,
                   bs: Optional[int] = None) -> Union[FA3Metadata, CascadeMetadata]:
    """The metadata sglang's FA3 calls read, as views of sglang's own buffers.

    What ``_bind_metadata_buffers`` binds for a captured batch of ``bs`` rows
    (default ``cfg.max_bs``): every tensor is a slice of a tensor in
    ``buffers`` (no copy), so whatever fills the buffers in place (sglang's
    replay functions, or this module's fill functions) is what an attention
    call on these views reads, captured in a CUDA graph or not. The static
    ints (``max_seqlen_q``, ``max_seqlen_k``, ``page_size``, ``causal``) are
    those of fa3_spec's builder for the mode, so the views drive the same
    attention call as the builders' metadata::

        mode            topk = 1                       topk > 1 (prefix, expand)
        draft_decode    DECODE, page_table_draft_decode DRAFT_TOPK_NORMAL, DRAFT_TOPK_EXPAND
        target_verify   TARGET_VERIFY                  TARGET_VERIFY_TOPK_NORMAL, _EXPAND
        draft_extend    DRAFT_EXTEND                   DRAFT_EXTEND

    Page tables keep sglang's widths (``ceil(context_len / P)`` columns; the
    topk > 1 prefixes ``context_len``); FA3 reads ``ceil(cache_seqlens / P)``
    of them. Not every buffer sglang binds is written by its replay: the
    topk > 1 draft prefix's ``cu_seqlens_k`` keeps its init value (FA3's
    paged call does not read it).

    Args:
        cfg: the backend's configuration.
        buffers: one backend instance's buffers (`allocate_buffers` or
            ``UpstreamBackend.buffers``); for ``draft_decode`` the set of
            draft step ``step``.
        mode: ``"draft_decode"``, ``"target_verify"`` or ``"draft_extend"``.
        step: draft step (``draft_decode`` only).
        bs: captured batch size, ``1 <= bs <= cfg.max_bs``.

    Returns:
        `FA3Metadata` (topk = 1, and ``draft_extend``) or `CascadeMetadata`.
    """
    spec, k, n, p, c = cfg.spec_config(), cfg.topk, cfg.num_draft_tokens, cfg.page_size, cfg.context_len
    bs = spec.check_batch_size(cfg.max_bs if bs is None else bs, minimum=1)
    if mode not in VIEW_MODES:
        raise ValueError(f"mode must be one of {VIEW_MODES}, got {mode!r}")
    if mode == "draft_decode":
        spec.check_step(step)
    check_buffers(cfg, buffers, mode, step=step if mode == "draft_decode" else 0)

    def view(name, rows, table="page_table", page_size=p, **statics):
        buf = buffers[name]
        return FA3Metadata(page_table=buf[table][:rows], cache_seqlens=buf["cache_seqlens"][:rows],
                           cu_seqlens_q=buf["cu_seqlens_q"][:rows + 1],
                           cu_seqlens_k=buf["cu_seqlens_k"][:rows + 1], page_size=page_size,
                           **statics)

    if mode == "draft_extend":
        return view(DRAFT_EXTEND, bs, max_seqlen_q=n, max_seqlen_k=c, causal=True)
    if mode == "draft_decode" and k == 1:
        return view(DECODE, bs, table="page_table_draft_decode", max_seqlen_q=1,
                    max_seqlen_k=c + spec.decode_length(step), causal=True)
    if mode == "draft_decode":
        prefix = view(DRAFT_TOPK_NORMAL, bs, max_seqlen_q=k, max_seqlen_k=c, causal=False)
        expand = view(DRAFT_TOPK_EXPAND, bs * k, max_seqlen_q=1,
                      max_seqlen_k=spec.expand_max_seqlen_k(step), causal=False)
        return CascadeMetadata(prefix=prefix, expand=expand)
    if k == 1:
        return view(TARGET_VERIFY, bs, max_seqlen_q=n, max_seqlen_k=c + n, causal=True)
    prefix = view(TARGET_VERIFY_TOPK_NORMAL, bs, max_seqlen_q=n, max_seqlen_k=c, causal=False)
    expand = view(TARGET_VERIFY_TOPK_EXPAND, bs * n, page_size=1, max_seqlen_q=1, max_seqlen_k=n,
                  causal=False)  # the expand table holds slots
    return CascadeMetadata(prefix=prefix, expand=expand)


# ------------------------------------------------------------------- padding
def real_rows(cfg: SglangConfig, req_pool_indices: torch.Tensor) -> torch.Tensor:
    """bool ``[bs]``: True for real requests, False for sglang's padding rows.

    sglang's runners pad a batch up to its captured bucket with
    ``req_pool_indices = 0`` (a row never given to a request) and ``seq_len =
    pad_seq_len``; the request index is what tells the rows apart (a real
    request may well have ``seq_len == 1``).
    """
    return req_pool_indices != cfg.pad_req_pool_index


def pad_batch(cfg: SglangConfig, bucket: int, *, req_pool_indices: torch.Tensor,
              seq_lens: torch.Tensor, out_cache_loc: Optional[torch.Tensor] = None,
              extend_seq_lens: Optional[torch.Tensor] = None) -> dict:
    """Pad a batch of ``raw_bs`` requests to ``bucket`` rows as sglang's runners do.

    Padding rows get ``req_pool_indices = pad_req_pool_index``, ``seq_len =
    pad_seq_len``, draft slots 0 (``out_cache_loc``, ``topk * num_steps``
    per request) and ``extend_seq_len = N``. Returns the padded keywords.
    """
    raw = seq_lens.shape[0]
    if not raw <= bucket <= cfg.max_bs:
        raise ValueError(f"bucket must be in [{raw}, max_bs={cfg.max_bs}], got {bucket}")
    pad = bucket - raw

    def grow(x, value, per_row=1):
        return torch.cat([x.reshape(-1), x.new_full((pad * per_row,), value)])

    out = dict(req_pool_indices=grow(req_pool_indices, cfg.pad_req_pool_index),
               seq_lens=grow(seq_lens, cfg.pad_seq_len))
    if out_cache_loc is not None:
        out["out_cache_loc"] = grow(out_cache_loc, 0, cfg.topk * cfg.num_steps)
    if extend_seq_lens is not None:
        out["extend_seq_lens"] = grow(extend_seq_lens, cfg.num_draft_tokens)
    return out


def error_flags(cfg: SglangConfig, mode: str, *, req_to_token: torch.Tensor,
                req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, step: int = 0,
                out_cache_loc: Optional[torch.Tensor] = None,
                custom_mask: Optional[torch.Tensor] = None,
                extend_seq_lens: Optional[torch.Tensor] = None,
                live_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`fa3_spec.error_flags` on sglang's inputs, padding rows exempt.

    Padding rows (``live_rows`` False; default: by request index) are given
    ``seq_len = 0``, fa3_spec's own padding convention, which every value
    check exempts; their draft slots (0) and masks would otherwise be
    flagged. ``custom_mask`` is sglang's flat tree-verify mask (topk > 1).
    Also flags (``SEQ_LEN_OUT_OF_RANGE``) a live chain row (topk = 1) whose
    verify or draft keys pass sglang's ``ceil(context_len / P)``-page tables.
    """
    if live_rows is None:
        live_rows = real_rows(cfg, req_pool_indices)
    spec = cfg.spec_config()
    tree_mask = None
    if mode == "target_verify" and cfg.topk > 1:
        if custom_mask is None:
            raise ValueError("custom_mask is required when topk > 1 (tree verify)")
        tree_mask = tree_mask_from_flat(custom_mask, seq_lens, cfg.num_draft_tokens)
    masked = torch.where(live_rows, seq_lens, torch.zeros_like(seq_lens))
    flags = _error_flags(spec, mode, req_to_token=req_to_token, req_pool_indices=req_pool_indices,
                         seq_lens=masked, step=step, out_cache_loc=out_cache_loc,
                         tree_mask=tree_mask, extend_seq_lens=extend_seq_lens)
    # sglang's request tables are ceil(context_len / P) pages wide: a chain call
    # (topk = 1) reading seq_len + N (verify) or seq_len + step + 1 (draft) keys
    # must fit in them, or FA3 would read past the row.
    reach = 0
    if cfg.topk == 1 and mode == "target_verify":
        reach = cfg.num_draft_tokens
    elif cfg.topk == 1 and mode == "draft_decode":
        reach = step + 1
    over = live_rows & (seq_lens.to(torch.int64) + reach > cfg.max_num_pages * cfg.page_size)
    return flags | over.any().to(torch.int32) * int(ErrorFlag.SEQ_LEN_OUT_OF_RANGE)


# ------------------------------------------------------------------- helpers
def _write_live_columns(dst: torch.Tensor, md: FA3Metadata) -> None:
    """Write the columns FA3 reads of ``md``'s table into ``dst``; keep the rest.

    sglang's request-table kernels write ``ceil(cache_seqlens / P)`` columns
    (at most ``dst``'s width) and leave the others as they were.
    """
    width = min(dst.shape[1], md.page_table.shape[1])
    read = md.read_columns()[:, :width]
    dst[:, :width].copy_(torch.where(read, md.page_table[:, :width], dst[:, :width]))


def _write_chain(buf: Dict[str, torch.Tensor], md: FA3Metadata, table: str = "page_table") -> None:
    """A one-call mode filled by sglang's fused decode kernel (``normal_decode_set_metadata``)."""
    bs = md.num_rows
    buf["cache_seqlens"][:bs].copy_(md.cache_seqlens)
    buf["cu_seqlens_k"][:bs + 1].copy_(md.cu_seqlens_k)
    _write_live_columns(buf[table][:bs], md)


def _write_draft_prefix(cfg: SglangConfig, buffers: Buffers, prefix: FA3Metadata,
                        req_to_token, req_pool_indices, seq_lens) -> None:
    """The topk > 1 prefix buffers: ``cache_seqlens``, and every one of the
    ``ceil(context_len / P)`` page columns, as sglang's torch gather writes them."""
    normal, bs = buffers[DRAFT_TOPK_NORMAL], prefix.num_rows
    normal["cache_seqlens"][:bs].copy_(prefix.cache_seqlens)
    view = BatchView(cfg.spec_config(), req_to_token, req_pool_indices, seq_lens)
    w = cfg.max_num_pages
    normal["page_table"][:bs, :w].copy_(view.full_page_table(w))


def _runs(cfg: SglangConfig, out_cache_loc, bs: int) -> torch.Tensor:
    """int64 ``[bs * K, S - 1]``: distinct consecutive pages among each branch's
    first d slots (`fa3_spec.expand.page_runs`, on sglang's unclamped slots).

    The columns of the expand table sglang's scatter writes at step ``d - 1``
    are ``0 .. runs[:, d - 1] - 1``.
    """
    loc = out_cache_loc.reshape(bs * cfg.topk, cfg.num_steps)[:, :cfg.num_steps - 1]
    return page_runs(loc, cfg.page_size)[2]


def _write_draft_expand(cfg: SglangConfig, buffers: Buffers, expand: FA3Metadata,
                        runs: torch.Tensor, step: int) -> None:
    buf, n, d = buffers[DRAFT_TOPK_EXPAND], expand.num_rows, step + 1
    table = buf["page_table"][:n]
    if cfg.page_size == 1:
        # sglang copies the d slots and writes nothing else (cache_seqlens
        # keeps its init value d, which is what the builder computes).
        table[:, :d].copy_(expand.page_table[:, :d])
        return
    buf["cache_seqlens"][:n].copy_(expand.cache_seqlens)
    written = torch.arange(table.shape[1], device=table.device) < runs[:, step:step + 1]
    table.copy_(torch.where(written, expand.page_table[:, :table.shape[1]], table))
