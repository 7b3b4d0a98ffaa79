"""The loop the benchmarks time: one config, a pool sized for it, random prompts.

Shared by ``eagle_bench``, ``idle_breakdown``, ``sampling_bench``,
``ancestors_bench``, ``load_checkpoint`` and ``region_compile`` (imported as
``loop_setup``, the way they import ``timing``), so that they size the pool
and the context the same way. ``compile_modes`` and ``eagle_bench``'s
capture-timing child keep their own (a context of 1024 + 400, which their
committed rows used).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import torch

import fa3_spec
from fa3_spec.eagle import LoopConfig


def loop_config(config: Sequence[int], *, batch: int, context: int, max_new: int,
                pool_rows: Optional[int] = None, draft_attention: Optional[str] = None,
                **loop_kw) -> LoopConfig:
    """`LoopConfig` for ``config = (P, topk, steps, N)``, ``batch`` rows of
    ``context`` prompt tokens and ``max_new`` new ones each.

    ``max_context_len`` is ``context + max_new + N`` (the last iteration may
    draft ``N`` past the end); the pool has whole rows for ``pool_rows``
    requests (default ``batch``) under ``draft_attention`` (default: the
    loop's). ``loop_kw`` go to `LoopConfig` (``backend``, ``scripted``, ...).
    """
    if len(config) != 4:
        raise ValueError(f"config must be (P, topk, steps, N), got {tuple(config)}")
    p, k, s, n = config
    mode = LoopConfig.draft_attention if draft_attention is None else draft_attention
    spec = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=s, num_draft_tokens=n,
                               max_bs=batch, max_context_len=context + max_new + n)
    rows = batch if pool_rows is None else pool_rows
    spec = dataclasses.replace(spec, num_pages=spec.pool_pages(rows, mode))
    return LoopConfig(spec, max_new_tokens=max_new, draft_attention=mode, **loop_kw)


def random_prompts(count: int, length: int, vocab: int, seed: int) -> List[List[int]]:
    """``count`` prompts of ``length`` uniform token ids below ``vocab``, from
    one CPU generator seeded with ``seed`` (the same on every machine)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(count)]
