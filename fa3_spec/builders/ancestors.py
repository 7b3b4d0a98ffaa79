"""Tree draft steps that attend their true ancestors (docs/semantics.md, "Draft decode").

EAGLE-2 re-ranks the leaves at every draft step: the ``K`` best of the
``K * K`` candidates become the next leaves, and the leaf now in branch ``t``
often descends from another branch. With ``draft_attention="ancestors"`` a
leaf attends the prefix plus exactly its own path through the draft tree,
whatever slots the allocator gave the drafts. Step ``i`` (``d = i + 1``) is a
cascade:

    prefix call   row b       K queries (b's leaves)   keys: all seq_len prefix tokens
    expand call   row b*K+t   1 query (leaf t)         keys: ancestor_slots[b, t, :d]
                                                        (page size 1: a list of slots)

Worked example: ``K = 2``, three draft steps. Node names are their slots::

    step 0   leaves 40, 71   (the root's top-2 children)
    step 1   both new leaves are children of 71:  parent_branch [1, 1], own [12, 90]
    step 2   both are children of 12 (branch 0):  parent_branch [0, 0], own [33, 5]

            root                 ancestor_slots            branch semantics reads
           /    \\               step 0  [[40], [71]]        [[40], [71]]
         40      71             step 1  [[71, 12], [71, 90]]  [[40, 12], [71, 90]]
                /  \\            step 2  [[71, 12, 33],        [[40, 12, 33],
              12    90                   [71, 12, 5]]          [71, 90, 5]]
             /  \\
           33    5

Under branch semantics (sglang's) leaf 12 of step 1 sits in branch 0 and
reads slot 40, the previous occupant of its branch, not its parent 71. The
running tensor is one gather per step, `draft_ancestor_slots`.

No tail copy and no slot layout: the prefix call reads the prefix's partial
last page from the request's own row, and the expand call reads the ``d``
listed slots through a page-size-1 view of the cache, as tree verify does
(`fa3_spec.builders.verify`), at most ``num_steps - 1`` keys per query.
"""

from __future__ import annotations

import torch

from .. import _validate
from ..metadata import CascadeMetadata, FA3Metadata
from ..paged import BatchView
from ._common import slot_call


def draft_ancestor_slots(prev: torch.Tensor, parent_branch: torch.Tensor,
                         own_slots: torch.Tensor) -> torch.Tensor:
    """The ancestor slots of this step's leaves, from the previous step's.

    Args:
        prev: int64 ``[B, K, d - 1]``: the previous step's ``ancestor_slots``
            (``[B, K, 0]`` at step 0).
        parent_branch: int64 ``[B, K]``: the branch (leaf index ``0 .. K-1``)
            of the previous step that each new leaf descends from (EAGLE-2's
            selection: ``best // K``). Ignored at step 0; clamped into
            ``[0, K - 1]``.
        own_slots: int64 ``[B, K]``: the slot each new leaf writes its K/V to.

    Returns:
        int64 ``[B, K, d]``: ``prev`` gathered by ``parent_branch``, then the
        own slot. Pure and traceable (a gather and a concatenation; no host
        sync), capture-safe.

        >>> prev = torch.zeros(1, 2, 0, dtype=torch.int64)
        >>> a = draft_ancestor_slots(prev, torch.tensor([[0, 1]]), torch.tensor([[40, 71]]))
        >>> a = draft_ancestor_slots(a, torch.tensor([[1, 1]]), torch.tensor([[12, 90]]))
        >>> draft_ancestor_slots(a, torch.tensor([[0, 0]]), torch.tensor([[33, 5]])).tolist()  # ok-host: doctest
        [[[71, 12, 33], [71, 12, 5]]]
    """
    prev = _validate.tensor("prev", prev, ndim=3, dtypes=(torch.int64,))
    parent = _validate.tensor("parent_branch", parent_branch, ndim=2, dtypes=(torch.int64,))
    own = _validate.tensor("own_slots", own_slots, ndim=2, dtypes=(torch.int64,))
    bs, k, depth = prev.shape
    for name, t in (("parent_branch", parent), ("own_slots", own)):
        if tuple(t.shape) != (bs, k):
            raise ValueError(f"{name} must be [B, K] = [{bs}, {k}] like prev's first two "
                             f"dimensions, got shape {tuple(t.shape)}")
    _validate.same_device(prev=prev, parent_branch=parent, own_slots=own)
    index = parent.clamp(0, max(k - 1, 0)).unsqueeze(2).expand(bs, k, depth)
    return torch.cat([prev.gather(1, index), own.unsqueeze(2)], dim=2)


def ancestor_step(view: BatchView, path: torch.Tensor, prefix: FA3Metadata) -> CascadeMetadata:
    """A draft step whose leaves attend ``prefix`` (the whole-prefix call) and
    their ``path`` (int64 ``[B*K, d]``, the first ``d`` ancestor slots, clamped
    into the pool): the expand call has ``B*K`` rows at page size 1, row
    ``b*K + t`` lists ``path[b*K + t]`` with ``cache_seqlens = d``; padding
    rows read nothing (sentinel, 0)."""
    rows, d = path.shape
    k = view.cfg.topk
    table = view.mask_padding(path, k).to(torch.int32)  # padding rows: PAGE_SENTINEL
    keys = torch.full((rows,), d, dtype=torch.int32, device=path.device)
    cache_seqlens = view.mask_padding(keys, k)
    return CascadeMetadata(prefix=prefix, expand=slot_call(table, cache_seqlens, max_seqlen_k=d))
