"""One step of plain (non-speculative) decoding on fa3_spec's decode metadata.

The same step serves the eager reference (`fa3_spec.eagle.greedy_generate`)
and the benchmarks' captured no-speculation baseline, so both run exactly the
model code the EAGLE iteration runs.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..builders import build_decode_metadata
from ..config import SpecConfig
from .models import KVCache, SpecModel


def decode_step(models: SpecModel, spec: SpecConfig, kv: KVCache, req_to_token: torch.Tensor,
                req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, tokens: torch.Tensor, *,
                attention_backend: str = "auto", num_splits: Optional[int] = None) -> torch.Tensor:
    """Run the target on one new token per request; return its logits ``[B, V]``.

    Args:
        req_to_token: int32 ``[max_reqs, >= spec.min_row_len]`` slots.
        req_pool_indices: int64 ``[B]``.
        seq_lens: int64 ``[B]`` tokens already cached; 0 marks a padding row
            (it reads nothing and writes slot 0, the reserved dummy slot).
        tokens: int64 ``[B]`` the token at position ``seq_lens`` of each row,
            whose K/V this step writes at ``req_to_token[row, seq_len]``.

    Traceable with ``torch.compile(fullgraph=True)`` and capturable: no host
    sync, shapes from ``B`` alone.
    """
    live = seq_lens > 0
    md = build_decode_metadata(spec, req_to_token=req_to_token, req_pool_indices=req_pool_indices,
                               seq_lens=torch.where(live, seq_lens + 1, 0))
    rows = req_pool_indices.to(torch.int64).clamp(0, req_to_token.shape[0] - 1)
    cols = seq_lens.to(torch.int64).clamp(0, req_to_token.shape[1] - 1)
    slots = torch.where(live, req_to_token[rows, cols].to(torch.int64), 0)
    hidden = models.target_forward(tokens, seq_lens, slots, md, kv,
                                   attention_backend=attention_backend,
                                   num_splits=num_splits)
    return models.target_logits(hidden)
