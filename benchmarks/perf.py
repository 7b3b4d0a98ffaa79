"""Issue 14's table in one run: `benchmarks/results/perf_h200.json`.

    python3 benchmarks/perf.py --json benchmarks/results/perf_h200.json   # H200 + FA3
    python3 benchmarks/perf.py --smoke --json /tmp/perf.json              # CPU, tiny

One row per scenario point (1-layer draft loop, FA3, 32/8 heads, D = 128):

* ``runner_staging_us``: host median of ``runner(**batch)`` minus
  ``graph.replay()`` (`runner_staging.py`);
* ``metadata_device_us``: one draft iteration's metadata alone
  (`build_draft_iteration_metadata`, compiled, captured), device time;
* ``metadata_kernels_per_step``: (kernels of the captured loop - kernels of
  the floor) / draft steps;
* ``loop_over_floor_device_pct``: the runner's graph over the floor (same
  loop on ready metadata), device time, in percent;
* ``upstream_baseline``: ``"sglang-0.5.23"`` when the draft loop's upstream
  column ran sglang's own replay metadata, else ``"model"``;

plus top-level ``cold_capture_s`` / ``warm_capture_s``: compile + capture of
16 buckets x all step modes (`compile_capture.py` in a subprocess with a
fresh inductor cache; warm = same process after ``dynamo.reset``, FX-graph
cache hits), summed over modes. Every value comes from this one process
(and its one subprocess); compare ratios within the file.
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
from fa3_spec.harness.worlds import make_world

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

#: (scenario, batch, page_size, topk, num_steps, num_draft_tokens, context): the issue's table.
POINTS = [
    ("seed", 1, 2, 8, 5, 16, 4096),
    ("seed", 8, 2, 8, 5, 16, 4096),
    ("latency", 1, 1, 4, 5, 8, 4096),
    ("page-sweep", 8, 64, 4, 5, 8, 8192),
    ("throughput", 64, 16, 4, 5, 8, 4096),
    ("scale-topk", 8, 2, 10, 5, 16, 4096),
]
SMOKE = [("smoke", 2, 2, 4, 3, 4, 64)]


def metadata_device_us(cfg, world, args):
    """Device time of one draft iteration's metadata, compiled and captured (None on CPU)."""
    batch, loc = world.batch(), world.out_cache_loc

    def iteration():
        return builders.build_draft_iteration_metadata(cfg, **batch, out_cache_loc=loc)

    compiled = torch.compile(iteration, fullgraph=True, backend=args.backend)
    if args.device != "cuda":
        compiled()
        return None
    from fa3_spec.probes import capture

    graph, _ = capture(compiled)
    _, (device_us, _) = bench._graph_times(graph, args.iters)
    return device_us


def compile_times(smoke):
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                        "compile_capture.py"), "--json", "-"]
    out = subprocess.run(cmd + (["--smoke"] if smoke else []), check=True, capture_output=True,
                         text=True).stdout
    rows = json.loads(out.strip().splitlines()[-1])["rows"]
    return (round(sum(r["cold_capture_s"] for r in rows), 2),
            round(sum(r["warm_capture_s"] for r in rows), 2), rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="benchmarks/results/perf_h200.json")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of every code path")
    parser.add_argument("--upstream", choices=("auto", "model"), default="auto")
    parser.add_argument("--no-compile", action="store_true", help="skip cold/warm capture")
    args = parser.parse_args()
    args.device = "cpu" if args.smoke else "cuda"
    args.backend = "aot_eager" if args.smoke else "inductor"
    args.profile = False
    if args.smoke:
        args.iters = min(args.iters, 3)
    args.upstream = bench.load_sglang(args)
    doc = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               torch=torch.__version__, fa3=fa3_spec.attention.provider_version(),
               command="python3 benchmarks/perf.py " + " ".join(sys.argv[1:]),
               cold_capture_s=None, warm_capture_s=None, rows=[])
    if not args.no_compile:
        doc["cold_capture_s"], doc["warm_capture_s"], doc["compile_rows"] = compile_times(args.smoke)
    for name, bs, p, k, steps, n, context in (SMOKE if args.smoke else POINTS):
        cfg = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=steps, num_draft_tokens=n,
                                  max_bs=bs, max_context_len=context)
        g = torch.Generator().manual_seed(bs)
        seqs = torch.randint(max(1, context * 3 // 4), context + 1, (bs,), generator=g).tolist()
        world = make_world(cfg, bs, seq_lens=seqs, seed=1, device=args.device)
        cfg = dataclasses.replace(cfg, num_pages=world.num_pages)
        torch._dynamo.reset()
        start = time.perf_counter()
        loop = bench.draft_loop_row(cfg, world, bs, args)
        torch._dynamo.reset()
        over = loop.get("fa3_spec_over_floor_minus_1")
        row = dict(scenario=name, batch=bs, page_size=p, topk=k, num_steps=steps, context=context,
                   runner_staging_us=loop["runner_staging_us"],
                   zero_copy_staging_us=loop.get("zero_copy_staging_us"),
                   metadata_device_us=metadata_device_us(cfg, world, args),
                   metadata_kernels_per_step=loop.get("metadata_kernels_per_step"),
                   loop_over_floor_device_pct=None if over is None else round(100 * over, 2),
                   upstream_baseline=loop["upstream_baseline"],
                   draft_loop=loop, bench_s=round(time.perf_counter() - start, 1))
        doc["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "draft_loop"}), flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:  # after every row: a cut-off run keeps its rows
            json.dump(doc, fh, indent=1)
        del world
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
