"""Eager prefill of prompts into a pool, shared by the engine's admission and the
greedy reference, and the checks on what a request gives.

The prefill runs eagerly (never compiled: a compiled prefill would compile once
per prompt length) on metadata from `fa3_spec.build_prefill_metadata`.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ..builders.prefill import build_prefill_metadata, extend_query_positions
from ..config import SpecConfig
from .models import KVCache, SpecModel
from .sampling import SamplingParams, sample_tokens
from .vocab import vocab_argmax


def check_prompt(name: str, prompt: Sequence[int], vocab_size: int) -> List[int]:
    """``prompt`` as a list of ints, every token in ``[0, vocab_size)``.

    Tokens are taken as they are, never converted: a float, a bool or a string
    is refused rather than truncated or split into digits.

    Raises:
        TypeError: ``prompt`` is a string, or a token is not an int (named,
            with its position).
        ValueError: a token outside the vocabulary (named, with its position).
    """
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Iterable):
        raise TypeError(f"{name} must be a sequence of int token ids, got {type(prompt).__name__}")
    tokens = list(prompt)
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{name}: token at position {i} must be an int, got {t!r}")
    tokens = [int(t) for t in tokens]
    bad = next((i for i, t in enumerate(tokens) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{name}: token {tokens[bad]} at position {bad} is outside the "
                         f"vocabulary (vocab_size={vocab_size}: ids 0..{vocab_size - 1})")
    return tokens


class PrefillBatch(NamedTuple):
    """What one eager prefill of whole prompts feeds a forward: ``tokens``,
    ``positions``, ``slots`` int64 ``[B * max_len]`` (the prompts packed
    first, padding queries after them at slot 0), the prefill ``metadata``,
    each query's batch ``rows`` and whether it is a real one (``owned``,
    bool)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    metadata: object
    rows: torch.Tensor
    owned: torch.Tensor


def prefill_batch(spec: SpecConfig, req_to_token: torch.Tensor, rows: List[int],
                  prompts: List[List[int]]) -> PrefillBatch:
    """The `PrefillBatch` of ``prompts`` into pool ``rows`` (from empty rows)."""
    device = req_to_token.device
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=device)
    tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=device)
    max_len = max(len(p) for p in prompts)
    # q is sized to the metadata's static bound (rows * max_seqlen_q), as
    # cascade_attention requires; queries past the real ones write K/V to
    # slot 0 (the reserved dummy page) and are never read.
    total = len(prompts) * max_len
    tokens = torch.nn.functional.pad(tokens, (0, total - tokens.shape[0]))
    rpi = torch.tensor(rows, dtype=torch.int64, device=device)
    md = build_prefill_metadata(spec, req_to_token=req_to_token, req_pool_indices=rpi,
                                seq_lens=lens, extend_seq_lens=lens, max_seqlen_q=max_len)
    row, pos, owned = extend_query_positions(md, lens, total)
    slots = torch.where(owned, req_to_token[rpi[row], pos].to(torch.int64), 0)
    return PrefillBatch(tokens, pos, slots, md, row, owned)


def prefill_forward(models: SpecModel, spec: SpecConfig, kv_target: KVCache,
                     kv_draft: Optional[KVCache], req_to_token: torch.Tensor,
                     rows: List[int], prompts: List[List[int]], *, attention_backend: str,
                     num_splits=None, sampling: Optional[SamplingParams] = None,
                     topk: Optional[int] = None):
    """Eager prefill of ``prompts`` into pool ``rows``.

    Returns ``(first_token [B], draft_hidden [B, H], cand_scores [B, K],
    cand_tokens [B, K], logits [B, V])``: the target's token after each
    prompt (greedy, or drawn with ``sampling``, counter 0) and its logits
    and, with a draft cache (else None), the draft's feature and the top-K
    children of that token (``K = topk``, None: ``spec.topk``; the state's
    carried width, `fa3_spec.eagle.iteration.StateWidths`).
    """
    device = req_to_token.device
    batch = prefill_batch(spec, req_to_token, rows, prompts)
    tokens, pos, slots, md, row = batch.tokens, batch.positions, batch.slots, batch.metadata, \
        batch.rows
    total = tokens.shape[0]
    attn = dict(attention_backend=attention_backend, num_splits=num_splits)
    hidden = models.target_forward(tokens, pos, slots, md, kv_target, **attn)
    last = md.cu_seqlens_q[1:].to(torch.int64) - 1
    logits = models.target_logits(hidden[last])
    first = vocab_argmax(logits)
    if sampling is not None:
        first = sample_tokens(logits, sampling, torch.zeros_like(first))
    if kv_draft is None:
        return first, None, None, None, logits
    # EAGLE shift: draft position p consumes the token at p + 1 (the first
    # generated token after the prompt's last position).
    shifted = torch.cat([tokens[1:], tokens[:1]])
    is_last = torch.zeros(total, dtype=torch.bool, device=device)
    is_last[last] = True
    shifted = torch.where(is_last, first[row], shifted)
    h_draft = models.draft_forward(shifted, models.draft_input(hidden), pos, slots, md, kv_draft,
                                   **attn)[last]
    scores, cand = models.draft_topk(h_draft, spec.topk if topk is None else topk)
    return first, h_draft, scores, cand, logits


def check_max_new_tokens(name: str, value: object) -> int:
    """``value`` if it is an int >= 1 (a bool, a float or NaN is refused, never
    truncated): `ValueError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def eos_set(eos_id: Union[int, Sequence[int]], vocab_size: Optional[int] = None
            ) -> Tuple[int, ...]:
    """One EOS id or several -> the distinct ids, in order (-1 and other
    negatives mean none). Each must be an int (`ValueError` naming ``eos_id``
    otherwise); with ``vocab_size``, below it (an id the model cannot emit
    would never stop the request)."""
    ids = list(eos_id) if isinstance(eos_id, Iterable) and not isinstance(eos_id, (str, bytes)) \
        else [eos_id]
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"eos_id must be an int or ints, got {t!r}")
        if vocab_size is not None and t >= vocab_size:
            raise ValueError(f"eos_id {t} is outside the vocabulary (vocab_size={vocab_size})")
    ids = [int(t) for t in ids]
    return tuple(dict.fromkeys(t for t in ids if t >= 0))
