"""Compile + capture of the EAGLE engine: one dynamic frame for every bucket, or one static frame each.

`EagleEngine(dynamic_batch=...)` with inductor:

  dynamic  the buckets above 1 share one frame with a symbolic batch, and
           inductor's index propagation is off; bucket 1 is its own static
           frame.
  static   one frame per bucket.

``--layers``: the decoder layers as compiled regions (`fa3_spec.eagle.regions`,
``EagleEngine(compile_regions=True)``, the engine's default under inductor:
one compile of a layer serves every layer and bucket) or traced inline into
the frame (this script's default, so that its committed command still makes
the inline rows of `compile_modes_h200.json`; the regions' rows are in
`compile_modes_regions_h200.json`).

Per mode, in a fresh process each: compile + capture of ``--buckets`` (seconds
per bucket), then ms per iteration at each of ``--time-batches`` (replays
back to back after 3, synced at both ends: launch throughput, not `timing`'s
drained per-call wall), in the smallest bucket that holds the batch (the
rest padding rows) and in the next bucket up, in blocks A, B, B, A of 10
replays: what a coarser bucket list costs (more padding rows; for batch 1,
also the shared dynamic frame instead of bucket 1's own). Then the compile
phases PyTorch timed. Scripted acceptance, `llama3-8b` shapes, P 2 / topk 8
/ 5 steps / N 16, context 1024. ``--restart`` adds a second dynamic process
that loads the first one's compile cache file (`cache_path=`).

    python3 benchmarks/compile_modes.py --json benchmarks/results/compile_modes_h200.json
    python3 benchmarks/compile_modes.py --modes dynamic --layers regions --json ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import torch

import fa3_spec
from fa3_spec.eagle import DEFAULT_SCRIPT, EagleEngine, LoopConfig, make_models, regions

import timing


def _replay_ms(eng: EagleEngine, bucket: int, iters: int) -> float:
    """ms per iteration of ``iters`` replays of ``bucket`` back to back, synced at both ends."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        eng.launch(bucket)
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / iters


def _ms_per_iteration(eng: EagleEngine, buckets, warmup: int = 3, iters: int = 20) -> list:
    """ms per iteration in each of ``buckets`` (one or two) over the same requests.

    Two buckets are timed in blocks A, B, B, A of ``iters / 2`` replays, so
    that the context's growth over the blocks (every replay emits tokens)
    weighs both alike.
    """
    for bucket in buckets:
        for _ in range(warmup):
            eng.launch(bucket)
    if len(buckets) == 1:
        return [round(_replay_ms(eng, buckets[0], iters), 3)]
    a, b = buckets
    half = iters // 2
    blocks = [(x, _replay_ms(eng, x, half)) for x in (a, b, b, a)]
    return [round(sum(ms for x, ms in blocks if x == y) / 2, 3) for y in (a, b)]


def child(mode: str, cache: str, buckets, timed, num_layers, compile_regions: bool) -> dict:
    torch.manual_seed(0)
    models = make_models("llama3-8b", draft="random", device="cuda", num_layers=num_layers)
    spec = fa3_spec.SpecConfig(page_size=2, topk=8, num_steps=5, num_draft_tokens=16,
                               max_bs=max(buckets), max_context_len=1024 + 600)
    draft_attention = LoopConfig.draft_attention
    spec = dataclasses.replace(spec, num_pages=spec.pool_pages(max(buckets), draft_attention))
    lc = LoopConfig(spec, max_new_tokens=500, backend="fa3", scripted=DEFAULT_SCRIPT,
                    draft_attention=draft_attention)
    eng = EagleEngine(lc, models, buckets=buckets, device="cuda", cache_path=cache or None,
                      dynamic_batch=mode == "dynamic", compile_regions=compile_regions)
    t0 = time.perf_counter()
    per = eng.capture()
    out = dict(mode=mode, compile_regions=eng.compile_regions, draft_attention=draft_attention,
               seconds=round(time.perf_counter() - t0, 2),
               frames=eng.runner.compile_counter.frame_count,
               region_programs=regions.compiled_programs(),
               per_bucket={str(b): round(x, 2) for b, x in per.items()}, ms_per_iteration={},
               bucket_of_batch={}, ms_per_iteration_next_bucket={}, next_bucket_of_batch={},
               live_requests_after={})
    g = torch.Generator().manual_seed(0)
    n = 0
    for b in timed:
        while n < b:
            eng.submit(torch.randint(0, models.vocab_size, (1024,), generator=g).tolist(), 500)
            n += 1
        eng.admit()
        bucket = eng.runner.bucket_for(b)  # b requests, the rest of the bucket padding rows
        # And the next bucket up, if any: what a coarser bucket list costs these requests.
        timed_buckets = [bucket] + [x for x in buckets if x > bucket][:1]
        ms = _ms_per_iteration(eng, timed_buckets)
        out["ms_per_iteration"][str(b)] = ms[0]
        out["bucket_of_batch"][str(b)] = bucket
        if len(ms) == 2:
            out["ms_per_iteration_next_bucket"][str(b)] = ms[1]
            out["next_bucket_of_batch"][str(b)] = timed_buckets[1]
        # Every request still decoding (none finished and became padding while timed).
        out["live_requests_after"][str(b)] = int((eng.state["seq_lens"][:n] > 0).sum())
    # Where the compile went: seconds per phase PyTorch times (dynamo_timed),
    # summed over every frame and region program this process compiled.
    names, seconds = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    out["compile_phases_s"] = {n: round(float(x), 2) for n, x in zip(names, seconds)
                               if float(x) >= 0.5}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["dynamic", "static"],
                    choices=["dynamic", "static"])
    ap.add_argument("--buckets", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                    help="dynamic mode's buckets (static mode: --time-batches only)")
    ap.add_argument("--time-batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--no-restart", dest="restart", action="store_false",
                    help="skip the dynamic restart from the cold run's cache file")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--layers", choices=["regions", "inline"], default="inline",
                    help="the decoder layers traced inline (this script's default) or as "
                         "compiled regions (EagleEngine(compile_regions=True), the engine's "
                         "default under inductor)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--_child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    timed = sorted(args.time_batches)
    if args._child:
        mode, cache = args._child
        buckets = sorted(args.buckets) if mode == "dynamic" else timed
        print(json.dumps(child(mode, cache, buckets, timed, args.num_layers,
                               args.layers == "regions")))
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("compile_modes.py times CUDA graphs: it needs a CUDA device")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "engine.cache")
        # (mode, cache file, phase): the cold dynamic run writes the file its restart loads.
        plan = [(m, cache if m == "dynamic" else "", "cold") for m in args.modes]
        if args.restart and "dynamic" in args.modes:
            plan.append(("dynamic", cache, "restart"))
        for i, (mode, cache_file, phase) in enumerate(plan):
            cmd = [sys.executable, os.path.abspath(__file__), "--_child", mode,
                   cache_file, "--buckets", *map(str, args.buckets),
                   "--time-batches", *map(str, timed), "--layers", args.layers]
            if args.num_layers:
                cmd += ["--num-layers", str(args.num_layers)]
            row = timing.fresh_process_row(cmd, os.path.join(tmp, f"inductor-{i}"), mode)
            row["phase"] = phase
            runs.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        timing.write_json(args.json, dict(
            command="python3 benchmarks/compile_modes.py " + " ".join(
                sys.argv[1:] if argv is None else argv),
            torch=torch.__version__, device=torch.cuda.get_device_name(), runs=runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
