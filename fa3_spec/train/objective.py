"""The training objective of an EAGLE-3 head and its acceptance measure.

Each unrolled step ``k`` of the training-time test (`fa3_spec.train.head`) is
scored by a soft cross-entropy against the target's next-token distribution
restricted to the draft vocabulary, weighted ``decay ** k`` (EAGLE-3 uses 0.8):
the first draft depth matters most, because every deeper one needs it.

A step-``k`` prediction at position ``p`` is scored where its input token
(``p + 1``) is real, its prefix (``p - k``) exists and it predicts a response
token the loop drafts: ``max(k, start) <= p <= length - 2``, ``start`` the last
prompt position (`TargetFeatures.starts`).
"""

from __future__ import annotations

from typing import List, NamedTuple

import torch

from .features import TargetFeatures

__all__ = ["StepScores", "ttt_loss"]


class StepScores(NamedTuple):
    """``loss``: the weighted mean soft cross-entropy (a scalar with grad);
    ``per_step_loss`` and ``top1`` (float, one per step): each step's mean
    cross-entropy and how often the draft's top token, mapped to the target
    vocabulary, is the target's greedy token (the chance the loop accepts
    that depth, given the path before it); ``positions``: scored positions
    per step."""

    loss: torch.Tensor
    per_step_loss: List[float]
    top1: List[float]
    positions: List[int]


def ttt_loss(logits: List[torch.Tensor], batch: TargetFeatures, draft_ids: torch.Tensor,
             decay: float = 0.8) -> StepScores:
    """Score the head's per-step ``logits`` (``[B, T, V_d]`` each) on ``batch``."""
    if not logits:
        raise ValueError("logits must hold at least one step")
    b, t = batch.tokens.shape
    pos = torch.arange(t, device=batch.tokens.device)
    # The label of position p is the target's distribution at p + 1.
    labels = torch.cat([batch.target_logp[:, 1:], batch.target_logp[:, :1]], 1)
    top = torch.cat([batch.target_top[:, 1:], batch.target_top[:, :1]], 1)
    probs = labels.exp()
    total, weights = 0.0, 0.0
    per_step, top1, counts = [], [], []
    for k, step_logits in enumerate(logits):
        valid = ((pos.unsqueeze(0) >= k) & (pos.unsqueeze(0) >= batch.starts.unsqueeze(1))
                 & (pos.unsqueeze(0) <= batch.lengths.unsqueeze(1) - 2))
        n = valid.sum()
        logq = torch.log_softmax(step_logits.float(), -1)
        ce = -(probs * logq).sum(-1)  # [B, T]
        step_loss = (ce * valid).sum() / n.clamp(min=1)
        w = decay ** k
        total = total + w * step_loss
        weights += w
        hit = (draft_ids[step_logits.argmax(-1)] == top) & valid
        per_step.append(float(step_loss.detach()))
        top1.append(float(hit.sum()) / max(int(n), 1))
        counts.append(int(n))
    return StepScores(total / weights, per_step, top1, counts)
