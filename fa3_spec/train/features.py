"""What the target gives a head to learn from, captured online: for whole
sequences, the residual stream at the head's three auxiliary layers and the
target's next-token distribution over the draft vocabulary.

The target runs its own eager prefill path (`fa3_spec.eagle.prefill.prefill_batch`
and `LlamaTarget.forward` with ``capture``), the same code the loop runs, so
the head trains on exactly the features it will read when serving.
"""

from __future__ import annotations

import dataclasses
from typing import List, NamedTuple, Optional, Sequence

import torch

from ..config import SpecConfig
from ..metadata_builder import DEFAULT_DRAFT_ATTENTION
from ..eagle.models import LlamaTarget
from ..eagle.pool import KVPool
from ..eagle.prefill import prefill_batch

__all__ = ["TargetFeatures", "target_features"]


class TargetFeatures(NamedTuple):
    """A padded batch of ``B`` sequences of up to ``T`` tokens.

    ``tokens`` int64 ``[B, T]`` (0 past a row's length); ``lengths`` int64
    ``[B]``; ``features [B, T, 3H]`` the three auxiliary layer inputs at each
    position; ``target_logp [B, T, V_d]`` float32 log-probabilities of the
    target's next token at each position, restricted to the draft vocabulary
    and renormalised there (the soft labels); ``target_top [B, T]`` int64 the
    target's argmax over its whole vocabulary (for top-1 acceptance);
    ``starts`` int64 ``[B]`` the first position a head's prediction is scored
    at: the last prompt position, whose first draft follows the target's own
    first token, so only tokens the loop drafts are scored, never the prompt.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    features: torch.Tensor
    target_logp: torch.Tensor
    target_top: torch.Tensor
    starts: torch.Tensor


@torch.no_grad()
def target_features(target: LlamaTarget, sequences: Sequence[Sequence[int]],
                    aux_layers: Sequence[int], draft_ids: torch.Tensor, *,
                    starts: Optional[Sequence[int]] = None, attention_backend: str = "auto",
                    page_size: int = 16) -> TargetFeatures:
    """Run ``target`` over whole ``sequences`` and capture what a head learns from.

    Args:
        target: the frozen target.
        sequences: token lists (prompt + response), each of at least 2 tokens.
        aux_layers: the three target layer inputs the head reads.
        draft_ids: int64 ``[V_d]`` target ids of the draft vocabulary.
        starts: per sequence, its prompt length minus one (`TargetFeatures`);
            None: 0, every position scored.
        attention_backend: as `fa3_spec.cascade_attention`.
        page_size: of the scratch pool the prefill writes into.
    """
    seqs: List[List[int]] = [list(s) for s in sequences]
    if not seqs or min(map(len, seqs)) < 2:
        raise ValueError("sequences must be one or more token lists of at least 2 tokens")
    starts = [0] * len(seqs) if starts is None else list(starts)
    if len(starts) != len(seqs) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0
                                       for v in starts):
        raise ValueError(f"starts must be one int >= 0 per sequence, got {starts!r}")
    device = target.embed.device
    s = target.shape
    bs, t = len(seqs), max(map(len, seqs))
    spec = SpecConfig(page_size=page_size, topk=1, num_steps=2, num_draft_tokens=1, max_bs=bs,
                      max_context_len=t + 2)
    spec = dataclasses.replace(spec, num_pages=spec.pool_pages(bs, DEFAULT_DRAFT_ATTENTION))
    pool = KVPool(spec, max_reqs=bs, target_layers=s.num_layers, draft_layers=1,
                  num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, dtype=target.embed.dtype,
                  device=device, draft_attention=DEFAULT_DRAFT_ATTENTION)
    rows = [pool.allocate(len(q), 1) for q in seqs]
    batch = prefill_batch(spec, pool.req_to_token, rows, seqs)
    out = target.forward(batch.tokens, batch.positions, batch.slots, batch.metadata,
                         pool.target_kv, attention_backend=attention_backend,
                         capture=tuple(aux_layers))
    h = s.hidden_size
    logits = target.logits(out[:, :h]).float()  # [Q, V]
    ids = draft_ids.to(device)
    # Queries are packed row after row; scatter the real ones onto the [B, T] grid.
    where = batch.rows[batch.owned] * t + batch.positions[batch.owned]
    grid = lambda n, dtype: torch.zeros(bs * t, n, dtype=dtype, device=device)  # noqa: E731
    features = grid(3 * h, out.dtype)
    features[where] = out[batch.owned, h:]
    logp = grid(ids.numel(), torch.float32)
    logp[where] = torch.log_softmax(logits[batch.owned][:, ids], -1)
    top = torch.zeros(bs * t, dtype=torch.int64, device=device)
    top[where] = logits[batch.owned].argmax(-1)
    tokens = torch.zeros(bs * t, dtype=torch.int64, device=device)
    tokens[where] = batch.tokens[batch.owned]
    lengths = torch.tensor([len(q) for q in seqs], dtype=torch.int64, device=device)
    return TargetFeatures(tokens.view(bs, t), lengths, features.view(bs, t, 3 * h),
                          logp.view(bs, t, -1), top.view(bs, t),
                          torch.tensor(starts, dtype=torch.int64, device=device))
