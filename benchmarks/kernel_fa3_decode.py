"""What one FA3 decode call costs a layer at small batch, and whether one
scheduler plan can serve every layer of a forward.

A decode step makes one FA3 call per layer over the same metadata, each
FA3's varlen path: a ``prepare_varlen_num_blocks`` kernel, the attention
kernel and, with splits, a combine kernel. This times 32 such calls captured
as one CUDA graph, per split count, at ``llama3-8b``'s head shapes (32 query
heads, 8 KV heads, head dim 128), 1024 keys, page size 16; then the same
calls sharing one ``scheduler_metadata`` made at the start of the graph
(``get_scheduler_metadata`` with the calls' own arguments), with whether
FA3 accepts it and gives the same output; and the plan's size per batch,
split count and causality. Needs CUDA and FA3's ``flash_attn_interface``
(exit 2 without them).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

import fa3_spec

import runs
import timing

PROG = "kernel_bench.py fa3-decode"
HELP = "FA3 decode calls per layer: split counts, and one scheduler plan shared by all"

HQ, HKV, D = 32, 8, 128


def plan_sizes(fai, context: int, page_size: int) -> list:
    """Entries of the plan ``get_scheduler_metadata`` returns, per batch, queries
    per row, split count and causality (each row a dict; ``error`` if refused)."""
    rows = []
    for b, nq, s, causal in itertools.product((1, 2, 8, 64), (1, 16), (0, 1, 8), (False, True)):
        seqlens = torch.full((b,), context, dtype=torch.int32, device="cuda")
        cu = torch.arange(0, (b + 1) * nq, nq, dtype=torch.int32, device="cuda")
        row = dict(B=b, max_seqlen_q=nq, num_splits=s, causal=causal)
        try:
            m = fai.get_scheduler_metadata(b, nq, context + 64, HQ, HKV, D, seqlens,
                                           torch.bfloat16, cu_seqlens_q=cu, page_size=page_size,
                                           causal=causal, num_splits=s)
            row.update(size=m.numel(), dtype=str(m.dtype))
        except Exception as e:  # what FA3 says is the finding
            row.update(error=repr(e)[:200])
        rows.append(row)
    return rows


def call_rows(fai, batch: int, context: int, page_size: int, layers: int, splits: list) -> list:
    """Per split count: µs per decode call, ``layers`` calls in one graph, each
    planning for itself (``us_per_call``) or all sharing one plan made at the
    start of the graph (``us_per_call_shared_plan``, with whether its output
    equals the unshared call's, or ``shared_plan_error``)."""
    spec = fa3_spec.SpecConfig(page_size=page_size, topk=1, num_steps=2, num_draft_tokens=1,
                               max_bs=batch, max_context_len=context + 64)
    per_row = -(-spec.min_row_len // page_size)
    k = torch.randn(batch * per_row + 2, page_size, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    width = per_row * page_size
    r2t = torch.arange(batch * width, dtype=torch.int32, device="cuda").view(batch, width) + page_size
    md = fa3_spec.build_decode_metadata(
        spec, req_to_token=r2t, req_pool_indices=torch.arange(batch, device="cuda"),
        seq_lens=torch.full((batch,), context, dtype=torch.int64, device="cuda"))
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    base = dict(cache_seqlens=md.cache_seqlens, page_table=md.page_table,
                cu_seqlens_q=md.cu_seqlens_q, max_seqlen_q=md.max_seqlen_q, causal=md.causal,
                return_softmax_lse=True)
    rows = []
    for s in splits:
        plain = timing.replay_ms(lambda: [fai.flash_attn_with_kvcache(q, k, v, num_splits=s, **base)
                                   for _ in range(layers)], reps=30)

        def shared():
            # The plan's arguments are the call's: causal too (a causal call's
            # plan has one more per-batch vector than a non-causal one's).
            plan = fai.get_scheduler_metadata(batch, 1, md.max_seqlen_k, HQ, HKV, D,
                                              md.cache_seqlens, torch.bfloat16,
                                              cu_seqlens_q=md.cu_seqlens_q,
                                              page_size=page_size, causal=md.causal,
                                              num_splits=s)
            return [fai.flash_attn_with_kvcache(q, k, v, num_splits=s, scheduler_metadata=plan,
                                                **base) for _ in range(layers)]

        row = dict(B=batch, num_splits=s, us_per_call=round(plain * 1e3 / layers, 2))
        try:
            row["us_per_call_shared_plan"] = round(timing.replay_ms(shared, reps=30) * 1e3 / layers, 2)
            ref = fai.flash_attn_with_kvcache(q, k, v, num_splits=s, **base)[0]
            row["shared_plan_same_out"] = bool(torch.equal(ref, shared()[-1][0]))
        except Exception as e:  # what FA3 says is the finding
            row["shared_plan_error"] = repr(e)[:200]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32, help="calls per graph")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--json", metavar="PATH")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if min(args.batches + args.splits + [args.context, args.page_size, args.layers]) < 1:
        print("--context, --page-size, --layers, --batches and --splits must be >= 1",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"{PROG} needs CUDA", file=sys.stderr)
        return 2
    try:
        import flash_attn_interface as fai
    except ImportError:
        print(f"{PROG} needs FA3's flash_attn_interface", file=sys.stderr)
        return 2
    doc = dict(command=runs.command_line(PROG, argv), torch=torch.__version__,
               device=runs.device_name("cuda"), provider=fa3_spec.attention.provider_version(),
               context=args.context, page_size=args.page_size, layers=args.layers,
               scheduler_metadata_sizes=plan_sizes(fai, args.context, args.page_size), rows=[])
    for b in args.batches:
        doc["rows"] += call_rows(fai, b, args.context, args.page_size, args.layers, args.splits)
        if args.json:
            runs.write_json(args.json, doc)
    return 0
