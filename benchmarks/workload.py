"""The EAGLE loop the benchmarks run: a config, a pool sized for it, random
prompts, and the engine built over them.

Every benchmark builds its `LoopConfig` with `loop_config` and its
`EagleEngine` with `engine`, so that the loop's sizing is the same everywhere
and the engine options a benchmark sets beyond the defaults (scripted
acceptance, the layers inline instead of as compiled regions) are set in one
place. `kernels` turns ``name=value`` pairs into the ops' CUDA kernel choice.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import torch

import fa3_spec
from fa3_spec.eagle import DEFAULT_SCRIPT, EagleEngine, LoopConfig
from fa3_spec.eagle.acceptance import scripted_acceptance
from fa3_spec.eagle.kernels import parse_kernels
from fa3_spec.graphs import CompilePolicy

#: What a row says of scripted acceptance: the tokens emitted per iteration,
#: forced whatever the models say.
SCRIPTED = "scripted:" + ",".join(map(str, DEFAULT_SCRIPT))
#: The most tokens one scripted iteration emits (what sizes ``max_new``).
SCRIPTED_MAX = max(DEFAULT_SCRIPT)


def parse_config(text: str) -> tuple:
    """``"P,topk,steps,N"`` as four ints (ValueError otherwise)."""
    config = tuple(int(x) for x in text.split(","))
    if len(config) != 4:
        raise ValueError(f"config must be (P, topk, steps, N), got {config}")
    return config


def loop_config(config: Sequence[int], *, batch: int, context: int, max_new: int,
                pool_rows: Optional[int] = None, draft_attention: Optional[str] = None,
                max_context_len: Optional[int] = None, also: Sequence[tuple] = (),
                **loop_kw) -> LoopConfig:
    """`LoopConfig` for ``config = (P, topk, steps, N)``, ``batch`` rows of
    ``context`` prompt tokens and ``max_new`` new ones each.

    ``max_context_len`` defaults to ``context + max_new + N`` (the last
    iteration may draft ``N`` past the end, the largest ``N`` of ``config``
    and ``also``); the pool has whole rows for ``pool_rows`` requests (default
    ``batch``) under ``draft_attention`` (default: the loop's) and under each
    of the ``also`` shapes ``(topk, steps, N)`` that other buckets run.
    ``loop_kw`` go to `LoopConfig` (``attention_backend``, ``sampling``, ...).
    """
    if len(config) != 4:
        raise ValueError(f"config must be (P, topk, steps, N), got {tuple(config)}")
    p, k, s, n = config
    mode = LoopConfig.draft_attention if draft_attention is None else draft_attention
    widest = max([n] + [shape[2] for shape in also])
    length = context + max_new + widest if max_context_len is None else max_context_len
    spec = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=s, num_draft_tokens=n,
                               max_bs=batch, max_context_len=length)
    rows = batch if pool_rows is None else pool_rows
    pages = max(spec.with_shape(*shape).pool_pages(rows, mode) for shape in [(k, s, n), *also])
    spec = dataclasses.replace(spec, num_pages=pages)
    return LoopConfig(spec, max_new_tokens=max_new, draft_attention=mode, **loop_kw)


def engine(lc: LoopConfig, models, *, scripted: bool = False, regions: Optional[bool] = None,
           device="cpu", compile_backend: str = "auto", graphs: Optional[bool] = None,
           unbacked_batch: bool = False, **kw) -> EagleEngine:
    """`EagleEngine` over ``lc`` and ``models`` on ``device`` (``kw``: ``buckets``,
    ``max_reqs``, ``cache_path``, ...).

    ``scripted``: each iteration emits ``DEFAULT_SCRIPT``'s token counts
    whatever the models say (the same work every iteration; the tokens are not
    the model's). ``regions``: False traces the decoder layers inline where
    the engine would compile them as regions; None is the engine's choice.
    ``unbacked_batch``: `CompilePolicy.for_loop`'s (bucket 1 compiles nothing
    of its own).
    """
    buckets = kw.get("buckets")
    if regions is not None or unbacked_batch:
        if buckets is None:
            raise ValueError("regions= and unbacked_batch= need buckets=")
        available = hasattr(models, "with_compile_regions")
        kw["policy"] = CompilePolicy.for_loop(
            device=device, compile_backend=compile_backend, graphs=graphs, buckets=buckets,
            regions_available=available and regions is not False, unbacked_batch=unbacked_batch)
    else:
        kw.update(compile_backend=compile_backend, graphs=graphs)
    if scripted:
        kw["acceptance"] = scripted_acceptance(DEFAULT_SCRIPT)
    return EagleEngine(lc, models, device=device, **kw)


def compiled_as(eng: EagleEngine) -> dict:
    """How ``eng`` compiles its iteration: its backend and whether its layers are regions."""
    return dict(compile=eng.policy.compile_backend or "none", compile_regions=eng.policy.regions)


#: `Kernels` from the benchmarks' ``--kernels name=value`` pairs, e.g.
#: ``["gemm=cublas", "pdl=off"]``: the library's parser, as ``fa3-spec eagle`` uses it.
kernels = parse_kernels


def random_prompts(count: int, length: int, vocab: int, seed: int) -> List[List[int]]:
    """``count`` prompts of ``length`` uniform token ids below ``vocab``, from
    one CPU generator seeded with ``seed`` (the same on every machine)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(count)]
