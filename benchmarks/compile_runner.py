"""Compile + capture cost of the CUDA-graph runner: 16 buckets, every step mode.

For each step mode (draft iteration, tree verify, chain verify, draft extend)
of the toy 1-layer model, a `CUDAGraphRunner` over 16 batch-size buckets with
inductor (`INDUCTOR_OPTIONS`) and the batch dimension dynamic; per mode the
compiled frames, dynamo's recompile reasons, and the capture time in three
phases:

* *cold*: a fresh inductor cache directory, the first runner in the process;
  it writes PyTorch's compile artifacts to a file (``cache_path=``);
* *warm*: the same process after ``torch._dynamo.reset()``, a second runner
  (inductor's in-process and on-disk caches hit);
* *restart*: a new process with another fresh inductor cache directory that
  loads only the artifact file: an engine restarting with the file kept.

It also checks one replay against eager (``replay_rel_err``). Needs CUDA +
FA3; ``--smoke`` runs a tiny CPU version with strategy "eager" (no restart).
``--json -`` prints the rows as one JSON line (for ``metadata.py``'s
``perf``).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import fa3_spec
from fa3_spec.graphs import CompilePolicy, CUDAGraphRunner
from fa3_spec.harness.toy import STEP_VARIANTS, ToyModel, example_batch, make_step, world_batch
from fa3_spec.harness.worlds import make_world, rebase_world
from fa3_spec.probes import recompile_reasons

import runs

PROG = "compile.py runner"
HELP = "compile + capture of the CUDA-graph runner: 16 buckets x every step mode"
BUCKETS = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 24, 32, 40, 48, 64]


def measure(mode, tree, smoke, cache_file=None):
    """The row of one step mode: every phase this process runs, and the replay check."""
    device = "cpu" if smoke else "cuda"
    buckets = BUCKETS[:3] if smoke else BUCKETS
    cfg = fa3_spec.SpecConfig(page_size=2, topk=8, num_steps=5, num_draft_tokens=16,
                              max_bs=max(buckets), max_context_len=64 if smoke else 4096)
    base = make_world(cfg, max(buckets), seed=0, device=device)
    model = ToyModel.create(layers=1, num_pages=base.num_pages, page_size=2,
                            num_heads=4 if smoke else 32, num_kv_heads=2 if smoke else 8,
                            head_dim=64 if smoke else 128,
                            dtype=torch.float32 if smoke else torch.bfloat16, device=device)
    step = make_step(mode, cfg, model, base.req_to_token,
                     attention_backend="torch" if smoke else "fa3",
                     tree=tree)
    row = dict(kind="compile", mode=mode, tree=tree if mode == "target_verify" else None,
               buckets=len(buckets), page_size=2, topk=8, num_steps=5, num_draft_tokens=16)
    policy = CompilePolicy.eager() if smoke else CompilePolicy()  # inductor, graphs, dynamic batch
    phases = ("restart",) if cache_file and os.path.exists(cache_file) else ("cold", "warm")
    for phase in phases:
        torch._dynamo.reset()
        runner = CUDAGraphRunner(step, buckets=buckets, policy=policy,
                                 cache_path=cache_file if phase != "warm" else None,
                                 example=lambda bs: example_batch(mode, cfg, model, bs, device=device,
                                                                  tree=tree))
        start = time.perf_counter()
        runner.capture()
        row[f"{phase}_capture_s"] = round(time.perf_counter() - start, 2)
        row[f"{phase}_compiles"] = runner.compile_counter.frame_count
        row[f"{phase}_recompile_reasons"] = [  # since the reset above: this phase's
            f"{guard} ({file}:{line})" for guard, file, line, _ in recompile_reasons()]
        seconds = runner.capture_seconds  # the first (largest) bucket carries the compile
        row[f"{phase}_first_bucket_s"] = round(seconds[max(buckets)], 2)
        row[f"{phase}_bucket_1_s"] = round(seconds[min(buckets)], 2)
    row["max_bucket_capture_s"] = round(max(runner.capture_seconds.values()), 3)
    initial = (model.k_cache.clone(), model.v_cache.clone())
    bs = min(5, max(buckets))
    world = rebase_world(make_world(cfg, bs, seed=3, num_padding=1, device=device), base.req_to_token)
    rows = cfg.topk if mode == "draft_decode" else cfg.num_draft_tokens
    hidden = torch.randn(bs, rows, model.hidden, device=device).to(model.wq.dtype)
    batch = world_batch(mode, world, hidden, tree=tree)
    got = runner(**batch).clone()
    model.k_cache.copy_(initial[0])
    model.v_cache.copy_(initial[1])
    want = step(**batch)
    row["replay_rel_err"] = float((got.float() - want.float()).norm() / want.float().norm())
    return row


def restart(mode, tree, cache_file):
    """The *restart* phase of one mode in a new process with a fresh inductor cache."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="fa3spec-inductor-"))
    cmd = [sys.executable, runs.script("compile.py"), "runner", "--json", "-", "--modes", mode,
           "--tree", str(tree), "--cache-file", cache_file]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])["rows"][0]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="a path, or - for one JSON line on stdout")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--modes", nargs="+", default=sorted({m for m, _ in STEP_VARIANTS}))
    ap.add_argument("--tree", choices=("True", "False", "None"),
                    help="only this tree variant (with one --modes)")
    ap.add_argument("--cache-file", help=argparse.SUPPRESS)  # the restart phase's child
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if not args.smoke:  # a cold compile: a fresh inductor cache unless the caller chose one
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="fa3spec-inductor-"))
    rows = []
    for mode, tree in STEP_VARIANTS:
        if mode not in args.modes or (args.tree is not None and str(tree) != args.tree):
            continue
        if args.cache_file:  # child process of `restart`
            rows.append(measure(mode, tree, args.smoke, args.cache_file))
            continue
        cache_file = None if args.smoke else tempfile.mktemp(prefix="fa3spec-artifacts-")
        row = measure(mode, tree, args.smoke, cache_file)
        if cache_file and os.path.exists(cache_file):
            child = restart(mode, tree, cache_file)
            row.update({k: v for k, v in child.items() if k.startswith("restart_")})
            row["artifact_bytes"] = os.path.getsize(cache_file)
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    if args.json == "-":
        print(json.dumps(dict(torch=torch.__version__, rows=rows)), flush=True)
    elif args.json:
        runs.write_json(args.json, dict(command=runs.command_line(PROG, argv),
                                        torch=torch.__version__, rows=rows))
    return 0
