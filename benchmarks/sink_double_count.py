"""How much upstream's double-counted attention sink moves the output (H200, real FA3).

Upstream sglang 0.5.23 gives the prefix and the expand call of a topk > 1
cascade the same ``sinks`` and merges their (out, LSE) pairs. This FA3
build's LSE includes the sink, so the merged softmax denominator holds it
twice: with ``Z`` the real keys' mass and ``pi = e^s / (Z + e^s)`` the sink's
true share, the merged output is ``o * (Z + e^s) / (Z + 2 e^s) = o / (1 + pi)``.

For gpt-oss-like heads (64 query / 8 KV heads, head dim 64, bf16) this runs
both ways on FA3 — upstream's (sinks to both calls, merged) and fa3_spec's
(sink once, after the merge) — for draft decode topk > 1 and tree verify,
over sink logits and score sharpness, and reports the relative output error
of the double count, the sink's share ``pi``, and how well ``o / (1 + pi)``
predicts FA3's double-counted output. Random q/k/v: the *share* ``pi`` is
what carries over to a real model (for a real head it is whatever the model
learned), so rows are reported against it.

    python3 benchmarks/sink_double_count.py --json sink_double_count.json
"""

from __future__ import annotations

import argparse
import json

import torch

import fa3_spec
from fa3_spec.attention import merge_attention_states, provider_version, providers
from fa3_spec.harness.worlds import fill_kv_cache, make_world
from fa3_spec.harness.oracle import num_queries

import timing

HEADS, KV_HEADS, DIM = 64, 8, 64  # gpt-oss-20b/120b attention shape


def upstream_double_count(q, kc, vc, md, sinks_bf16, scale):
    """Each FA3 call gets the sinks; merged by LSE (what upstream's cascade does)."""
    parts = []
    for call in md.calls:
        k = kc.view(-1, call.page_size, KV_HEADS, DIM)
        v = vc.view(-1, call.page_size, KV_HEADS, DIM)
        out, lse, *_ = providers.kvcache_forward()(
            q, k, v, cache_seqlens=call.cache_seqlens, page_table=call.page_table,
            cu_seqlens_q=call.cu_seqlens_q, max_seqlen_q=call.max_seqlen_q, softmax_scale=scale,
            causal=call.causal, num_splits=1, sinks=sinks_bf16, return_softmax_lse=True)
        parts += [out, lse]
    return merge_attention_states(*parts)[0]


def run(args) -> list:
    rows = []
    cases = [("draft_decode", 2, 8, True), ("target_verify", 16, 8, True)]
    for mode, p, k, tree in cases:
        for ctx in args.contexts:
            cfg = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=5, num_draft_tokens=8,
                                      max_bs=args.batch, max_context_len=ctx)
            world = make_world(cfg, args.batch, seq_lens=[ctx - 3 * i for i in range(args.batch)],
                               seed=ctx + p, device="cuda")
            kc, vc = fill_kv_cache(world, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=torch.bfloat16)
            md = fa3_spec.build_metadata(mode, cfg, step=3, **world.mode_kwargs(mode, tree=tree))
            g = torch.Generator(device="cuda").manual_seed(ctx)
            q0 = torch.randn(num_queries(world, mode), HEADS, DIM, device="cuda", generator=g)
            for sharp in args.sharpness:
                q = (q0 * sharp).to(torch.bfloat16)  # scores ~ N(0, sharp^2)
                for s in args.sinks:
                    sinks = torch.full((HEADS,), s, device="cuda").to(torch.bfloat16)
                    scale = DIM ** -0.5
                    exact, lse = fa3_spec.cascade_attention(
                        q, kc, vc, md, backend="fa3", sinks=sinks.float(), return_lse=True)
                    ref = fa3_spec.cascade_attention(q, kc, vc, md, backend="torch", sinks=sinks.float())
                    double = upstream_double_count(q, kc, vc, md, sinks, scale)
                    pi = torch.exp(sinks.float()[:, None] - lse).transpose(0, 1)  # [T, H]
                    predicted = exact.float() / (1 + pi).unsqueeze(-1)
                    norm = exact.float().norm()
                    row = dict(
                        mode=mode, page_size=p, topk=k, context=ctx, batch=args.batch,
                        score_std=sharp, sink=s,
                        sink_share_median=float(pi.median()), sink_share_max=float(pi.max()),
                        double_vs_exact_rel_err=float((double.float() - exact.float()).norm() / norm),
                        double_vs_exact_max_abs=float((double.float() - exact.float()).abs().max()),
                        predicted_vs_double_rel_err=float((double.float() - predicted).norm() / norm),
                        exact_fa3_vs_torch_rel_err=float((exact.float() - ref.float()).norm() / norm),
                    )
                    rows.append(row)
                    print(json.dumps(row))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--sinks", type=float, nargs="+", default=[-4.0, 0.0, 2.0, 4.0, 6.0, 8.0])
    ap.add_argument("--sharpness", type=float, nargs="+", default=[1.0, 3.0])
    args = ap.parse_args()
    rows = run(args)
    if args.json:
        timing.write_json(args.json, dict(fa3=provider_version(), torch=torch.__version__,
                                          device=torch.cuda.get_device_name(),
                                          heads=[HEADS, KV_HEADS, DIM], rows=rows))


if __name__ == "__main__":
    main()
