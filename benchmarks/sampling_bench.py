"""ms per EAGLE iteration: sampled vs greedy (issue 24), real acceptance, one CUDA graph.

Three loops over the same prefilled requests, per batch size:

  greedy        ``LoopConfig(sampling=False)``: the greedy-only iteration.
  greedy_rows   ``LoopConfig(sampling=True)``, every request temperature 0: the
                sampling graph's cost when nobody samples.
  sampled       ``LoopConfig(sampling=True)``, every request ``--temperature``
                (``--top-p``, ``--top-k``), distinct seeds.

Each times ``--iters`` calls of `EagleEngine.step` (replay + asynchronous
readback, as served) after ``--warmup`` ones, synced at both ends; acceptance
is the models' own (random weights accept little: say so when quoting).

    python3 benchmarks/sampling_bench.py --preset llama3-8b --batches 1 32 \\
        --json benchmarks/results/sampling_h200.json
    python3 benchmarks/sampling_bench.py --preset tiny --device cpu --iters 3   # smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from fa3_spec.eagle import EagleEngine, make_models

from loop_setup import loop_config, random_prompts


def bench(models, args, batch: int, variant: str) -> dict:
    p, k, s, n = args.config
    steps = args.warmup + args.iters
    max_new = steps * min(n, s + 1) + 8
    lc = loop_config(args.config, batch=batch, context=args.context, max_new=max_new,
                     backend=args.backend, sampling=variant != "greedy")
    mode = lc.draft_attention
    cuda = args.device == "cuda"
    eng = EagleEngine(lc, models, max_reqs=batch, buckets=[batch], graphs=cuda,
                      device=args.device, count_syncs=cuda)
    if cuda:
        eng.capture()
    sampled = variant == "sampled"
    for i, prompt in enumerate(random_prompts(batch, args.context, models.vocab_size, seed=batch)):
        eng.submit(prompt, max_new, temperature=args.temperature if sampled else 0.0,
                   top_k=args.top_k if sampled else 0, top_p=args.top_p if sampled else 1.0,
                   seed=i)
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
    acc = eng.stats["accept_lens"]
    syncs = eng.stats["host_syncs"]
    return dict(variant=variant, batch=batch, draft_attention=mode, ms_per_iteration=round(ms, 3),
                mean_accept_len=round(sum(acc) / max(len(acc), 1), 3),
                host_syncs_per_iteration=max(syncs) if syncs else None,
                active_rows_at_end=eng.active)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3-8b", choices=["tiny", "llama3-8b"])
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="auto", choices=["auto", "fa3", "torch"])
    ap.add_argument("--draft", default="derived", choices=["derived", "random"])
    ap.add_argument("--config", type=lambda t: tuple(int(x) for x in t.split(",")),
                    default=(16, 4, 5, 8), help="page_size,topk,num_steps,num_draft_tokens")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if len(args.config) != 4:
        print(f"--config: expected page_size,topk,num_steps,num_draft_tokens, got {args.config}",
              file=sys.stderr)
        return 2
    torch.manual_seed(0)
    models = make_models(args.preset, draft=args.draft, device=args.device,
                         num_layers=args.num_layers)
    rows = []
    for batch in args.batches:
        for variant in ("greedy", "greedy_rows", "sampled"):
            row = bench(models, args, batch, variant)
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = dict(preset=args.preset, layers=models.num_target_layers, dtype=str(models.dtype),
                device=args.device, config=list(args.config), context=args.context,
                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                draft=args.draft, acceptance="real (the models' own)",
                torch=torch.__version__,
                gpu=torch.cuda.get_device_name() if args.device == "cuda" else None)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
