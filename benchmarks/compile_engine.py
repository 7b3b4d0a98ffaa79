"""Cold compile + capture of the EAGLE engine's buckets, a restart from its
compile cache, and what a coarser bucket list costs per iteration.

The engine as it compiles by default (inductor; with more than one bucket
above 1 those buckets share one frame with a symbolic batch and bucket 1 is a
static frame of its own), in a fresh process with an empty inductor cache.
``--layers inline`` traces the decoder layers into the frame instead of
compiling them as regions (`fa3_spec.eagle.regions`, the default).
``--batch unbacked`` makes the batch an unbacked symbol and traces the
layer programs size-oblivious (`fa3_spec.graphs.CompilePolicy`'s
``unbacked_batch`` and ``size_oblivious``), so that bucket 1 compiles
nothing of its own.

The child reports the compile + capture seconds per bucket, then ms per
iteration at each of ``--time-batches`` (replays back to back after 3, synced
at both ends: launch throughput) in the smallest bucket that holds the batch
(the rest padding rows) and in the next bucket up, timed in blocks A, B, B, A
of 10 replays so that the context's growth weighs both alike, and the compile
phases PyTorch timed (``compile_phases_s``); with ``--breakdown``, where
the GPU time of an iteration goes in the smallest bucket that holds each
timed batch (`gpu_trace.breakdown` of 5 profiled replays after its timing:
kernel time per category and per kernel), so that two runs (``--batch
backed`` and ``unbacked``) can be compared kernel by kernel. Scripted
acceptance, ``llama3-8b`` shapes, P 2 / topk 8 / 5 steps / N 16 (or, with ``--shapes``,
each bucket's own shape as the speculation policy picks them), context 1024. Unless
``--no-restart``, a second fresh process loads the first one's compile cache
file (`EagleEngine(cache_path=)`): the restart. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from fa3_spec.eagle import make_models, regions
from fa3_spec.eagle.policy import parse_shape_key

import gpu_trace
import runs
import workload

PROG = "compile.py engine"
HELP = "cold compile + capture of the engine's buckets, the restart, bucket costs"
CONFIG = (2, 8, 5, 16)


def _replay_ms(eng, bucket: int, iters: int) -> float:
    """ms per iteration of ``iters`` replays of ``bucket`` back to back, synced at both ends."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        eng.launch(bucket)
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / iters


def ms_per_iteration(eng, buckets, warmup: int = 3, iters: int = 20) -> list:
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


def parse_bucket_shapes(pairs) -> dict:
    """``["1=8,5,16", "64=off"]`` as ``{1: (8, 5, 16), 64: None}`` (ValueError otherwise)."""
    out = {}
    for pair in pairs:
        bucket, _, shape = pair.partition("=")
        try:
            out[int(bucket)] = None if shape == "off" else parse_shape_key(shape)
        except ValueError as exc:
            raise ValueError(f"--shapes: expected BUCKET=TOPK,STEPS,N or BUCKET=off, "
                             f"got {pair!r} ({exc})") from None
    return out


def child(cache: str, buckets, timed, num_layers, inline: bool, shapes=None,
          unbacked: bool = False, breakdown: bool = False) -> dict:
    """One fresh process: build, compile and capture the engine, then time it."""
    torch.manual_seed(0)
    models = make_models("llama3-8b", draft="random", device="cuda", num_layers=num_layers)
    chosen = [s for s in (shapes or {}).values() if s]
    # The loop's own shape: the widest chosen one, as fa3-spec eagle builds it.
    base = max(chosen, key=lambda s: s[2]) if chosen else CONFIG[1:]
    lc = workload.loop_config((CONFIG[0], *base), batch=max(buckets), context=1024,
                              max_new=500, max_context_len=1024 + 600, also=chosen,
                              attention_backend="fa3")
    eng = workload.engine(lc, models, scripted=True, buckets=buckets, device="cuda",
                          cache_path=cache, regions=False if inline else None, shapes=shapes,
                          unbacked_batch=unbacked)
    t0 = time.perf_counter()
    per = eng.capture()
    out = dict(mode="dynamic" if eng.policy.dynamic_batch else "static",
               batch="unbacked" if eng.policy.unbacked_batch else "backed",
               shapes={str(b): s and list(s) for b, s in eng.shapes.items()},
               compile_regions=eng.policy.regions,
               draft_attention=lc.draft_attention,
               seconds=round(time.perf_counter() - t0, 2),
               frames=sum(r.compile_counter.frame_count for r in eng.shape_runners.values()),
               captured_graphs=sum(len(r.buckets) for r in eng.shape_runners.values()),
               region_programs=regions.compiled_programs(),
               per_bucket={str(b): round(x, 2) for b, x in per.items()}, ms_per_iteration={},
               bucket_of_batch={}, ms_per_iteration_next_bucket={}, next_bucket_of_batch={},
               live_requests_after={}, breakdown={})
    g = torch.Generator().manual_seed(0)
    n = 0
    for b in timed:
        while n < b:
            eng.submit(torch.randint(0, models.vocab_size, (1024,), generator=g).tolist(), 500)
            n += 1
        eng.admit()
        bucket = eng.bucket_for(b)  # b requests, the rest of the bucket padding rows
        # And the next bucket up, if any: what a coarser bucket list costs these requests.
        timed_buckets = [bucket] + [x for x in buckets if x > bucket][:1]
        ms = ms_per_iteration(eng, timed_buckets)
        out["ms_per_iteration"][str(b)] = ms[0]
        out["bucket_of_batch"][str(b)] = bucket
        if len(ms) == 2:
            out["ms_per_iteration_next_bucket"][str(b)] = ms[1]
            out["next_bucket_of_batch"][str(b)] = timed_buckets[1]
        if breakdown:
            out["breakdown"][str(b)] = gpu_trace.breakdown(
                gpu_trace.profile_events(lambda: eng.launch(bucket), 5), top=0, top_kernels=None)
        # Every request still decoding (none finished and became padding while timed).
        out["live_requests_after"][str(b)] = int((eng.state["seq_lens"][:n] > 0).sum())
    # Where the compile went: seconds per phase PyTorch times (dynamo_timed),
    # summed over every frame and region program this process compiled.
    names, seconds = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    out["compile_phases_s"] = {n: round(float(x), 2) for n, x in zip(names, seconds)
                               if float(x) >= 0.5}
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--buckets", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--time-batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--no-restart", dest="restart", action="store_false",
                    help="skip the restart from the cold run's cache file")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--layers", choices=["regions", "inline"], default="regions",
                    help="the decoder layers as compiled regions (the engine's default) or "
                         "traced inline")
    ap.add_argument("--batch", choices=["backed", "unbacked"], default="backed",
                    help="the shared frame's batch symbol: backed (the engine's default; "
                         "bucket 1 compiles a frame of its own) or unbacked")
    ap.add_argument("--shapes", nargs="+", default=None, metavar="BUCKET=TOPK,STEPS,N|off",
                    help="each bucket's own shape (default: P 2 / topk 8 / N 16 everywhere)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also profile the bucket of each timed batch: GPU time per kernel "
                         "category and kernel")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--_child", metavar="CACHE", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    timed = sorted(args.time_batches)
    try:
        shapes = parse_bucket_shapes(args.shapes) if args.shapes else None
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if shapes is not None and sorted(shapes) != sorted(set(args.buckets)):
        print(f"{PROG}: --shapes must give exactly the --buckets, one shape each", file=sys.stderr)
        return 2
    if any(b > max(args.buckets) for b in timed):
        print(f"{PROG}: every --time-batches value must fit a bucket", file=sys.stderr)
        return 2
    if args._child:
        print(json.dumps(child(args._child, sorted(args.buckets), timed, args.num_layers,
                               args.layers == "inline", shapes, args.batch == "unbacked",
                               args.breakdown)))
        return 0
    if not torch.cuda.is_available():
        print(f"{PROG} times CUDA graphs: it needs a CUDA device", file=sys.stderr)
        return 2
    done = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "engine.cache")
        # The cold run writes the compile-cache file its restart loads.
        phases = ["cold", "restart"] if args.restart else ["cold"]
        for i, phase in enumerate(phases):
            cmd = [sys.executable, runs.script("compile.py"), "engine", "--_child", cache,
                   "--buckets", *map(str, args.buckets), "--time-batches", *map(str, timed),
                   "--layers", args.layers, "--batch", args.batch] + (
                       ["--shapes", *args.shapes] if shapes else []) + (
                       ["--breakdown"] if args.breakdown else [])
            if args.num_layers:
                cmd += ["--num-layers", str(args.num_layers)]
            row = runs.fresh_process_row(cmd, os.path.join(tmp, f"inductor-{i}"), phase)
            row["phase"] = phase
            done.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                runs.write_json(args.json, dict(
                    command=runs.command_line(PROG, argv), commit=runs.commit(),
                    torch=torch.__version__,
                    device=runs.device_name("cuda"), runs=done))
    return 0
