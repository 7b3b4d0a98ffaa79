"""The metadata's own cost inside the draft loop, per scenario point: one
draft iteration's metadata on the device, its kernels, the runner's staging,
and the loop over its floor (CUDA + FA3; ``--smoke``: CPU, tiny).

One row per point (1-layer draft loop, FA3, 32/8 heads, D = 128):

* ``runner_staging_us``: host median of ``runner(**batch)`` minus
  ``graph.replay()`` (``metadata.py staging``);
* ``metadata_device_us``: one draft iteration's metadata alone
  (`build_draft_iteration_metadata`, compiled with `INDUCTOR_OPTIONS`),
  device time per iteration of a graph that captures ``REPEAT`` iterations
  back to back (CUDA events around its replay, divided by ``REPEAT``: the
  graph's launch latency is not charged), and ``metadata_kernels``: its
  launches with their device times (the first iteration's); the
  ``*_inductor_defaults`` twins are the same without the options (combo
  kernels off), in the same process;
* ``metadata_kernels_per_step``: (kernels of the captured loop - kernels of
  the floor) / draft steps;
* ``loop_over_floor_device_pct``: the runner's graph over the floor (the same
  loop on ready metadata), device time, in percent;
* ``upstream_baseline``: ``"sglang-0.5.23"`` when the draft loop's upstream
  column ran sglang's own replay metadata, else ``"model"``;

plus the verify points (the 1-layer verify step through the runner against
its floor) and top-level ``cold_capture_s`` / ``warm_capture_s``: the
runner's compile + capture of 16 buckets x every step mode (``compile.py
runner`` in a subprocess), summed over modes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import torch

import fa3_spec
from fa3_spec import builders
from fa3_spec.graphs import INDUCTOR_OPTIONS, compile_fullgraph
from fa3_spec.harness.worlds import make_world

import metadata_scenarios
import runs
import timing

PROG = "metadata.py perf"
HELP = "the metadata's device time and kernels, runner staging, the loop over its floor"

#: (scenario, batch, page_size, topk, num_steps, num_draft_tokens, context): the
#: draft-loop points of the performance pass.
POINTS = [
    ("seed", 1, 2, 8, 5, 16, 4096),
    ("seed", 8, 2, 8, 5, 16, 4096),
    ("latency", 1, 1, 4, 5, 8, 4096),
    ("page-sweep", 8, 64, 4, 5, 8, 8192),
    ("throughput", 64, 16, 4, 5, 8, 4096),
    ("scale-topk", 8, 2, 10, 5, 16, 4096),
]
SMOKE = [("smoke", 2, 2, 4, 3, 4, 64)]
#: Target-verify points (the 1-layer verify step through the runner against its floor).
VERIFY_POINTS = [("verify-tree", 64, 16, 4, 5, 8, 4096), ("verify-seed", 64, 2, 8, 5, 16, 4096)]
VERIFY_SMOKE = [("verify-smoke", 2, 2, 4, 3, 4, 64)]


#: Iterations captured back to back in one graph to time the metadata alone:
#: a graph of a few 1-µs kernels is otherwise mostly its own launch latency.
REPEAT = 20


def metadata_profile(cfg, world, args, options=None):
    """One draft iteration's metadata alone, compiled (inductor ``options``,
    default `INDUCTOR_OPTIONS`) and captured: ``(device_us, kernels)`` with
    ``kernels`` the profiler's ``[name, device_us]`` per launch of one
    replay. ``(None, None)`` on CPU."""
    batch, loc = world.batch(), world.out_cache_loc

    def iteration():
        return builders.build_draft_iteration_metadata(cfg, **batch, out_cache_loc=loc)

    torch._dynamo.reset()
    compiled = compile_fullgraph(iteration, compile_backend=args.compile_backend, options=options)
    if args.device != "cuda":
        compiled()
        return None, None
    from torch.profiler import ProfilerActivity, profile

    from fa3_spec.graphs import capture

    repeated, _ = capture(lambda: [compiled() for _ in range(REPEAT)])
    _, (device_us, _) = timing.event_us(repeated.replay, args.iters)
    device_us = round(device_us / REPEAT, 2)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        repeated.replay()
        torch.cuda.synchronize()
    launches = [[e.name[:120], round(e.device_time, 2)] for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA]
    return device_us, launches[: len(launches) // REPEAT]  # the first iteration's


def compile_times(smoke):
    """``(cold s, warm s, rows)`` of ``compile.py runner`` in a fresh process, summed over modes."""
    cmd = [sys.executable, runs.script("compile.py"), "runner", "--json", "-"]
    out = subprocess.run(cmd + (["--smoke"] if smoke else []), check=True, capture_output=True,
                         text=True).stdout
    rows = json.loads(out.strip().splitlines()[-1])["rows"]
    return (round(sum(r["cold_capture_s"] for r in rows), 2),
            round(sum(r["warm_capture_s"] for r in rows), 2), rows)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run of every code path")
    ap.add_argument("--upstream", choices=("auto", "model"), default="auto")
    ap.add_argument("--no-compile", action="store_true", help="skip cold/warm capture")
    ap.add_argument("--points", type=int, nargs="*",
                    help="indices into POINTS + VERIFY_POINTS (default: all)")
    ap.add_argument("--inductor-options", type=json.loads,
                    help="JSON that replaces fa3_spec.graphs.INDUCTOR_OPTIONS for this run")
    ap.add_argument("--kernel-names", action="store_true",
                    help="record the loop's and the floor's kernel names")
    ap.add_argument("--append", action="store_true",
                    help="add to the rows already in --json (a run split over calls)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.inductor_options is not None:
        INDUCTOR_OPTIONS.clear()
        INDUCTOR_OPTIONS.update(args.inductor_options)
    args.device = "cpu" if args.smoke else "cuda"
    args.compile_backend = "eager" if args.smoke else "inductor"  # smoke: tracing, no compile
    args.profile = False
    args.layers = 1
    if args.smoke:
        args.iters = min(args.iters, 3)
    args.upstream = metadata_scenarios.load_sglang(args)
    doc = dict(device=runs.device_name(args.device), torch=torch.__version__,
               fa3=fa3_spec.attention.provider_version(), commands=[],
               inductor_options=INDUCTOR_OPTIONS, cold_capture_s=None, warm_capture_s=None,
               rows=[])
    if args.append and os.path.exists(args.json):
        with open(args.json) as fh:
            doc = json.load(fh)
    doc["commands"].append(runs.command_line(PROG, argv))
    if not args.no_compile:
        doc["cold_capture_s"], doc["warm_capture_s"], doc["compile_rows"] = compile_times(args.smoke)
        runs.write_json(args.json, doc)
    points = (SMOKE + VERIFY_SMOKE) if args.smoke else (POINTS + VERIFY_POINTS)
    for index, point in enumerate(points):
        if args.points is not None and index not in args.points:
            continue
        name, bs, p, k, steps, n, context = point
        cfg = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=steps, num_draft_tokens=n,
                                  max_bs=bs, max_context_len=context)
        g = torch.Generator().manual_seed(bs)
        seqs = torch.randint(max(1, context * 3 // 4), context + 1, (bs,), generator=g).tolist()
        world = make_world(cfg, bs, seq_lens=seqs, seed=1, device=args.device)
        cfg = dataclasses.replace(cfg, num_pages=world.num_pages)
        start = time.perf_counter()
        row = (verify_point if name.startswith("verify") else draft_point)(cfg, world, bs, args)
        row = dict(scenario=name, batch=bs, page_size=p, topk=k, num_steps=steps,
                   num_draft_tokens=n, context=context, **row,
                   bench_s=round(time.perf_counter() - start, 1))
        doc["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("draft_loop", "verify")}),
              flush=True)
        runs.write_json(args.json, doc)  # after every row: a cut-off run keeps its rows
        del world
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return 0


def draft_point(cfg, world, bs, args):
    """The performance pass's fields for one draft-loop point."""
    torch._dynamo.reset()
    loop = metadata_scenarios.draft_loop_row(cfg, world, bs, args)
    over = loop.get("fa3_spec_over_floor_minus_1")
    meta = metadata_profile(cfg, world, args)
    plain = metadata_profile(cfg, world, args, options={})  # combo kernels off
    return dict(runner_staging_us=loop["runner_staging_us"],
                zero_copy_staging_us=loop.get("zero_copy_staging_us"),
                metadata_device_us=meta[0], metadata_kernels=meta[1],
                metadata_device_us_inductor_defaults=plain[0],
                metadata_kernels_inductor_defaults=plain[1],
                metadata_kernels_per_step=loop.get("metadata_kernels_per_step"),
                loop_over_floor_device_pct=None if over is None else round(100 * over, 2),
                upstream_baseline=loop["upstream_baseline"], draft_loop=loop)


def verify_point(cfg, world, bs, args):
    """A target-verify point: the runner's graph against its floor and the model."""
    torch._dynamo.reset()
    verify = metadata_scenarios.verify_row(cfg, world, bs, args)
    over = verify.get("fa3_spec_over_floor_minus_1")
    return dict(runner_staging_us=None, metadata_device_us=None, metadata_kernels_per_step=None,
                loop_over_floor_device_pct=None if over is None else round(100 * over, 2),
                upstream_over_fa3_spec=verify.get("upstream_over_fa3_spec"),
                upstream_baseline=verify["upstream_baseline"], verify=verify)

