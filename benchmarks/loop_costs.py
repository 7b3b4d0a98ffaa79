"""A cost profile: the ms of one iteration of each candidate tree shape, and of
one plain decode step, at each batch bucket, on this machine and model.

The speculation policy (`fa3_spec.eagle.policy.choose_shapes`) weighs these
costs against an acceptance profile to give each bucket its shape; the costs
are measured once per machine and model, written with `CostProfile.save`
(``--out``), and read by ``fa3-spec eagle --cost-profile``. Each shape is one
engine over every bucket of ``--batches`` (one compile and capture per shape,
as the engine itself runs it), ``max(batches)`` requests of ``--context``
prompt tokens admitted; each bucket is then timed from that same state (the
loop state restored), every one of its rows live: its launches back to back
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
import dataclasses
import statistics
import sys
import time

import torch

from fa3_spec.cli.usage import UsageError, check_writable
from fa3_spec.eagle import make_models
from fa3_spec.eagle.acceptance import profile_acceptance
from fa3_spec.eagle.kernels import select_kernels
from fa3_spec.eagle.policy import (AcceptanceProfile, CostProfile, parse_shape_key,
                                   shape_key)

import runs
import timing
import workload

PROG = "loop.py costs"
HELP = "ms per iteration of candidate tree shapes and of plain decoding per bucket (a cost profile)"

#: Chains and trees of a few widths and depths.
CANDIDATES = ["1,2,3", "1,4,5", "1,6,7", "2,3,6", "4,3,8", "4,5,8", "8,5,16", "8,6,24"]


def parse_shapes(texts, flag: str = "--shapes") -> list:
    """Each ``"topk,steps,N"`` of ``texts`` as a shape (`parse_shape_key`),
    checked before anything is measured; `ValueError` naming ``flag``."""
    try:
        return [parse_shape_key(t) for t in texts]
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None


class ShapeEngine:
    """One engine running ``shape`` (None: plain decoding) at every bucket of
    ``batches``, compiled and captured, with ``max(batches)`` live requests of
    ``args.context`` prompt tokens; `measure` times one bucket from the state
    just after their admission, so every bucket starts from the same context.
    ``capture_s``: the engine's compile + capture seconds."""

    def __init__(self, models, shape, batches, args, hook, page_size=None):
        torch._dynamo.reset()  # one engine at a time; its compiled frames are its own
        k, s, n = shape or (1, 2, 2)
        top = max(batches)
        self.max_new = (args.warmup + args.iters) * (n + 1) + 8
        lc = workload.loop_config((page_size or args.page_size, k, s, n), batch=top,
                                  context=args.context, max_new=self.max_new,
                                  draft_attention=args.draft_attention,
                                  attention_backend=args.attention_backend)
        self.spec = lc.spec
        self.eng = workload.engine(lc, models, device=args.device, buckets=sorted(batches),
                                   max_reqs=top, shapes={b: shape for b in batches},
                                   **({} if hook is None else dict(acceptance=hook)),
                                   scripted=hook is None)
        t0 = time.perf_counter()
        self.eng.capture()
        self.capture_s = time.perf_counter() - t0
        for prompt in workload.random_prompts(top, args.context, models.vocab_size, seed=top):
            self.eng.submit(prompt, self.max_new)
        self.eng.admit()
        self._admitted = {key: v.clone() for key, v in self.eng.state.items()}
        self.args = args

    def measure(self, batch: int) -> tuple:
        """``(seconds of each timed launch, tokens its rows emitted over them)``
        of bucket ``batch``, after ``args.warmup`` launches, from the admitted state."""
        eng, args = self.eng, self.args
        for key, v in eng.state.items():
            v.copy_(self._admitted[key])
        for _ in range(args.warmup):
            eng.launch(batch)
        before = eng.state["out_len"][:batch].sum()
        seconds = launch_seconds(eng, batch, args.iters, warmup=0)
        return seconds, int(eng.state["out_len"][:batch].sum() - before)

    def close(self) -> None:
        del self.eng, self._admitted
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def launch_seconds(eng, batch: int, iters: int, warmup: int) -> list:
    """Seconds of each of ``iters`` launches of the bucket, after ``warmup``
    (CUDA events on the GPU, wall time on the CPU)."""
    launch = lambda: eng.launch(batch)  # noqa: E731
    if eng.device.type == "cuda":
        return timing.event_samples(launch, iters, warmup=warmup)[1]
    return timing.samples(launch, iters, timing.no_sync, warmup=warmup)[1]


def random_models(args):
    """The target and random draft ``args`` name, the draft's logits scaled to
    ``args.draft_logit_std``: a random draft's near-uniform logits draft the
    broadest tree (every depth-2 score is below every depth-1 score), where a
    trained head's peaked ones draft deep paths; the acceptance hook decides
    what is accepted either way, the draft decides which nodes are offered."""
    models = make_models(args.preset, draft="random", device=args.device,
                         num_layers=args.num_layers)
    if args.draft_logit_std is not None:
        if not args.draft_logit_std > 0:
            raise ValueError(f"--draft-logit-std must be > 0, got {args.draft_logit_std}")
        # After the draft's RMSNorm the logits' std is logit_scale * norm weight.
        models.draft.norm.mul_(args.draft_logit_std / models.target.shape.logit_scale)
    return models


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
    ap.add_argument("--draft-logit-std", type=float, default=None, metavar="S",
                    help="scale the random draft's logits to standard deviation S; 10 makes "
                         "its sibling probabilities fall off about as the built-in high "
                         "profile's rates do (0.68, 0.14, 0.06, ...), so the tree it drafts "
                         "is the one the policy's model assumes (default: as made, std 1)")
    ap.add_argument("--kernels", nargs="+", default=[], metavar="NAME=VALUE",
                    help="the ops' CUDA kernels for the run, e.g. expand_attention=fa3 (the "
                         "other arm of a kernel A/B; fa3_spec.eagle.kernels.Kernels); default: "
                         "the library's")
    ap.add_argument("--json", metavar="PATH", help="the rows, with the command")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, tiny preset, batches 1 and 2, two shapes, a short context")


def select_run_kernels(args: argparse.Namespace) -> dict:
    """Register ``args.kernels`` (`workload.kernels`) for this process; returns
    them as a dict for the JSON. ValueError on an unknown name or value."""
    chosen = workload.kernels(args.kernels)
    select_kernels(chosen)
    return dataclasses.asdict(chosen)


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
        shapes = parse_shapes(args.shapes)
        for path, flag in ((args.out, "--out"), (args.json, "--json")):
            if path:  # before a run of minutes, so that its result is not lost at the end
                try:
                    check_writable(flag, path)
                except UsageError as exc:
                    raise ValueError(f"{flag}: cannot write {path!r} ({exc})") from None
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if min(args.batches) < 1 or args.iters < 1 or args.context < 1:
        print("--batches, --iters and --context must be >= 1", file=sys.stderr)
        return 2
    try:
        kernels = select_run_kernels(args)
    except ValueError as exc:
        print(f"--kernels: {exc}", file=sys.stderr)
        return 2
    hook = None
    if args.acceptance_profile:
        try:
            hook = profile_acceptance(AcceptanceProfile.load(args.acceptance_profile).rates)
        except ValueError as exc:
            print(f"--acceptance-profile: {exc}", file=sys.stderr)
            return 2
    try:
        models = random_models(args)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    device = runs.device_name(args.device)
    doc = dict(command=runs.command_line(PROG, argv), torch=torch.__version__, device=device,
               preset=args.preset, context=args.context, page_size=args.page_size,
               draft_attention=args.draft_attention,
               acceptance=args.acceptance_profile or workload.SCRIPTED, kernels=kernels,
               rows=[])
    plain, costs = {}, {b: {} for b in sorted(set(args.batches))}
    for shape in [None] + shapes:
        key = "plain" if shape is None else shape_key(shape)
        engine = ShapeEngine(models, shape, sorted(set(args.batches)), args, hook)
        for batch in sorted(set(args.batches)):
            ms = 1e3 * statistics.median(engine.measure(batch)[0])
            if shape is None:
                plain[batch] = ms
            else:
                costs[batch][key] = ms
            doc["rows"].append(dict(batch=batch, shape=key, ms_per_iteration=round(ms, 4)))
            print(f"batch {batch:>3} {key:>7}: {ms:8.3f} ms", flush=True)
        doc["capture_s"] = dict(doc.get("capture_s", {}), **{key: round(engine.capture_s, 1)})
        engine.close()
        if args.json:
            runs.write_json(args.json, doc)
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
