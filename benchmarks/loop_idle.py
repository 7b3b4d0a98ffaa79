"""Where the GPU's time goes during the EAGLE loop: kernels by category and
name, and the gaps inside a graph and between launches.

Profiles ``--iters`` back-to-back launches of the engine's captured iteration
((a) of ``loop.py compare``), and with ``--decode`` of the plain decode step
((c)), under ``torch.profiler`` with CPU and CUDA activity, and splits each
span with `gpu_trace.breakdown`: busy time, idle inside one graph launch
(dependencies and launch latency between the graph's kernels), idle between
launches (host work), kernel time per category and the largest kernels and
gaps. Scripted acceptance, one bucket per engine, the engine's CUDA default
(inductor + CUDA graph), ``llama3-8b`` shapes, context 1024. Needs CUDA
(exit 2 without it).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from fa3_spec.eagle import make_models

import gpu_trace
import runs
import workload
from loop_variants import greedy_segment

PROG = "loop.py idle"
HELP = "where an iteration's GPU time goes: kernels by category, gaps in and between graphs"


def engine_for(models, cfg, batch: int, context: int, iters: int):
    """One captured bucket of ``batch`` requests of ``context`` tokens, admitted."""
    max_new = (iters + 8) * workload.SCRIPTED_MAX + 8
    lc = workload.loop_config(cfg, batch=batch, context=context, max_new=max_new)
    eng = workload.engine(lc, models, scripted=True, max_reqs=batch, buckets=[batch],
                          device="cuda")
    eng.capture()
    for prompt in workload.random_prompts(batch, context, models.vocab_size, seed=batch):
        eng.submit(prompt, max_new)
    eng.admit()
    return eng


def profile_row(models, cfg, batch: int, args) -> dict:
    """The breakdown of (a), and with ``args.decode`` of (c), for one config and batch."""
    t0 = time.perf_counter()
    eng = engine_for(models, cfg, batch, args.context, args.iters)
    row = dict(config=list(cfg), batch=batch, context=args.context,
               compile=workload.compiled_as(eng)["compile"], draft_attention=eng.lc.draft_attention,
               capture_s=round(time.perf_counter() - t0, 1))
    for _ in range(3):
        eng.launch(batch)
    row["a"] = gpu_trace.breakdown(gpu_trace.profile_events(lambda: eng.launch(batch), args.iters))
    if args.decode:
        seg, _ = greedy_segment(eng, batch, graphs=True)
        seg.run()
        row["c"] = gpu_trace.breakdown(gpu_trace.profile_events(seg.run, args.iters))
    return row


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--configs", nargs="+", default=["2,8,5,16"], help="P,topk,steps,N")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=5, help="launches profiled back to back")
    ap.add_argument("--decode", action="store_true", help="also the plain decode step (c)")
    ap.add_argument("--json", metavar="PATH")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        configs = [workload.parse_config(c) for c in args.configs]
    except ValueError:
        print(f"--configs: expected P,topk,steps,N, got {args.configs}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"{PROG} needs CUDA (it profiles captured graphs)", file=sys.stderr)
        return 2
    models = make_models(args.preset, draft="random", device="cuda", num_layers=args.num_layers)
    doc = dict(command=runs.command_line(PROG, argv), commit=runs.commit(),
               torch=torch.__version__,
               device=runs.device_name("cuda"), preset=args.preset,
               acceptance=workload.SCRIPTED, rows=[])
    for cfg in configs:
        for batch in args.batches:
            row = profile_row(models, cfg, batch, args)
            doc["rows"].append(row)
            a = row["a"]
            print(f"{cfg} batch {batch}: busy {a['busy_frac']:.3f}, idle in graph "
                  f"{a['idle_in_graph_frac']:.3f}, between launches "
                  f"{a['idle_between_launches_frac']:.3f}; {a['by_category_us']}", flush=True)
            if args.json:
                runs.write_json(args.json, doc)
            torch.cuda.empty_cache()  # the row's engine is gone
    return 0
