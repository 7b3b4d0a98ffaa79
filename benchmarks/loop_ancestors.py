"""Tree drafts on a leaf's branch slots (sglang) against its true ancestors:
acceptance and cost.

``LoopConfig(draft_attention=...)``: "branch" is sglang's semantics (a leaf
attends its branch's slots, whichever leaf held them before); "ancestors"
attends its true path. Output is exact either way; what can change is what
the draft proposes, so acceptance.

Acceptance rows: mean accepted length (tokens emitted per iteration, the
models' own greedy acceptance, never scripted) in both modes, for page size
{1, 2, 16} x topk {4, 8} (5 steps, N = 8), on the derived draft at several
``alpha`` / ``noise`` settings (`fa3_spec.eagle.make_models`: smaller alpha,
more agreement; noise, less) and on the random draft, and whether both modes
emitted the same tokens (they must). The loop runs uncompiled (no graphs):
acceptance does not depend on speed. A derived draft is not a trained one:
the rows show the direction, not a real model's gain.

Cost rows (``--device cuda``): ms per iteration in both modes at batch 1, 8
and 32, P 2 / topk 8 / 5 steps / N 16, context 1024, scripted acceptance
(both modes do the same work), one inductor-compiled, CUDA-graph-captured
engine per (mode, batch). On CUDA the acceptance rows use an 8-layer
llama3-8b-shaped target (``--acceptance-layers``, 0 = the preset's depth) and
8 requests of up to 24 new tokens; the cost rows the full preset
(``--cost-layers``). ``--cost-batches`` (none: acceptance only) and
``--no-acceptance`` split the run. ``--smoke``: one acceptance pair and one
eager cost pair on CPU, tiny sizes (timings meaningless).
"""

from __future__ import annotations

import argparse
import time

import torch

import fa3_spec
from fa3_spec.eagle import make_models
from fa3_spec.eagle.cli import workload as cli_workload

import runs
import timing
import workload

PROG = "loop.py ancestors"
HELP = "draft attention on branch slots against true ancestors: acceptance and cost"

MODES = fa3_spec.DRAFT_ATTENTION
#: Draft heads of the acceptance rows: (kind, alpha, noise).
DRAFTS = [("derived", 0.05, 0.0), ("derived", 0.2, 0.0), ("derived", 0.5, 0.0),
          ("derived", 0.3, 0.3), ("derived", 1.0, 0.0), ("random", None, None)]
COST_CONFIG = (2, 8, 5, 16)


def _engine(models, p, k, s, n, *, batch, max_new, context, mode, scripted=False, graphs=False,
            compile_backend="none", device="cpu", attention_backend="auto"):
    lc = workload.loop_config((p, k, s, n), batch=batch, context=context, max_new=max_new,
                              pool_rows=2 * batch, draft_attention=mode, attention_backend=attention_backend)
    return workload.engine(lc, models, scripted=scripted, max_reqs=2 * batch, buckets=[batch],
                           graphs=graphs, compile_backend=compile_backend, device=device)


def acceptance_pair(models, p, k, args) -> dict:
    """Both modes over the same requests: mean accepted length and outputs."""
    prompts, news = cli_workload(args.requests, page_size=p, max_prompt=args.prompt_len,
                             max_new=args.max_new_tokens, vocab=models.vocab_size, seed=p + k)
    row = dict(page_size=p, topk=k, num_steps=5, num_draft_tokens=8)
    outputs = {}
    for mode in MODES:
        eng = _engine(models, p, k, 5, 8, batch=args.batch, max_new=args.max_new_tokens,
                      context=args.prompt_len, mode=mode, device=args.device, attention_backend=args.attention_backend)
        for prompt, m in zip(prompts, news):
            eng.submit(prompt, m)
        out = eng.run()
        outputs[mode] = [out[i] for i in range(len(prompts))]
        row[mode] = round(eng.stats.mean_accept_len, 4)
        row[f"{mode}_iterations"] = eng.stats.iterations
    row["ancestors_minus_branch"] = round(row["ancestors"] - row["branch"], 4)
    row["same_tokens"] = outputs["branch"] == outputs["ancestors"]
    return row


def cost_row(models, mode, batch, args) -> dict:
    """ms per iteration of one engine (buckets = [batch]), scripted acceptance."""
    p, k, s, n = COST_CONFIG
    cuda = args.device == "cuda"
    max_new = (args.warmup + args.iters) * workload.SCRIPTED_MAX + 8
    eng = _engine(models, p, k, s, n, batch=batch, max_new=max_new, context=args.context,
                  mode=mode, scripted=True, graphs=cuda,
                  compile_backend="auto" if cuda else "none", device=args.device,
                  attention_backend=args.attention_backend)
    start = time.perf_counter()
    eng.capture()
    capture_s = time.perf_counter() - start
    for prompt in workload.random_prompts(batch, args.context, models.vocab_size, seed=batch):
        eng.submit(prompt, max_new)
    eng.admit()
    _, wall = timing.samples(lambda: eng.launch(batch), args.iters,
                             timing.synchronizer(args.device), warmup=args.warmup)
    live = eng.bucket_state(batch)["seq_lens"] > 0  # read after timing (a sync)
    assert bool(live.all()), "a request finished: the timed iterations did less work"
    wall_us, iqr_us = timing.median_iqr_us(wall)
    return dict(draft_attention=mode, batch=batch, page_size=p, topk=k, num_steps=s,
                num_draft_tokens=n, context=args.context,
                acceptance=workload.SCRIPTED,
                compile=workload.compiled_as(eng)["compile"], graphs=eng.policy.graphs,
                capture_s=round(capture_s, 2),
                ms_per_iteration=round(wall_us / 1e3, 4), iqr_ms=round(iqr_us / 1e3, 4))


def _table(rows) -> str:
    lines = ["draft                 P  topk   branch  ancestors   delta  same tokens"]
    for r in rows:
        lines.append(f"{r['draft']:<20} {r['page_size']:>2} {r['topk']:>5} {r['branch']:>8.3f} "
                     f"{r['ancestors']:>10.3f} {r['ancestors_minus_branch']:>+7.3f}  "
                     f"{r['same_tokens']}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--preset", default=None, choices=["tiny", "llama3-8b"],
                    help="default tiny on CPU, llama3-8b on CUDA")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "fa3", "torch"])
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 2, 16])
    ap.add_argument("--topks", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--requests", type=int, default=None, help="per acceptance run")
    ap.add_argument("--batch", type=int, default=None, help="batch rows of an acceptance run")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--acceptance-layers", type=int, default=None,
                    help="target depth of the acceptance rows (0: the preset's; CUDA default 8)")
    ap.add_argument("--cost-layers", type=int, default=None, help="target depth of the cost rows")
    ap.add_argument("--cost-batches", type=int, nargs="*", default=None,
                    help="cost rows' batches (CUDA default 1 8 32; CPU default none)")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens of a cost row")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-acceptance", action="store_true",
                    help="only the cost rows (to split a long run over two calls)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny, every code path")
    ap.add_argument("--json", metavar="PATH")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    drafts = DRAFTS
    if args.smoke:
        args.device, args.preset, args.attention_backend = "cpu", "tiny", "torch"
        args.page_sizes, args.topks, drafts = [2], [4], DRAFTS[:1]
        args.requests, args.batch, args.max_new_tokens = 3, 2, 8
        args.context, args.iters, args.warmup = 16, 2, 1
        args.cost_batches = [2] if args.cost_batches is None else args.cost_batches
    args.preset = args.preset or ("llama3-8b" if cuda else "tiny")
    args.requests = args.requests or 8
    args.batch = args.batch or (8 if cuda else 4)
    args.max_new_tokens = args.max_new_tokens or (24 if cuda else 32)
    if args.acceptance_layers is None:
        args.acceptance_layers = 8 if cuda and args.preset == "llama3-8b" else 0
    if args.cost_batches is None:
        args.cost_batches = [1, 8, 32] if cuda else []
    if not cuda:
        torch.set_num_threads(1)  # the tiny models' small ops run fastest on one thread
    doc = dict(command=runs.command_line(PROG, argv), torch=torch.__version__,
               device=runs.device_name(args.device), preset=args.preset,
               acceptance_rows=[], cost_rows=[])

    def save():
        if args.json:  # rewritten after every row: a cut-off run keeps what it measured
            runs.write_json(args.json, doc)

    layers = args.acceptance_layers or None
    for kind, alpha, noise in [] if args.no_acceptance else drafts:
        extra = dict(alpha=alpha, noise=noise) if kind == "derived" else {}
        models = make_models(args.preset, draft=kind, device=args.device, num_layers=layers,
                             **extra)
        label = f"derived a={alpha} n={noise}" if kind == "derived" else "random"
        doc.update(dtype=str(models.dtype).replace("torch.", ""),
                   acceptance_layers=models.num_target_layers)
        for p in args.page_sizes:
            for k in args.topks:
                row = dict(draft=label, **acceptance_pair(models, p, k, args))
                doc["acceptance_rows"].append(row)
                print(_table([row]).splitlines()[-1], flush=True)
                save()
        del models
        if cuda:
            torch.cuda.empty_cache()
    if doc["acceptance_rows"]:
        print(_table(doc["acceptance_rows"]), flush=True)

    if args.cost_batches:
        models = make_models(args.preset, draft="random", device=args.device,
                             num_layers=args.cost_layers)
        doc["cost_layers"] = models.num_target_layers
        for batch in args.cost_batches:
            for mode in MODES:
                torch._dynamo.reset()  # one engine at a time; compiled frames are not shared
                row = cost_row(models, mode, batch, args)
                doc["cost_rows"].append(row)
                print(f"cost {mode:<9} batch {batch:>3}: {row['ms_per_iteration']:.3f} ms/iteration "
                      f"(IQR {row['iqr_ms']:.3f}, capture {row['capture_s']} s, {row['acceptance']})",
                      flush=True)
                save()
    save()
    return 0
