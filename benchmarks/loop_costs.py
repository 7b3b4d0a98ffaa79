"""A cost profile: the ms of one iteration of each candidate tree shape, and of
one plain decode step, at each batch bucket, on this machine and model.

The speculation policy (`fa3_spec.eagle.policy.choose_shapes`) weighs these
costs against an acceptance profile to give each bucket its shape; the costs
are measured once per machine and model, written with `CostProfile.save`
(``--out``), and read by ``fa3-spec eagle --cost-profile``. Each (shape,
bucket) is an engine of that bucket alone (``batch`` requests of
``--context`` prompt tokens, every row live), on the engine's default
compile and capture for the device; its launches are timed back to back
after warm-up (CUDA events on the GPU, wall time on the CPU), median of
``--iters``. The plain row is the engine's own plain decode step
(`fa3_spec.eagle.iteration.plain_iteration`), what a bucket that does not
speculate runs.

Acceptance changes an iteration's work little (the commit and the draft
extend grow with the accepted path), but it is set: with
``--acceptance-profile`` the engine's acceptance hook draws each node's
acceptance from that profile (`fa3_spec.eagle.acceptance.profile_acceptance`),
else the benchmarks' scripted counts.

    python3 benchmarks/loop.py costs --smoke --json /tmp/costs_rows.json  # CPU, tiny
    python3 benchmarks/loop.py costs --preset llama3-8b --batches 1 2 4 8 16 32 64 \\
        --acceptance-profile high.json --out costs.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from fa3_spec.eagle import make_models
from fa3_spec.eagle.acceptance import profile_acceptance
from fa3_spec.eagle.policy import AcceptanceProfile, CostProfile, shape_key

import runs
import timing
import workload

PROG = "loop.py costs"
HELP = "ms per iteration of candidate tree shapes and of plain decoding per bucket (a cost profile)"

#: Chains and trees of a few widths and depths.
CANDIDATES = ["1,2,3", "1,4,5", "1,6,7", "2,3,6", "4,3,8", "4,5,8", "8,5,16", "8,6,24"]


def parse_shape(text: str) -> tuple:
    shape = tuple(int(x) for x in text.split(","))
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(text)
    return shape


def live_engine(models, shape, batch: int, args, hook):
    """An engine of one bucket, ``batch``, running ``shape`` (None: plain
    decoding), every row live with a prompt of ``args.context`` tokens and
    room for ``args.warmup + args.iters`` launches without finishing."""
    torch._dynamo.reset()  # one engine at a time; its compiled frames are its own
    k, s, n = shape or (1, 2, 2)
    max_new = (args.warmup + args.iters) * (n + 1) + 8
    lc = workload.loop_config((args.page_size, k, s, n), batch=batch, context=args.context,
                              max_new=max_new, draft_attention=args.draft_attention,
                              attention_backend=args.attention_backend)
    eng = workload.engine(lc, models, device=args.device, buckets=[batch], max_reqs=batch,
                          shapes={batch: shape}, **({} if hook is None else dict(acceptance=hook)),
                          scripted=hook is None)
    eng.capture()
    for prompt in workload.random_prompts(batch, args.context, models.vocab_size, seed=batch):
        eng.submit(prompt, max_new)
    eng.admit()
    return eng


def launch_seconds(eng, batch: int, iters: int, warmup: int) -> list:
    """Seconds of each of ``iters`` launches of the bucket, after ``warmup``
    (CUDA events on the GPU, wall time on the CPU)."""
    launch = lambda: eng.launch(batch)  # noqa: E731
    if eng.device.type == "cuda":
        return timing.event_samples(launch, iters, warmup=warmup)[1]
    return timing.samples(launch, iters, timing.no_sync, warmup=warmup)[1]


def iteration_ms(models, shape, batch: int, args, hook) -> float:
    """Median ms of one launch of ``shape``'s iteration (None: a plain decode
    step) at ``batch`` live rows."""
    eng = live_engine(models, shape, batch, args, hook)
    return 1e3 * statistics.median(launch_seconds(eng, batch, args.iters, args.warmup))


def add_loop_arguments(ap: argparse.ArgumentParser) -> None:
    """The model, machine and workload flags `live_engine` reads (shared with
    ``loop.py policy``)."""
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", nargs="+", default=CANDIDATES, metavar="TOPK,STEPS,N",
                    help="candidate shapes")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--page-size", type=int, default=2)
    ap.add_argument("--draft-attention", default="ancestors", choices=["ancestors", "branch"])
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "fa3", "torch"])
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per row")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", metavar="PATH", help="the rows, with the command")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, tiny preset, batches 1 and 2, two shapes, a short context")


def smoke_settings(args: argparse.Namespace) -> None:
    """What ``--smoke`` sets: a CPU run of seconds."""
    args.preset, args.device, args.batches = "tiny", "cpu", [1, 2]
    args.shapes, args.context, args.iters, args.warmup = ["1,2,3", "4,3,8"], 32, 3, 1
    args.attention_backend = "torch"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_loop_arguments(ap)
    ap.add_argument("--acceptance-profile", metavar="FILE.json", default=None,
                    help="draw acceptance from this profile (default: scripted counts)")
    ap.add_argument("--out", metavar="FILE.json", default=None,
                    help="the cost profile (required unless --smoke)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.smoke:
        smoke_settings(args)
    elif args.out is None:
        print("--out is required: where the cost profile goes", file=sys.stderr)
        return 2
    try:
        shapes = [parse_shape(s) for s in args.shapes]
    except ValueError as exc:
        print(f"--shapes: expected TOPK,STEPS,N of ints >= 1, got {exc}", file=sys.stderr)
        return 2
    if min(args.batches) < 1 or args.iters < 1 or args.context < 1:
        print("--batches, --iters and --context must be >= 1", file=sys.stderr)
        return 2
    hook = None
    if args.acceptance_profile:
        try:
            hook = profile_acceptance(AcceptanceProfile.load(args.acceptance_profile).rates)
        except ValueError as exc:
            print(f"--acceptance-profile: {exc}", file=sys.stderr)
            return 2
    models = make_models(args.preset, draft="random", device=args.device,
                         num_layers=args.num_layers)
    device = runs.device_name(args.device)
    doc = dict(command=runs.command_line(PROG, argv), torch=torch.__version__, device=device,
               preset=args.preset, context=args.context, page_size=args.page_size,
               draft_attention=args.draft_attention,
               acceptance=args.acceptance_profile or workload.SCRIPTED, rows=[])
    plain, costs = {}, {}
    for batch in sorted(set(args.batches)):
        costs[batch] = {}
        for shape in [None] + shapes:
            t0 = time.perf_counter()
            ms = iteration_ms(models, shape, batch, args, hook)
            key = "plain" if shape is None else shape_key(shape)
            if shape is None:
                plain[batch] = ms
            else:
                costs[batch][key] = ms
            doc["rows"].append(dict(batch=batch, shape=key, ms_per_iteration=round(ms, 4),
                                    seconds=round(time.perf_counter() - t0, 1)))
            print(f"batch {batch:>3} {key:>7}: {ms:8.3f} ms", flush=True)
            if args.json:
                runs.write_json(args.json, doc)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    profile = CostProfile(plain=plain, shapes=costs, device=device,
                          model=f"{args.preset} ({args.num_layers or 'all'} layers), context "
                                f"{args.context}, page size {args.page_size}, "
                                f"{args.draft_attention}")
    if args.out:
        profile.save(args.out)
    if args.json:
        doc["cost_profile"] = dict(plain=plain, shapes=costs)
        runs.write_json(args.json, doc)
    return 0
