"""Draft heads on a real checkpoint: the mean accept length of each head per
tree shape, draft semantics and temperature on held-out chat prompts; greedy
exactness of every temperature-0 row; and the loop's tokens/s against plain
decoding of the same model.

Acceptance does not depend on compilation, so the acceptance rows run batched
and uncompiled. The prompts are `fa3_spec.train.heldout_prompts` (templates
and topics outside the training mix), in the checkpoint's chat template. Each
temperature-0 row is compared with one greedy reference of the target
(`fa3_spec.eagle.greedy_check`: identical, or diverging first at a near tie;
``--strict``: identical). Temperature > 0 rows sample losslessly, seeded.

``--timed TOPK,STEPS,N`` adds, per head, one compiled and captured shape on
``--batch`` of the prompts (no EOS, so no row stops): (a) the engine's
iteration replayed ``--iters`` times, tokens from the rows' output lengths,
and (c) one plain decode step of the same target over the same rows,
captured the same way (`loop_variants.greedy_segment`), as in
``loop.py compare``.

    python3 benchmarks/draft_heads.py accept --model SMOL --head HEAD --head derived \\
        --device cuda --timed 4,5,8 --json draft_heads.json
    python3 benchmarks/draft_heads.py accept --model SMOL --head HEAD --device cpu \\
        --dtype float64 --shapes 4,5,8 --prompts 8 --strict --json draft_heads_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from fa3_spec import SpecConfig
from fa3_spec.config import DRAFT_ATTENTION
from fa3_spec.eagle import EagleEngine, LoopConfig, greedy_generate
from fa3_spec.eagle.checkpoint import from_pretrained
from fa3_spec.eagle.greedy_check import compare_with_greedy
from fa3_spec.eagle.text import CheckpointTokenizer, checkpoint_eos_ids
from fa3_spec.train.prompts import heldout_prompts

import runs
import workload
from loop_compare import measure
from loop_variants import greedy_segment

PROG = "draft_heads.py accept"
HELP = "mean accept length of draft heads on a real checkpoint's held-out prompts"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
#: The chain and the trees of the measurement: (topk, num_steps, num_draft_tokens).
DEFAULT_SHAPES = ("1,5,6", "4,5,8", "4,5,16", "8,5,8", "8,5,16")


def _shape(text: str) -> tuple:
    try:
        k, s, n = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is TOPK,STEPS,N, got {text!r}") from None
    if min(k, s, n) < 1:
        raise argparse.ArgumentTypeError(f"a shape's values are >= 1, got {text!r}")
    return k, s, n


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="Hugging Face Llama checkpoint directory")
    ap.add_argument("--head", action="append", required=True, metavar="DIR|derived",
                    help="an EAGLE head directory, or 'derived' (target layer 0); repeatable")
    ap.add_argument("--shapes", type=_shape, nargs="+", default=[_shape(s) for s in DEFAULT_SHAPES],
                    metavar="TOPK,STEPS,N")
    ap.add_argument("--draft-attention", nargs="+", choices=list(DRAFT_ATTENTION),
                    default=["ancestors", "branch"])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--prompts", type=int, default=40, help="held-out prompts (at most 40)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "fa3", "torch"])
    ap.add_argument("--strict", action="store_true", help="greedy rows must be identical")
    ap.add_argument("--timed", type=_shape, default=None, metavar="TOPK,STEPS,N")
    ap.add_argument("--iters", type=int, default=20, help="timed iterations")
    ap.add_argument("--compile-backend", default="auto", choices=["auto", "none"],
                    help="the timed shape's compile (none: eager kernels, captured)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH")
    return ap


def _engine(models, shape, draft_attention, *, batch, page_size, context, max_new,
            attention_backend, sampling, graphs, device, compile_backend="none"):
    k, s, n = shape
    spec = SpecConfig(page_size=page_size, topk=k, num_steps=s, num_draft_tokens=n,
                      max_bs=batch, max_context_len=context + n)
    spec = dataclasses.replace(spec, num_pages=spec.pool_pages(batch, draft_attention))
    lc = LoopConfig(spec, max_new_tokens=max_new, attention_backend=attention_backend,
                    sampling=sampling, draft_attention=draft_attention)
    return EagleEngine(lc, models, max_reqs=batch, buckets=[batch], graphs=graphs,
                       compile_backend=compile_backend, device=device)


def acceptance_row(models, prompts, news, eos, shape, draft_attention, temperature, args, ref):
    eng = _engine(models, shape, draft_attention, batch=args.batch, page_size=args.page_size,
                  context=max(map(len, prompts)) + max(news), max_new=max(news),
                  attention_backend=args.attention_backend, sampling=temperature > 0,
                  graphs=False, device=args.device)
    for i, (p, m) in enumerate(zip(prompts, news)):
        eng.submit(p, m, eos_id=list(eos) or -1, temperature=temperature,
                   seed=args.seed + i if temperature > 0 else None)
    t0 = time.perf_counter()
    out = eng.run()
    seconds = time.perf_counter() - t0
    got = [out[i] for i in range(len(prompts))]
    stats = eng.stats.as_dict()
    k, s, n = shape
    row = dict(topk=k, num_steps=s, num_draft_tokens=n, draft_attention=draft_attention,
               temperature=temperature, requests=len(prompts), tokens=stats["tokens"],
               iterations=stats["iterations"], mean_accept_len=stats["mean_accept_len"],
               accept_hist=stats["accept_hist"],
               acceptance_by_depth_and_rank=stats["acceptance_rates"][1:],
               uncompiled_seconds=round(seconds, 2))
    if temperature == 0:
        tokens, logits = ref
        found = compare_with_greedy(got, tokens, logits)
        near = [d for d in found if d.near_tie]
        row.update(identical_requests=len(prompts) - len(found), near_tie_divergences=len(near),
                   unexplained_divergences=len(found) - len(near),
                   greedy_ok=not found if args.strict else len(near) == len(found))
    return row


def timed_row(models, prompts, shape, args) -> dict:
    """(a) the captured iteration and (c) a captured plain decode step, on the
    same ``batch`` rows, no EOS (module docstring)."""
    batch = min(args.batch, len(prompts))
    cuda = args.device.startswith("cuda")
    max_new = (2 + args.iters + 2) * shape[2] + 16
    context = max(map(len, prompts[:batch])) + max_new
    eng = _engine(models, shape, "ancestors", batch=batch, page_size=args.page_size,
                  context=context, max_new=max_new, attention_backend=args.attention_backend,
                  sampling=False, graphs=cuda, device=args.device,
                  compile_backend=args.compile_backend)
    for p in prompts[:batch]:
        eng.submit(p, max_new)
    eng.admit()
    st = eng.bucket_state(batch)
    snapshot = {key: v.clone() for key, v in st.items()}
    t0 = time.perf_counter()
    eng.capture()
    capture_s = time.perf_counter() - t0
    for key, v in st.items():
        v.copy_(snapshot[key])
    a = measure(lambda: eng.launch(batch), lambda: float(st["out_len"].sum()), args.iters, cuda)
    for key, v in st.items():
        v.copy_(snapshot[key])
    seg, seq = greedy_segment(eng, batch, cuda)
    c = measure(seg.run, lambda: float(seq.sum()), args.iters, cuda)
    k, s, n = shape
    return dict(topk=k, num_steps=s, num_draft_tokens=n, draft_attention="ancestors",
                batch=batch, **workload.compiled_as(eng), capture_s=round(capture_s, 2),
                a_ms_per_iteration=a["ms_per_iteration"], a_tokens_per_s=a["tokens_per_s"],
                a_tokens_per_iteration=round(a["tokens"] / args.iters / batch, 3),
                c_ms_per_token=c["ms_per_iteration"], c_tokens_per_s=c["tokens_per_s"],
                a_over_c=round(a["tokens_per_s"] / c["tokens_per_s"], 3))


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if not 1 <= args.prompts <= len(heldout_prompts()):
        raise SystemExit(f"--prompts must be in 1..{len(heldout_prompts())}")
    dtype = DTYPES[args.dtype] if args.dtype else (
        torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    tok = CheckpointTokenizer.load(args.model)
    if tok is None or not tok.transformers:
        raise SystemExit(f"{args.model}: the chat template needs transformers and the "
                         "checkpoint's tokenizer files")
    texts = heldout_prompts()[: args.prompts]
    prompts = [tok.encode(t, chat=True) for t in texts]
    news = [args.max_new_tokens] * len(prompts)
    eos = checkpoint_eos_ids(args.model)
    doc = dict(command=runs.command_line(PROG, argv), torch=torch.__version__,
               device=runs.device_name(args.device), model=args.model, dtype=str(dtype),
               prompts=len(prompts), max_new_tokens=args.max_new_tokens, batch=args.batch,
               page_size=args.page_size, eos=list(eos), heads=[], rows=[], timed=[])

    def save():
        if args.json:
            runs.write_json(args.json, doc)

    ref = None
    for head in args.head:
        models = (from_pretrained(args.model, draft="derived", dtype=dtype, device=args.device)
                  if head == "derived" else
                  from_pretrained(args.model, head, dtype=dtype, device=args.device))
        doc["heads"].append(head)
        if ref is None and 0.0 in args.temperatures:
            logits: list = []
            t0 = time.perf_counter()
            tokens = greedy_generate(models, prompts, news, eos_ids=[list(eos) or -1] * len(prompts),
                                     page_size=args.page_size,
                                     attention_backend=args.attention_backend,
                                     device=args.device, logits_out=logits)
            ref = (tokens, logits)
            doc["greedy_reference_seconds"] = round(time.perf_counter() - t0, 2)
            doc["greedy_reference_tokens"] = sum(map(len, tokens))
        for temperature in args.temperatures:
            for shape in args.shapes:
                for draft_attention in args.draft_attention:
                    row = dict(head=head, **acceptance_row(models, prompts, news, eos, shape,
                                                          draft_attention, temperature, args, ref))
                    doc["rows"].append(row)
                    print(f"{head} T={temperature} topk={shape[0]} steps={shape[1]} "
                          f"N={shape[2]} {draft_attention}: mean accept "
                          f"{row['mean_accept_len']:.3f}"
                          + (f", greedy {'ok' if row['greedy_ok'] else 'MISMATCH'}"
                             if temperature == 0 else ""), flush=True)
                    save()
        if args.timed:
            row = dict(head=head, **timed_row(models, prompts, args.timed, args))
            doc["timed"].append(row)
            print(f"{head} timed {args.timed}: loop {row['a_tokens_per_s']:.0f} tokens/s, "
                  f"plain {row['c_tokens_per_s']:.0f} tokens/s ({row['a_over_c']}x)", flush=True)
            save()
    save()
    bad = [r for r in doc["rows"] if r.get("greedy_ok") is False]
    return 1 if bad else 0
