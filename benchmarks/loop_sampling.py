"""ms per EAGLE iteration, sampled against greedy, real acceptance, one CUDA graph.

Three loops over the same prefilled requests, per batch size:

  greedy        ``LoopConfig(sampling=False)``: the greedy-only iteration.
  greedy_rows   ``LoopConfig(sampling=True)``, every request temperature 0: the
                sampling graph's cost when nobody samples.
  sampled       ``LoopConfig(sampling=True)``, every request ``--temperature``
                (``--top-p``, ``--top-k``), distinct seeds.

Each times ``--iters`` calls of `EagleEngine.step` (replay + asynchronous
readback, as served) after ``--warmup`` ones, synced at both ends;
acceptance is the models' own (random weights accept little). ``--smoke``:
CPU, tiny preset, batch 2 (timings meaningless).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from fa3_spec.eagle import make_models
from fa3_spec.eagle.sync_probe import HostSyncProbe

import runs
import workload

PROG = "loop.py sampling"
HELP = "ms per iteration of the sampling graph against the greedy-only one"


def bench(models, args, batch: int, variant: str) -> dict:
    """One engine per row: ms per `EagleEngine.step`, mean accepted length, host syncs."""
    p, k, s, n = args.config
    steps = args.warmup + args.iters
    max_new = steps * min(n, s + 1) + 8
    lc = workload.loop_config(args.config, batch=batch, context=args.context, max_new=max_new,
                              attention_backend=args.attention_backend, sampling=variant != "greedy")
    cuda = args.device == "cuda"
    eng = workload.engine(lc, models, max_reqs=batch, buckets=[batch], graphs=cuda,
                          device=args.device)
    if cuda:
        eng.capture()
    sampled = variant == "sampled"
    prompts = workload.random_prompts(batch, args.context, models.vocab_size, seed=batch)
    for i, prompt in enumerate(prompts):
        eng.submit(prompt, max_new, temperature=args.temperature if sampled else 0.0,
                   top_k=args.top_k if sampled else 0, top_p=args.top_p if sampled else 1.0,
                   seed=i)
    with HostSyncProbe(eng) as syncs:  # every launch watched (CUDA), the timed ones too
        for _ in range(args.warmup):
            eng.step()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.iters):
            eng.step()
        if cuda:
            torch.cuda.synchronize()
        ms = 1e3 * (time.perf_counter() - start) / args.iters
    return dict(variant=variant, batch=batch, draft_attention=lc.draft_attention,
                ms_per_iteration=round(ms, 3),
                mean_accept_len=round(eng.stats.mean_accept_len, 3),
                host_syncs_per_iteration=syncs.worst,
                active_rows_at_end=eng.active)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3-8b", choices=["tiny", "llama3-8b"])
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "fa3", "torch"])
    ap.add_argument("--draft", default="derived", choices=["derived", "random"])
    ap.add_argument("--config", default="16,4,5,8", help="page_size,topk,num_steps,num_draft_tokens")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, every code path")
    ap.add_argument("--json", metavar="PATH")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.smoke:
        args.preset, args.device, args.batches = "tiny", "cpu", [2]
        args.iters, args.warmup, args.context = 2, 1, 16
        torch.set_num_threads(1)
    try:
        args.config = workload.parse_config(args.config)
    except ValueError as exc:
        print(f"--config: expected page_size,topk,num_steps,num_draft_tokens ({exc})",
              file=sys.stderr)
        return 2
    torch.manual_seed(0)
    models = make_models(args.preset, draft=args.draft, device=args.device,
                         num_layers=args.num_layers)
    rows = []
    meta = dict(preset=args.preset, layers=models.num_target_layers, dtype=str(models.dtype),
                device=args.device, config=list(args.config), context=args.context,
                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                draft=args.draft, acceptance="real", torch=torch.__version__,
                gpu=runs.device_name(args.device) if args.device == "cuda" else None,
                command=runs.command_line(PROG, argv))
    for batch in args.batches:
        for variant in ("greedy", "greedy_rows", "sampled"):
            row = bench(models, args, batch, variant)
            rows.append(row)
            print(row, flush=True)
            if args.json:
                runs.write_json(args.json, dict(meta=meta, rows=rows))
    return 0
