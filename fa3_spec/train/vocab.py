"""The draft vocabulary of an EAGLE-3 head: the ``V_d`` target tokens its
lm_head scores, and the two maps the published layout stores.

* ``d2t`` int64 ``[V_d]``: offsets, target id = draft id + ``d2t[draft id]``
  (SpecForge's export, read by sglang's and vLLM's EAGLE-3 loaders and by
  `fa3_spec.eagle.checkpoint`);
* ``t2d`` bool ``[V]``: which target tokens the draft can propose.

A smaller vocabulary makes the head's lm_head, its softmax and the training
targets cheaper; the tokens a target actually emits are few, so the most
frequent ``V_d`` of them cover almost all of its output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["DraftVocab", "draft_vocab_from_counts"]


class DraftVocab(NamedTuple):
    """``ids`` int64 ``[V_d]``: the target ids of the draft tokens, ascending;
    ``d2t`` and ``t2d`` as the module docstring says."""

    ids: torch.Tensor
    d2t: torch.Tensor
    t2d: torch.Tensor

    @property
    def size(self) -> int:
        return self.ids.numel()

    @classmethod
    def from_ids(cls, ids: torch.Tensor, vocab_size: int) -> "DraftVocab":
        """The maps of the distinct target ``ids`` (any order), each in
        ``[0, vocab_size)`` (`ValueError` naming ``ids`` otherwise)."""
        ids = torch.as_tensor(ids, dtype=torch.int64).flatten()
        if ids.numel() == 0:
            raise ValueError("ids must name at least one target token")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"ids must be target token ids in [0, {vocab_size}), got "
                             f"{int(ids.min())}..{int(ids.max())}")
        ids = torch.unique(ids)  # sorted ascending
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[ids] = True
        return cls(ids, ids - torch.arange(ids.numel()), t2d)

    def check(self) -> None:
        """`ValueError` unless ``d2t`` and ``t2d`` describe the same tokens."""
        target = torch.arange(self.d2t.numel()) + self.d2t
        if not torch.equal(target, self.ids) or not bool(self.t2d[target].all()) \
                or int(self.t2d.sum()) != self.d2t.numel():
            raise ValueError("d2t and t2d disagree: draft id + d2t must land on exactly the "
                             "target tokens t2d marks")


def draft_vocab_from_counts(counts: torch.Tensor, size: int) -> DraftVocab:
    """The ``size`` most frequent target tokens of ``counts`` (int ``[V]``, how
    often each target token occurred in the training data), ties to the lower
    id; tokens never seen fill the rest in id order when fewer than ``size``
    were seen.

    Raises `ValueError` naming ``size`` unless ``1 <= size <= V``.
    """
    counts = torch.as_tensor(counts).flatten()
    v = counts.numel()
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= v:
        raise ValueError(f"size (the draft vocabulary) must be an int in [1, {v}] (the target's "
                         f"vocabulary), got {size!r}")
    # Stable sort of -count: equal counts keep ascending ids.
    order = torch.sort(-counts.to(torch.int64), stable=True).indices
    return DraftVocab.from_ids(order[:size], v)
