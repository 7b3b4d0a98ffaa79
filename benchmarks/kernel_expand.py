"""What a tree's expand call costs a layer: FA3 against the expand kernel.

The expand call of a tree cascade has ``B * N`` rows of one query, each over
the at most ``N`` draft tokens it attends, in page size 1
(`fa3_spec.attention.expand_attention`). This times ``--layers`` such calls
captured as one CUDA graph, at ``llama3-8b``'s head shapes (32 query heads,
8 KV heads, head dim 128), per batch and ``N`` (16: the P 2 / topk 8 tree's
verify; 8: a draft step of topk 8 at its last depth), on FA3 (one split, as
the loop's calls get) and on the Triton kernel, with the largest difference
between the two outputs. Needs CUDA and an FA3 provider (exit 2 without).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import fa3_spec
from fa3_spec.attention import expand_attention_triton, fa3_paged_attention

import runs
import timing

PROG = "kernel_bench.py expand"
HELP = "a tree's expand call per layer: FA3 against the expand kernel"

HQ, HKV, D = 32, 8, 128


def call_row(batch: int, n: int, layers: int) -> dict:
    """µs per expand call on each kernel, ``layers`` calls in one graph."""
    g = torch.Generator(device="cuda").manual_seed(batch * 1000 + n)
    rows, slots = batch * n, max(4096, batch * n * 2)
    q = torch.randn(rows, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(slots, 1, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    # Query j of a request attends its ancestors: the first j + 1 of the
    # request's n slots at most (here j + 1, capped at n: a chain's worst case).
    base = torch.randperm(slots - 1, device="cuda", generator=g)[:rows].int() + 1
    pt = base.view(batch, 1, n).expand(batch, n, n).reshape(rows, n).contiguous()
    sl = (torch.arange(rows, device="cuda", dtype=torch.int32) % n) + 1
    cu = torch.arange(rows + 1, device="cuda", dtype=torch.int32)
    scale = D ** -0.5

    def fa3():
        return [fa3_paged_attention(q, k, v, pt, sl, cu, 1, scale, False, 1) for _ in range(layers)]

    def triton():
        return [expand_attention_triton(q, k, v, pt, sl, cu, n, scale) for _ in range(layers)]

    fa3_us = timing.replay_ms(fa3, reps=30) * 1e3 / layers
    triton_us = timing.replay_ms(triton, reps=30) * 1e3 / layers
    want, got = fa3()[0], triton()[0]
    return dict(B=batch, N=n, rows=rows, fa3_us_per_call=round(fa3_us, 2),
                triton_us_per_call=round(triton_us, 2), fa3_over_triton=round(fa3_us / triton_us, 2),
                max_abs_out_diff=float((want[0].float() - got[0].float()).abs().max()),
                max_abs_lse_diff=float((want[1] - got[1]).abs().max()))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=[16, 8], metavar="N")
    ap.add_argument("--layers", type=int, default=32, help="calls per graph")
    ap.add_argument("--json", metavar="PATH")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if min(args.batches + args.draft_tokens + [args.layers]) < 1:
        print("--batches, --draft-tokens and --layers must be >= 1", file=sys.stderr)
        return 2
    if max(args.draft_tokens) > fa3_spec.attention.MAX_EXPAND_KEYS:
        print(f"--draft-tokens must be at most {fa3_spec.attention.MAX_EXPAND_KEYS}",
              file=sys.stderr)
        return 2
    if not fa3_spec.attention.fa3_available():
        print(f"{PROG} needs CUDA and an FA3 provider", file=sys.stderr)
        return 2
    doc = dict(command=runs.command_line(PROG, argv), commit=runs.commit(),
               torch=torch.__version__, device=runs.device_name("cuda"),
               provider=fa3_spec.attention.provider_version(), layers=args.layers, rows=[])
    for n in args.draft_tokens:
        for b in args.batches:
            row = call_row(b, n, args.layers)
            print(json.dumps(row), flush=True)
            doc["rows"].append(row)
            if args.json:
                runs.write_json(args.json, doc)
    return 0
