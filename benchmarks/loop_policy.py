"""The per-bucket speculation policy against plain decoding, per acceptance
profile, with each fixed shape against its floors: the file the loop's
performance targets are read from (``benchmarks/results/loop.json``).

Acceptance on random weights comes from the profile itself: the engine's
acceptance hook accepts each draft node with its depth and sibling rank's
rate (`fa3_spec.eagle.acceptance.profile_acceptance`, seeded), so a bigger
tree accepts more in expectation, as with a trained head. The hook reads its
rates from a device table, so one captured engine per shape serves every
profile.

Each shape (and plain decoding) is one engine over every bucket of
``--batches``, as in ``loop.py costs``; each bucket is timed from the same
admitted state, every row live, ``--iters`` launches after ``--warmup``, once
per profile: the median ms per iteration, and tokens/s as the tokens the rows
emitted per launch over that median.
The costs of the first profile are the cost profile the policy
(`choose_shapes`) weighs, unless ``--cost-profile`` gives one measured
before (then only the shapes it picks and the ``--fixed`` ones run). The
JSON holds:

* ``rows``: per profile and bucket, the chosen shape (``"off"``: plain
  decoding; with ``--max-shapes K``, at most K of them over the buckets),
  its expected and measured accept length, its tokens/s against plain
  decoding's, and the tokens/s of the largest candidate tree at that
  bucket (what one shape for every bucket gives);
* ``fixed``: each ``--fixed`` config's ms per iteration at each bucket under
  the first profile, against its bytes floor (the bytes it reads over the
  read bandwidth) and its compute floor (its matmul FLOPs over the matmul
  throughput), both roofs measured in the same run (`floors`);
* ``plain``: the plain step's ms at each bucket against its bytes floor, and
  ``plain_roofline_frac`` at batch 1;
* with ``--cold-start``: ``cold_compile_capture_s`` and ``restart_s`` of the
  engine the CLI would build with the first profile's choices (``compile.py
  engine --shapes``, fresh processes);
* ``measured``: every (shape, bucket, profile) timing.

    python3 benchmarks/loop.py policy --smoke --json /tmp/policy.json          # CPU, tiny
    FA3_SPEC_COMMIT=$(git rev-parse --short HEAD) python3 benchmarks/loop.py policy \\
        --profiles high measured=smollm2.json --cold-start --json loop.json  # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

from fa3_spec.eagle.acceptance import profile_acceptance
from fa3_spec.eagle.policy import (AcceptanceProfile, CostProfile, choose_shapes,
                                   expected_accept_length, parse_shape_key, shape_key)

import floors
import loop_costs
import runs
import workload

PROG = "loop.py policy"
HELP = ("the per-bucket shape the policy picks against plain decoding, per acceptance "
        "profile; fixed shapes against their floors")

#: A profile whose P 2 / topk 8 / N 16 tree accepts about 3.5 tokens per
#: iteration (the rate of the first sibling 0.7 at every depth).
HIGH = AcceptanceProfile(tuple((0.7, 0.1, 0.04, 0.02, 0.01, 0.01, 0.005, 0.005)
                               for _ in range(6)))

#: The fixed shapes the floors are reported for: a tree and a chain.
FIXED = ["2,8,5,16", "16,1,5,6"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    loop_costs.add_loop_arguments(ap)
    ap.add_argument("--cost-profile", metavar="FILE.json", default=None,
                    help="the costs the policy weighs (default: measured here first, over "
                         "--shapes, under the first profile)")
    ap.add_argument("--profiles", nargs="+", default=["high"], metavar="NAME[=FILE.json]",
                    help="acceptance profiles: 'high' (built in: about 3.5 tokens per "
                         "iteration on the P 2 / topk 8 / N 16 tree) or NAME=FILE.json")
    ap.add_argument("--fixed", nargs="*", default=FIXED, metavar="P,TOPK,STEPS,N",
                    help="configs held against their floors under the first profile")
    ap.add_argument("--max-shapes", type=int, default=None, metavar="K",
                    help="the policy uses at most K shapes over all the buckets, plain decoding "
                         "counting as one (`choose_shapes`' max_shapes; default: no bound)")
    ap.add_argument("--cold-start", action="store_true",
                    help="also time a cold compile + capture and a restart of the engine with "
                         "the first profile's choices (CUDA; fresh processes)")
    ap.add_argument("--seed", type=int, default=0, help="of the acceptance draws")
    ap.add_argument("--resume", metavar="FILE.json", default=None,
                    help="a cut-off run's JSON (same model, workload and profiles): the "
                         "engines it measured are not built again")
    return ap


#: What a resumed run must share with the run it resumes.
SAME = ("preset", "context", "page_size", "draft_attention", "profiles", "batches", "iters",
        "warmup", "seed", "device", "draft_logit_std", "kernels")


def resumed(path, doc) -> dict:
    """The timings of a cut-off run at ``path`` as `main`'s ``times``, its
    capture seconds copied into ``doc``; ValueError naming ``--resume`` when
    it is not a run of the same settings."""
    try:
        with open(path) as fh:
            old = json.load(fh)
        differ = [k for k in SAME if old.get(k) != doc[k]]
        measured = old["measured"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"--resume: {path} is not a loop.py policy result ({exc})") from None
    if differ:
        raise ValueError(f"--resume: {path} differs in {', '.join(differ)}")
    times = {}
    for m in measured:
        shape = None if m["shape"] == "plain" else parse_shape_key(m["shape"])
        times.setdefault((m["page_size"], shape), {})[(m["batch"], m["profile"])] = (
            m["ms_per_iteration"], m["tokens_per_s"], m["accept_length"])
    doc["measured"] = list(measured)
    doc["capture_s"] = dict(old.get("capture_s", {}))
    return times


def load_profiles(specs) -> dict:
    out = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if not path:
            if name != "high":
                raise ValueError(f"--profiles: {spec!r} is neither 'high' nor NAME=FILE.json")
            out[name] = HIGH
        else:
            out[name] = AcceptanceProfile.load(path)
    return out


def table_hook(profiles: dict, seed: int, device):
    """One acceptance hook whose device table fits every profile (the first
    one's rates in it, zero-padded)."""
    depth = max(len(p.rates) for p in profiles.values())
    width = max(len(p.rates[0]) for p in profiles.values())
    first = next(iter(profiles.values())).rates
    padded = [list(first[d]) + [0.0] * (width - len(first[d])) if d < len(first)
              else [0.0] * width for d in range(depth)]
    return profile_acceptance(padded, seed, device=device)


def measure_shape(models, shape, batches, args, hook, profiles, page_size=None) -> dict:
    """``{(batch, profile): (ms per iteration, tokens/s, emitted per row-iteration)}``
    of one engine of ``shape`` (None: plain decoding), and its capture seconds."""
    engine = loop_costs.ShapeEngine(models, shape, batches, args, hook, page_size=page_size)
    out = {}
    for name, profile in profiles.items():
        hook.set_rates(profile.rates)
        for b in batches:
            seconds, emitted = engine.measure(b)
            median = statistics.median(seconds)  # robust to a stray slow launch, as ms is
            out[(b, name)] = (1e3 * median, emitted / len(seconds) / median,
                              emitted / (b * len(seconds)))
    capture_s = engine.capture_s
    engine.close()
    hook.set_rates(next(iter(profiles.values())).rates)
    return dict(times=out, capture_s=capture_s)


def cold_start(choices: dict, args) -> dict:
    """Cold compile + capture and restart seconds of the engine with ``choices``
    (``compile.py engine --shapes``: fresh processes, an empty inductor cache)."""
    shapes = [f"{b}={'off' if c.shape is None else ','.join(map(str, c.shape))}"
              for b, c in sorted(choices.items())]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "engine.json")
        cmd = [sys.executable, runs.script("compile.py"), "engine", "--shapes", *shapes,
               "--buckets", *map(str, sorted(choices)), "--time-batches", "1", "--json", path]
        if args.num_layers:
            cmd += ["--num-layers", str(args.num_layers)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"cold start failed:\n{done.stderr[-3000:]}")
        with open(path) as fh:
            phases = {r["phase"]: r for r in json.load(fh)["runs"]}
    return dict(cold_compile_capture_s=phases["cold"]["seconds"],
                restart_s=phases["restart"]["seconds"],
                cold_start=dict(shapes=shapes, command=" ".join(cmd[1:]), runs=phases))


def floor_rows(models, config, batches, ms, args, roofs) -> list:
    """``config``'s ms per iteration at each bucket against its bytes and compute floors."""
    p, k, s, n = config
    rows = []
    for b in batches:
        row = dict(config=",".join(map(str, config)), batch=b, ms_per_iteration=round(ms[b], 4))
        if roofs:
            bandwidth, tflops = roofs
            spec = workload.loop_config(config, batch=b, context=args.context, max_new=1).spec
            nbytes = floors.forward_bytes(models, b, args.context)
            bytes_ms = (nbytes["target"] + s * nbytes["draft"]) / (bandwidth * 1e12) * 1e3
            flops_ms = floors.forward_flops(models, spec, b, args.context)["a"] / (tflops * 1e12) * 1e3
            floor = max(bytes_ms, flops_ms)
            row.update(bytes_floor_ms=round(bytes_ms, 4), compute_floor_ms=round(flops_ms, 4),
                       over_floor=round(ms[b] / floor, 3),
                       bound="compute" if flops_ms > bytes_ms else "bandwidth")
        rows.append(row)
    return rows


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.smoke:
        loop_costs.smoke_settings(args)
        args.fixed = ["2,4,3,8"]
    try:
        profiles = load_profiles(args.profiles)
        shapes = loop_costs.parse_shapes(args.shapes)
        fixed = [workload.parse_config(c) for c in args.fixed]
        costs = CostProfile.load(args.cost_profile) if args.cost_profile else None
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    try:
        kernels = loop_costs.select_run_kernels(args)
    except ValueError as exc:
        print(f"--kernels: {exc}", file=sys.stderr)
        return 2
    if args.max_shapes is not None and args.max_shapes < 1:
        print(f"--max-shapes must be >= 1, got {args.max_shapes}", file=sys.stderr)
        return 2
    if args.cold_start and args.device != "cuda":
        print("--cold-start times CUDA graphs: it needs --device cuda", file=sys.stderr)
        return 2
    device = runs.device_name(args.device)
    batches = sorted(set(args.batches))
    missing = [b for b in batches if costs is not None and b not in costs.plain]
    if missing:  # before anything is measured
        print(f"--cost-profile {args.cost_profile!r} has no measurement for --batches "
              f"{missing} (it has {sorted(costs.plain)})", file=sys.stderr)
        return 2
    first = next(iter(profiles))
    doc = dict(command=runs.command_line(PROG, argv), commit=runs.commit(),
               torch=torch.__version__, device=device, preset=args.preset,
               context=args.context, page_size=args.page_size,
               draft_attention=args.draft_attention, cost_profile=args.cost_profile,
               profiles={k: [list(r) for r in p.rates] for k, p in profiles.items()},
               batches=batches, iters=args.iters, warmup=args.warmup, seed=args.seed,
               draft_logit_std=args.draft_logit_std, kernels=kernels,
               max_shapes=args.max_shapes, capture_s={}, measured=[])
    try:
        times = resumed(args.resume, doc) if args.resume else {}
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    try:
        models = loop_costs.random_models(args)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    roofs = None
    if args.device == "cuda":
        roofs = (floors.read_bandwidth(), floors.matmul_throughput())
        doc.update(read_bandwidth_TBps=round(roofs[0], 3), matmul_TFLOPs=round(roofs[1], 1))
    hook = table_hook(profiles, args.seed, args.device)
    # times: (page size, shape or None) -> {(batch, profile): (ms, tok/s, accept)}

    def run(shape, page_size=args.page_size):
        if (page_size, shape) in times:
            return times[(page_size, shape)]
        got = measure_shape(models, shape, batches, args, hook, profiles, page_size=page_size)
        times[(page_size, shape)] = got["times"]
        label = f"P {page_size} " + ("plain" if shape is None else shape_key(shape))
        doc["capture_s"][label] = round(got["capture_s"], 1)
        for (b, name), (ms, tps, acc) in sorted(got["times"].items()):
            doc["measured"].append(dict(page_size=page_size,
                                        shape="plain" if shape is None else shape_key(shape),
                                        batch=b, profile=name, ms_per_iteration=round(ms, 4),
                                        tokens_per_s=round(tps, 2), accept_length=round(acc, 4)))
            print(f"{label:>12} batch {b:>3} {name}: {ms:8.3f} ms  {tps:9.1f} tok/s", flush=True)
        if args.json:
            runs.write_json(args.json, doc)
        return got["times"]

    plain = run(None)
    if costs is None:  # measured here, under the first profile
        table = {b: {} for b in batches}
        for shape in shapes:
            for b in batches:
                table[b][shape_key(shape)] = run(shape)[(b, first)][0]
        costs = CostProfile(plain={b: plain[(b, first)][0] for b in batches}, shapes=table,
                            device=device, model=args.preset)
        doc["cost_profile"] = dict(plain=costs.plain, shapes=costs.shapes)
    largest = max((s for s in shapes), key=lambda s: (s[2], s[0]))
    rows, chosen = [], {}
    for name, profile in profiles.items():
        try:
            chosen[name] = choose_shapes(costs, profile, batches, max_shapes=args.max_shapes)
        except ValueError as exc:
            kept = f"; --resume {args.json} reuses what was measured" if args.json else ""
            print(f"--max-shapes: {exc}{kept}", file=sys.stderr)
            return 2
        for b in batches:
            c = chosen[name][b]
            plain_tps = plain[(b, name)][1]
            loop = plain[(b, name)] if c.shape is None else run(c.shape)[(b, name)]
            row = dict(batch=b, profile=name, shape=shape_key(c.shape) if c.shape else "off",
                       expected_accept_length=round(c.expected_accept_length, 4),
                       accept_length=round(loop[2], 4), loop_tokens_per_s=round(loop[1], 2),
                       plain_tokens_per_s=round(plain_tps, 2),
                       loop_over_plain=round(loop[1] / plain_tps, 4))
            if (args.page_size, largest) in times:
                row.update(largest_shape=shape_key(largest),
                           largest_tokens_per_s=round(times[(args.page_size, largest)][(b, name)][1], 2),
                           largest_expected_accept_length=round(
                               expected_accept_length(largest, profile), 4))
            rows.append(row)
            print(f"{name} batch {b:>3}: {row['shape']:>7}  loop {loop[1]:9.1f} tok/s  plain "
                  f"{plain_tps:9.1f}  ({row['loop_over_plain']:.2f}x)", flush=True)
    doc["rows"] = rows
    doc["fixed"] = []
    for config in fixed:
        got = run(config[1:], page_size=config[0])
        doc["fixed"] += floor_rows(models, config, batches,
                                   {b: got[(b, first)][0] for b in batches}, args, roofs)
    doc["plain"] = []
    for b in batches:
        row = dict(batch=b, ms_per_step=round(plain[(b, first)][0], 4))
        if roofs:
            floor = floors.forward_bytes(models, b, args.context)["target"] / (roofs[0] * 1e12) * 1e3
            row.update(bytes_floor_ms=round(floor, 4), roofline_frac=round(floor / row["ms_per_step"], 4))
        doc["plain"].append(row)
    if roofs and batches[0] == 1:
        doc["plain_roofline_frac"] = doc["plain"][0]["roofline_frac"]
    if args.json:
        runs.write_json(args.json, doc)
    if args.cold_start:
        doc.update(cold_start(chosen[first], args))
        print(f"cold compile + capture {doc['cold_compile_capture_s']} s, restart "
              f"{doc['restart_s']} s", flush=True)
        if args.json:
            runs.write_json(args.json, doc)
    return 0
