"""Immutable attention metadata, registered as pytrees.

`FA3Metadata` describes one FA3 varlen call over a paged KV cache;
`CascadeMetadata` pairs a shared-prefix call with a per-branch "expand" call
whose outputs are merged by log-sum-exp. Both are frozen dataclasses whose
tensor fields are pytree children and whose static ints live in the pytree
context, so ``tree_map`` touches only tensors and a change of a static int
is a change of graph, never a silent value change.

Layout of one call (``rows`` sequences, ``W`` page-table columns)::

    query tokens   q[cu_seqlens_q[b] : cu_seqlens_q[b+1]]   belong to row b
    key t of row b page_table[b, t // page_size], offset t % page_size,
                   for 0 <= t < cache_seqlens[b]
    dead columns   page_table[b, j] == PAGE_SENTINEL for
                   j >= ceil(cache_seqlens[b] / page_size)
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
import torch.utils._pytree as pytree

#: Page id written into every column FA3 never reads (dead columns, padding
#: rows). Page 0 is the pool's reserved dummy page in engines such as sglang.
PAGE_SENTINEL = 0


@dataclasses.dataclass(frozen=True)
class FA3Metadata:
    """Metadata of one FA3 paged, varlen forward call.

    Attributes:
        page_table: int32 ``[rows, W]`` page ids (or slot ids when
            ``page_size == 1``); dead columns hold `PAGE_SENTINEL`.
        cache_seqlens: int32 ``[rows]`` keys each row attends.
        cu_seqlens_q: int32 ``[rows + 1]`` query offsets into ``q``.
        cu_seqlens_k: int32 ``[rows + 1]`` prefix sum of ``cache_seqlens``.
        max_seqlen_q: static upper bound on queries per row.
        max_seqlen_k: static upper bound on ``cache_seqlens``.
        page_size: static page size the table is expressed in; the KV cache
            is viewed as ``[-1, page_size, H_kv, D]`` for this call.
        causal: static; bottom-right aligned causal mask when True.
        window_left: static left window FA3 applies to this call (its
            ``window_size[0]``; -1 = none), bottom-right aligned: query ``i``
            of a row's ``n`` queries sits at ``cache_seqlens - n + i`` and
            sees keys ``t >= that - window_left``. Set only by the
            sliding-window builders (`fa3_spec.builders.window`), on single
            calls whose queries are consecutive positions ending at the
            row's last key, where that alignment is the true position.
    """

    page_table: torch.Tensor
    cache_seqlens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    page_size: int
    causal: bool
    window_left: int = -1

    @property
    def num_rows(self) -> int:
        return self.cache_seqlens.shape[0]

    @property
    def calls(self) -> tuple:
        """The FA3 calls this metadata describes: just this one."""
        return (self,)

    def query_rows(self, num_queries: int) -> torch.Tensor:
        """int64 ``[num_queries]``: the row owning each packed query.

        ``#{b : cu_seqlens_q[b+1] <= j}`` (a comparison-sum: inductor, torch
        2.11, cannot lower ``searchsorted`` over a sliced boundary tensor).
        Queries past ``cu_seqlens_q[-1]`` get ``rows`` (one past the end):
        callers clamp or mask.
        """
        j = torch.arange(num_queries, device=self.cu_seqlens_q.device)
        ends = self.cu_seqlens_q[1:].to(torch.int64)
        return (ends.unsqueeze(0) <= j.unsqueeze(1)).sum(dim=1)

    def read_columns(self) -> torch.Tensor:
        """bool ``[rows, W]``: the page-table columns FA3 reads,
        ``j < ceil(cache_seqlens[b] / page_size)``; all others are dead."""
        cols = torch.arange(self.page_table.shape[1], device=self.page_table.device)
        pages = (self.cache_seqlens.to(torch.int64) + self.page_size - 1) // self.page_size
        return cols < pages.unsqueeze(1)


@dataclasses.dataclass(frozen=True)
class DraftPrefixMetadata(FA3Metadata):
    """The prefix call of a tree draft step (`fa3_spec.build_draft_prefix_metadata`):
    an `FA3Metadata` that also says which draft semantics it serves.

    Attributes:
        draft_attention: static, ``"branch"`` (the prefix's whole pages; the
            branch pages hold a copy of its partial last page) or
            ``"ancestors"`` (all ``seq_len`` tokens). A draft step refuses a
            prefix built for the other semantics.
    """

    draft_attention: str = ""  # always set by `of`; a dataclass default after inherited ones

    @classmethod
    def of(cls, md: FA3Metadata, draft_attention: str) -> "DraftPrefixMetadata":
        """``md``'s call, labelled with the draft semantics it serves."""
        return cls(md.page_table, md.cache_seqlens, md.cu_seqlens_q, md.cu_seqlens_k,
                   md.max_seqlen_q, md.max_seqlen_k, md.page_size, md.causal, md.window_left,
                   draft_attention)


@dataclasses.dataclass(frozen=True)
class CascadeMetadata:
    """A two-call cascade: shared prefix, then per-query expand, LSE-merged.

    Attributes:
        prefix: one row per request; its queries are the request's ``K``
            branches (draft) or ``N`` draft tokens (tree verify).
        expand: one row per query over the draft tokens that query sees, or
            None when there is no second call.
    """

    prefix: FA3Metadata
    expand: Optional[FA3Metadata]

    @property
    def calls(self) -> tuple:
        """The FA3 calls, in order: prefix, then expand if present."""
        return (self.prefix,) if self.expand is None else (self.prefix, self.expand)


#: What a builder returns: one FA3 call, or a prefix + expand cascade.
Metadata = Union[FA3Metadata, CascadeMetadata]

_TENSOR_FIELDS = ("page_table", "cache_seqlens", "cu_seqlens_q", "cu_seqlens_k")
_STATIC_FIELDS = ("max_seqlen_q", "max_seqlen_k", "page_size", "causal", "window_left")


def _flatten_fa3(md: FA3Metadata):
    return [getattr(md, f) for f in _TENSOR_FIELDS], tuple(
        getattr(md, f) for f in _STATIC_FIELDS
    )


def _unflatten_fa3(children, context) -> FA3Metadata:
    return FA3Metadata(*children, *context)


def _flatten_prefix(md: DraftPrefixMetadata):
    children, context = _flatten_fa3(md)
    return children, context + (md.draft_attention,)


def _unflatten_prefix(children, context) -> DraftPrefixMetadata:
    return DraftPrefixMetadata(*children, *context)


def _flatten_cascade(md: CascadeMetadata):
    if md.expand is None:
        return [md.prefix], False
    return [md.prefix, md.expand], True


def _unflatten_cascade(children, has_expand) -> CascadeMetadata:
    return CascadeMetadata(children[0], children[1] if has_expand else None)


pytree.register_pytree_node(
    FA3Metadata,
    _flatten_fa3,
    _unflatten_fa3,
    serialized_type_name="fa3_spec.FA3Metadata",
)
pytree.register_pytree_node(
    DraftPrefixMetadata,
    _flatten_prefix,
    _unflatten_prefix,
    serialized_type_name="fa3_spec.DraftPrefixMetadata",
)
pytree.register_pytree_node(
    CascadeMetadata,
    _flatten_cascade,
    _unflatten_cascade,
    serialized_type_name="fa3_spec.CascadeMetadata",
)
