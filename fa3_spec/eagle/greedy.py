"""`greedy_generate`: plain decoding of the target, the loop's reference.

Exactness contract of the EAGLE loop: with greedy acceptance its output equals
this, token for token. With ``sampling`` it draws each token instead, with the
loop's own randomness (`fa3_spec.eagle.sampling`: the request's seed, counter =
tokens emitted), which is what a trainer regenerating varied responses needs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence, Union

import torch

from ..config import SpecConfig
from ..metadata_builder import DEFAULT_DRAFT_ATTENTION
from .decode import decode_step
from .models import SpecModel
from .pool import KVPool
from .prefill import check_max_new_tokens, check_prompt, eos_set, prefill_forward
from .sampling import SamplingParams, sample_tokens


def greedy_generate(models: SpecModel, prompts: Sequence[Sequence[int]],
                    max_new_tokens: Sequence[int], *,
                    eos_ids: Optional[Sequence[Union[int, Sequence[int]]]] = None,
                    page_size: int = 1, attention_backend: str = "auto", device="cpu",
                    logits_out: Optional[list] = None,
                    on_step: Optional[Callable[[int, int], None]] = None,
                    sampling: Optional[SamplingParams] = None) -> List[List[int]]:
    """Plain decoding of the target (no speculation): greedy, the reference.

    Prefill through `build_prefill_metadata`, then one token per request per
    step through `fa3_spec.eagle.decode.decode_step`, in a pool of its own. Each output
    stops after ``max_new_tokens[i]`` tokens or its first EOS (included;
    ``eos_ids[i]``: one id or several, as `EagleEngine.submit` takes them).
    ``logits_out``, if given, receives each step's float32 logits ``[B, V]``
    on the CPU (step 0 = after the prompt), for near-tie analysis.
    ``on_step(i, steps)``, if given, is called after each of the ``steps``
    token steps (progress; ``i`` from 1). ``sampling``, if given, holds one
    row per prompt (`SamplingParams`, on ``device``): token ``j`` of a row is
    drawn with counter ``j`` (`sample_tokens`; temperature-0 rows stay greedy).

    Raises:
        ValueError: no prompts, an empty prompt, a prompt token outside
            ``[0, vocab_size)``, ``max_new_tokens`` (or ``eos_ids``) not one
            per prompt, a ``max_new_tokens`` below 1, or a prompt plus its
            ``max_new_tokens`` longer than the model's RoPE table
            (``models.max_positions``).
    """
    prompts = [check_prompt(f"prompts[{i}]", p, models.vocab_size) for i, p in enumerate(prompts)]
    max_new_tokens = [check_max_new_tokens(f"max_new_tokens[{i}]", m)
                      for i, m in enumerate(max_new_tokens)]
    if not prompts or min(map(len, prompts)) < 1:
        raise ValueError("prompts must be one or more non-empty token lists")
    if len(max_new_tokens) != len(prompts) or min(max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must give one count >= 1 per prompt ({len(prompts)}), "
                         f"got {max_new_tokens}")
    if eos_ids is not None and len(eos_ids) != len(prompts):
        raise ValueError(f"eos_ids must give one id per prompt ({len(prompts)}), got "
                         f"{len(eos_ids)}")
    if sampling is not None and (not isinstance(sampling, SamplingParams)
                                 or sampling.temperature.shape != (len(prompts),)):
        raise ValueError(f"sampling must be a SamplingParams of one row per prompt "
                         f"({len(prompts)}), got {sampling!r:.80}")
    reach = max(len(p) + m for p, m in zip(prompts, max_new_tokens))
    if reach > models.max_positions:
        raise ValueError(f"a prompt plus its max_new_tokens reaches {reach} positions, beyond the "
                         f"model's RoPE table of {models.max_positions} (max_position_embeddings)")
    bs = len(prompts)
    steps = max(max_new_tokens)
    ctx = max(len(p) for p in prompts) + steps + 1
    spec = SpecConfig(page_size=page_size, topk=1, num_steps=2, num_draft_tokens=1,
                      max_bs=max(bs, 1), max_context_len=ctx)
    # A chain with no draft step: the draft semantics changes nothing but the row's scratch.
    spec = dataclasses.replace(spec, num_pages=spec.pool_pages(bs, DEFAULT_DRAFT_ATTENTION))
    pool = KVPool(spec, max_reqs=bs, target_layers=models.num_target_layers, draft_layers=1,
                  num_kv_heads=models.num_kv_heads, head_dim=models.head_dim,
                  dtype=models.dtype, device=device, seed=1,
                  draft_attention=DEFAULT_DRAFT_ATTENTION)
    rows = [pool.allocate(len(p), steps) for p in prompts]
    r2t = pool.req_to_token
    first, _, _, _, logits = prefill_forward(models, spec, pool.target_kv, None, r2t, rows,
                                              prompts, attention_backend=attention_backend,
                                              sampling=sampling)
    if logits_out is not None:
        logits_out.append(logits.float().cpu())
    rpi = torch.tensor(rows, dtype=torch.int64, device=device)
    seq = torch.tensor([len(q) for q in prompts], dtype=torch.int64, device=device)
    tokens = [first]
    cur = first
    if on_step is not None:
        on_step(1, steps)
    for i in range(2, steps + 1):
        logits = decode_step(models, spec, pool.target_kv, r2t, rpi, seq, cur,
                             attention_backend=attention_backend)
        if logits_out is not None:
            logits_out.append(logits.float().cpu())
        cur = (logits.argmax(-1) if sampling is None else
               sample_tokens(logits, sampling, torch.full_like(seq, i - 1)))
        tokens.append(cur)
        seq = seq + 1
        if on_step is not None:
            on_step(i, steps)
    table = torch.stack(tokens, 1).cpu().tolist()  # ok-host: host readback, between iterations
    eos_ids = list(eos_ids) if eos_ids is not None else [-1] * bs
    out = []
    for row, m, eos in zip(table, max_new_tokens, eos_ids):
        row = row[:m]
        stops = [j for j, t in enumerate(row) if t in eos_set(eos)]
        out.append(row[: stops[0] + 1] if stops else row)
    return out
