"""Static configuration of a speculative-decoding deployment.

`SpecConfig` is the one place where static bounds are derived. Every tensor
shape a builder produces is a function of these numbers and of input shapes,
never of tensor values, so a builder traces to a single graph per
configuration and can be captured in a CUDA graph.

Notation used throughout the package (docs/semantics.md):

    P  page_size           tokens per KV page
    K  topk                draft branches per request
    S  num_steps           draft tokens per branch per iteration: the draft
                           extend proposes the first, then S - 1 draft-decode
                           calls, ``step = 0 .. S-2``, each reading
                           ``d = step + 1`` draft tokens per branch
    N  num_draft_tokens    tokens checked by target verify
    C  max_context_len     largest ``seq_len`` a request may have

Three page counts, three meanings: ``num_pages`` is the KV pool's size (a
field, optional); ``page_table_width`` the columns of a request-level page
table (derived); sglang's ``max_num_pages`` (`SglangConfig`) is the width of
*its* request tables, ``ceil(context_len / P)``.

Under ``torch.compile`` a configuration's ints are compile-time constants
when the compiled code reaches them through a `fa3_spec.MetadataBuilder`
(an ``nn.Module``, whose int attributes dynamo specialises); a bare
`SpecConfig` passed as an argument of a compiled function is specialised
on its first configuration only (docs/graphs.md, "Static configuration").
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ._validate import int_at_least as _require_int, int_in_range

#: What a tree draft step attends besides the prefix (docs/semantics.md, "Draft
#: decode"): ``"branch"``, the branch's own slots (sglang's semantics, and its
#: slot layout); ``"ancestors"``, the leaf's true ancestors, from any slots.
DRAFT_ATTENTION = ("branch", "ancestors")

def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative Python ints."""
    return -(-a // b)


def check_draft_attention(value: object) -> str:
    """``value`` must be one of `DRAFT_ATTENTION` (`ValueError` naming ``draft_attention``)."""
    if value not in DRAFT_ATTENTION:
        raise ValueError(f"draft_attention must be one of {DRAFT_ATTENTION}, got {value!r}")
    return value


def check_config(cfg: object) -> "SpecConfig":
    """``cfg`` itself, after checking that it is a `SpecConfig` (`TypeError` naming it)."""
    if not isinstance(cfg, SpecConfig):
        raise TypeError(f"cfg must be a SpecConfig, got {type(cfg).__name__}")
    return cfg


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static shape configuration, validated on construction.

    Args:
        page_size: KV page size ``P`` (>= 1; any value, not only powers of two).
        topk: draft branching ``K`` (>= 1). ``topk > 1`` drafts a tree and
            uses cascade (prefix + expand) attention.
        num_steps: draft tokens ``S`` per branch per iteration (>= 1). The
            draft extend proposes the first (the root's top-K children);
            the ``S - 1`` draft-decode calls that follow are the builders'
            ``step = 0 .. S-2`` (none when ``S == 1``), and step ``i`` reads
            ``d = i + 1`` draft tokens of each branch.
        num_draft_tokens: tokens ``N`` verified by the target model (>= 1).
        max_bs: largest batch a builder accepts (>= 1).
        max_context_len: largest ``seq_len`` ``C`` of a request (>= 1).
        num_pages: KV pool size in pages of ``page_size`` (optional, >= 1;
            `pool_pages` sizes a pool that reserves whole rows), not to be
            confused with `page_table_width`, the columns of a page table.
            When given, every page id a builder writes is clamped into
            ``[0, num_pages)`` (slot ids of the tree-verify expand call into
            ``[0, num_pages * P)``), so FA3 never reads outside the pool,
            whatever ``req_to_token`` or ``out_cache_loc`` hold. Valid inputs
            are unchanged. Without it, builders trust the slot values they
            are given (their own indexing stays in range either way); see
            `fa3_spec.error_flags` to detect bad values instead.

    Example:
        >>> cfg = SpecConfig(page_size=2, topk=8, num_steps=5,
        ...                  num_draft_tokens=6, max_bs=64, max_context_len=8192)
        >>> cfg.tokens_past_seq_len, cfg.min_row_len, cfg.page_table_width
        (6, 8198, 4099)
        >>> cfg.expand_width(step=3), cfg.expand_pages_bound(decode_length=4)
        (5, 3)
    """

    page_size: int
    topk: int
    num_steps: int
    num_draft_tokens: int
    max_bs: int
    max_context_len: int
    num_pages: Optional[int] = None

    def __post_init__(self) -> None:
        _require_int("page_size", self.page_size, 1)
        _require_int("topk", self.topk, 1)
        _require_int("num_steps", self.num_steps, 1)
        _require_int("num_draft_tokens", self.num_draft_tokens, 1)
        _require_int("max_bs", self.max_bs, 1)
        _require_int("max_context_len", self.max_context_len, 1)
        if self.num_pages is not None:
            _require_int("num_pages", self.num_pages, 1)

    # ------------------------------------------------------------------ bounds
    @property
    def num_draft_decode_steps(self) -> int:
        """Draft-decode calls per iteration: ``S - 1`` (steps ``0 .. S-2``)."""
        return self.num_steps - 1

    @property
    def tokens_past_seq_len(self) -> int:
        """Tokens a mode may read past ``seq_len`` in a request's own row:
        ``max(S - 1, N)`` (topk = 1 draft decode, chain verify). Not a
        sliding window (that is ``window_left``, a per-call argument)."""
        return max(self.num_steps - 1, self.num_draft_tokens)

    @property
    def min_row_len(self) -> int:
        """Shortest ``req_to_token`` row the builders accept: ``C + tokens_past_seq_len``."""
        return self.max_context_len + self.tokens_past_seq_len

    @property
    def page_table_width(self) -> int:
        """Columns of every request-level page table: ``ceil(min_row_len / P)``
        (not the pool size, which is ``num_pages``)."""
        return cdiv(self.min_row_len, self.page_size)

    @property
    def pages_per_branch(self) -> int:
        """Static upper bound on pages one draft branch occupies.

        docs/semantics.md: a branch's region is ``ceil((last + S) / P)`` pages with
        ``last = seq_len % P <= P - 1``; this is its maximum over ``last``.
        """
        return cdiv(self.page_size - 1 + self.num_steps, self.page_size)

    @property
    def draft_row_len(self) -> int:
        """``req_to_token`` row length that also holds every draft slot.

        With ``P > 1`` and ``K > 1`` each branch gets its own page-aligned
        region starting at ``seq_len - last``; otherwise the ``K * S`` draft
        slots follow the prefix contiguously. Builders do not need rows this
        long (they read draft slots from ``out_cache_loc``); allocators do.
        """
        if self.page_size > 1 and self.topk > 1:
            drafts = self.topk * self.pages_per_branch * self.page_size
        else:
            drafts = self.topk * self.num_steps
        return max(self.min_row_len, self.max_context_len + drafts)

    @property
    def ancestor_draft_slots(self) -> int:
        """Draft slots a request writes per iteration when the tree draft attends
        its true ancestors (``draft_attention="ancestors"``): ``K * (S - 1)``,
        one per leaf and draft-decode step, anywhere in the pool (no layout,
        no per-branch pages, no tail copy)."""
        return self.topk * self.num_draft_decode_steps

    def draft_row_len_for(self, draft_attention: str) -> int:
        """``req_to_token`` row length that also holds every draft slot of an
        iteration, for an allocator that keeps them in the request's row.

        ``"branch"``: `draft_row_len` (the per-branch layout of
        `fa3_spec.draft_positions`). ``"ancestors"``: the ``K * (S - 1)``
        draft slots follow the prefix, ``max(min_row_len, C + K * (S - 1))``.

            >>> cfg = SpecConfig(page_size=16, topk=8, num_steps=5, num_draft_tokens=6,
            ...                  max_bs=64, max_context_len=8192)
            >>> cfg.draft_row_len_for("branch"), cfg.draft_row_len_for("ancestors")
            (8448, 8224)
        """
        if check_draft_attention(draft_attention) == "branch":
            return self.draft_row_len
        return max(self.min_row_len, self.max_context_len + self.ancestor_draft_slots)

    def with_shape(self, topk: int, num_steps: int, num_draft_tokens: int) -> "SpecConfig":
        """This configuration drafting another tree shape (same pages, context
        bound and batch bound), validated as any other."""
        return dataclasses.replace(self, topk=topk, num_steps=num_steps,
                                   num_draft_tokens=num_draft_tokens)

    def pool_pages(self, max_reqs: int, draft_attention: str) -> int:
        """KV pool size, in pages, that gives each of ``max_reqs`` requests a whole
        row of its own: ``1 + max_reqs * ceil(draft_row_len_for(draft_attention) / P)``.

        Page 0 is the reserved sentinel page (padding rows and dead columns
        point at it), hence the ``1 +``. The size to pass as ``num_pages``
        when an allocator reserves every row in full, as the EAGLE loop does.

            >>> SpecConfig(page_size=2, topk=8, num_steps=5, num_draft_tokens=6,
            ...            max_bs=64, max_context_len=8192).pool_pages(4, "branch")
            16481
        """
        return 1 + _require_int("max_reqs", max_reqs, 1) * cdiv(
            self.draft_row_len_for(draft_attention), self.page_size)

    def check_step(self, step: object) -> int:
        """Validate a draft-decode step index (``0 <= step <= S - 2``)."""
        if self.num_draft_decode_steps == 0:
            int_in_range("step", step, 0, 0)  # type check first
            raise ValueError("num_steps=1 has no draft-decode step")
        return int_in_range("step", step, 0, self.num_steps - 2,
                            f" for num_steps={self.num_steps}")

    def check_batch_size(self, bs: object, *, minimum: int = 0) -> int:
        """Validate a batch size: a Python int, ``minimum <= bs <= max_bs``."""
        return int_in_range("bs", bs, minimum, self.max_bs, " (max_bs)")

    def decode_length(self, step: int) -> int:
        """Live draft tokens per branch at draft-decode ``step``: ``step + 1``."""
        return self.check_step(step) + 1

    def expand_width(self, step: int) -> int:
        """Columns of the draft expand page table: ``decode_length + 1``.

        One more than ever needed (see `expand_pages_bound`); the width
        upstream allocates, kept so tables can be copied into its buffers.
        """
        return self.decode_length(step) + 1

    def expand_max_seqlen_k(self, step: int) -> int:
        """Static bound on the draft expand call's ``cache_seqlens`` at ``step``:
        ``d + P - 1`` (``d`` drafts after at most ``P - 1`` copied tail tokens)."""
        return self.decode_length(step) + self.page_size - 1

    def expand_pages_bound(self, decode_length: int) -> int:
        """Most distinct pages ``d`` draft slots of one branch can touch.

        ``d`` consecutive positions starting at in-page offset ``last < P``
        span ``ceil((last + d) / P) <= ceil((P - 1 + d) / P) <= d`` pages.
        """
        return cdiv(self.page_size - 1 + decode_length, self.page_size)
