"""The K/V write of every layer: `fa3_spec.attention.store_kv`'s implementations
timed against each other.

A forward writes each layer's new K and V rows once. This captures the 32
writes of one forward (``llama3-8b``'s 8 KV heads of 128, page size 16, a
pool of 32 layers; ``v`` a view of a fused QKV output, as the layer makes
it, ``k`` contiguous) as one CUDA graph per implementation and per token
count ``T``, and reports µs and kernels per write:

* ``index_copy``: two ``index_copy_`` (one per cache);
* ``fused``: `fa3_spec.attention.store_kv_fused`, one Triton launch for both;
* ``op``: the ``fa3_spec::store_kv`` op as the layers call it.

All write the same bytes (checked before timing). Needs CUDA and Triton
(exit 2 without them).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from fa3_spec.attention import fused_store_available, store_kv_fused, store_kv_index_copy

import runs
import timing

PROG = "kernel_bench.py kv-store"
HELP = "the per-layer K/V write: two index_copy_ against one Triton kernel"

LAYERS, HQ, HKV, D, PAGE = 32, 32, 8, 128, 16


def _case(t: int, num_pages: int):
    g = torch.Generator(device="cuda").manual_seed(t)
    shape = (LAYERS, num_pages, PAGE, HKV, D)
    kc = torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(t, HQ + 2 * HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = qkv[:, HQ:HQ + HKV].contiguous()
    v = qkv[:, HQ + HKV:]
    per = num_pages * PAGE
    slots = torch.randperm(per - PAGE, device="cuda", generator=g)[:t] + PAGE
    layer_slots = [slots + layer * per for layer in range(LAYERS)]
    return kc, vc, k, v, layer_slots


def row(t: int, num_pages: int) -> dict:
    """µs and kernels per write of each implementation at ``t`` tokens (bytes checked first)."""
    kc, vc, k, v, layer_slots = _case(t, num_pages)
    impls = {"index_copy": store_kv_index_copy, "fused": store_kv_fused,
             "op": torch.ops.fa3_spec.store_kv}
    written = {}
    for name, fn in impls.items():
        kc.zero_()
        vc.zero_()
        for s in layer_slots:
            fn(kc, vc, s, k, v)
        written[name] = (kc.clone(), vc.clone())
    same = all(torch.equal(written["index_copy"][i], written[n][i]) for n in ("fused", "op")
               for i in (0, 1))
    out = dict(T=t, num_pages=num_pages, same_bytes=same)
    for name, fn in impls.items():
        def forward(fn=fn):
            for s in layer_slots:
                fn(kc, vc, s, k, v)
        out[f"{name}_us_per_write"] = round(timing.replay_ms(forward, reps=200) * 1e3 / LAYERS, 3)
        out[f"{name}_kernels_per_write"] = timing.kernels_per_call(forward) / LAYERS
    out["index_copy_over_fused"] = round(out["index_copy_us_per_write"] / out["fused_us_per_write"], 3)
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024])
    ap.add_argument("--num-pages", type=int, default=4096)
    ap.add_argument("--json", metavar="PATH")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    for name, values in (("--tokens", args.tokens), ("--num-pages", [args.num_pages])):
        if any(x < 1 for x in values):
            print(f"{PROG}: {name} must be >= 1, got {values}", file=sys.stderr)
            return 2
    if args.num_pages * PAGE <= max(args.tokens) + PAGE:
        print(f"{PROG}: --num-pages {args.num_pages} holds fewer slots than "
              f"{max(args.tokens)} tokens need", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() or not fused_store_available():
        print(f"{PROG} needs CUDA and Triton", file=sys.stderr)
        return 2
    import triton

    res = dict(command=runs.command_line(PROG, argv), torch=torch.__version__,
               triton=triton.__version__, device=runs.device_name("cuda"), layers=LAYERS,
               kv_heads=HKV, head_dim=D, page_size=PAGE, rows=[])
    for t in args.tokens:
        res["rows"].append(row(t, args.num_pages))
        print(json.dumps(res["rows"][-1]), flush=True)
        if args.json:
            runs.write_json(args.json, res)
    return 0
