"""The per-bucket speculation policy against plain decoding, per acceptance
profile: at each batch bucket, the shape `choose_shapes` picks from a cost
profile (``loop.py costs``) and the profile, run by the engine, and plain
decoding of the same model, measured in the same run.

Acceptance on random weights comes from the profile itself: the engine's
acceptance hook accepts each draft node with its depth and sibling rank's
rate (`fa3_spec.eagle.acceptance.profile_acceptance`, seeded), so a bigger
tree accepts more in expectation, as with a trained head. Each (profile,
bucket) row times ``--iters`` launches after ``--warmup`` of an engine of that
bucket alone (every row live, ``--context`` prompt tokens): tokens/s of the
loop from the tokens its rows emitted during the timed launches, and of
plain decoding (one token per row per step) from the same engine built with
the bucket off. Where the policy turns a bucket off, the loop is that plain
step, measured once. Without ``--cost-profile`` the costs are measured
first, over ``--shapes``, with the first profile's acceptance.

    python3 benchmarks/loop.py policy --smoke --json /tmp/policy.json          # CPU, tiny
    python3 benchmarks/loop.py policy --cost-profile costs.json \\
        --acceptance-profile high=high.json measured=smollm2.json --json loop.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from fa3_spec.eagle import make_models
from fa3_spec.eagle.acceptance import profile_acceptance
from fa3_spec.eagle.policy import AcceptanceProfile, CostProfile, choose_shapes, shape_key

import loop_costs
import runs

PROG = "loop.py policy"
HELP = "the per-bucket shape the policy picks against plain decoding, per acceptance profile"

#: A profile whose P 2 / topk 8 / N 16 tree accepts about 3.5 tokens per
#: iteration (the rate of the first sibling 0.7 at every depth).
HIGH = AcceptanceProfile(tuple((0.7, 0.1, 0.04, 0.02, 0.01, 0.01, 0.005, 0.005)
                               for _ in range(6)))


def tokens_per_s(models, shape, batch: int, args, hook) -> float:
    """Tokens/s the engine emits over ``args.iters`` timed launches of ``shape``
    (None: plain decoding) at ``batch`` live rows."""
    eng = loop_costs.live_engine(models, shape, batch, args, hook)
    for _ in range(args.warmup):  # outside the count of emitted tokens
        eng.launch(batch)
    before = eng.state["out_len"][:batch].sum()
    seconds = loop_costs.launch_seconds(eng, batch, args.iters, warmup=0)
    emitted = int(eng.state["out_len"][:batch].sum() - before)
    return emitted / sum(seconds)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    loop_costs.add_loop_arguments(ap)
    ap.add_argument("--cost-profile", metavar="FILE.json", default=None,
                    help="the costs the policy weighs (default: measured here first, over "
                         "--shapes, as loop.py costs does)")
    ap.add_argument("--profiles", nargs="+", default=["high"], metavar="NAME[=FILE.json]",
                    help="acceptance profiles: 'high' (built in: about 3.5 tokens per "
                         "iteration on the P 2 / topk 8 / N 16 tree) or NAME=FILE.json")
    ap.add_argument("--seed", type=int, default=0, help="of the acceptance draws")
    return ap


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


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.smoke:
        loop_costs.smoke_settings(args)
    try:
        profiles = load_profiles(args.profiles)
        shapes = [loop_costs.parse_shape(s) for s in args.shapes]
        costs = CostProfile.load(args.cost_profile) if args.cost_profile else None
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    models = make_models(args.preset, draft="random", device=args.device,
                         num_layers=args.num_layers)
    device = runs.device_name(args.device)
    batches = sorted(set(args.batches))
    doc = dict(command=runs.command_line(PROG, argv), torch=torch.__version__, device=device,
               preset=args.preset, context=args.context, page_size=args.page_size,
               draft_attention=args.draft_attention, cost_profile=args.cost_profile,
               profiles={k: [list(r) for r in p.rates] for k, p in profiles.items()}, rows=[])
    if costs is None:  # measured here, with the first profile's acceptance
        first = profile_acceptance(next(iter(profiles.values())).rates, args.seed)
        plain = {b: loop_costs.iteration_ms(models, None, b, args, first) for b in batches}
        table = {b: {shape_key(s): loop_costs.iteration_ms(models, s, b, args, first)
                     for s in shapes} for b in batches}
        costs = CostProfile(plain=plain, shapes=table, device=device, model=args.preset)
        doc["measured_costs"] = dict(plain=plain, shapes=table)
    for name, profile in profiles.items():
        hook = profile_acceptance(profile.rates, args.seed)
        choices = choose_shapes(costs, profile, batches)
        for b in batches:
            c = choices[b]
            plain_tps = tokens_per_s(models, None, b, args, hook)
            loop_tps = (tokens_per_s(models, c.shape, b, args, hook) if c.shape is not None
                        else plain_tps)
            row = dict(batch=b, profile=name, shape=shape_key(c.shape) if c.shape else "off",
                       expected_accept_length=round(c.expected_accept_length, 4),
                       loop_tokens_per_s=round(loop_tps, 2),
                       plain_tokens_per_s=round(plain_tps, 2),
                       loop_over_plain=round(loop_tps / plain_tps, 4))
            doc["rows"].append(row)
            print(f"{name} batch {b:>3}: {row['shape']:>7}  loop {loop_tps:9.1f} tok/s  plain "
                  f"{plain_tps:9.1f}  ({row['loop_over_plain']:.2f}x)", flush=True)
            if args.json:
                runs.write_json(args.json, doc)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if args.json:
        runs.write_json(args.json, doc)
    return 0
