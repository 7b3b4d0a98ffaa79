"""Skinny GEMMs (M <= 16 rows) in Triton against cuBLAS, on the target's shapes.

A decode step at batch 1 spends most of its time in GEMMs whose ``M`` (rows)
is 1 to 16 and whose weights stream from DRAM once. This measures how far
from the read-bandwidth floor cuBLAS leaves those GEMMs, and what
`fa3_spec.eagle.gemm`'s Triton kernel does with each tile configuration (the
sweep its `tile_config` rule was fitted to). Every figure is a median of
CUDA-event timings of a CUDA graph replay:

* ``read_bandwidth_TBps``: a streaming reduction over a 4 GiB buffer;
* ``shapes``: each llama3-8b GEMM (fused QKV, O, fused gate/up, down,
  lm_head) at each ``M``, over enough weight copies (> 512 MiB) that every
  call streams from DRAM: cuBLAS as ``x @ w`` (``w [in, out]``, the model's
  layout) and as ``F.linear`` (``w [out, in]``), and the kernel at each tile
  configuration on ``[in, out]``; the best three and `tile_config`'s own
  kept (relative error against fp32 below 2e-2);
* ``model``: the 32 layers' GEMMs plus the lm_head in decode order, one graph,
  cuBLAS ``x @ w`` against `fa3_spec.eagle.gemm.matmul` on the same weights,
  and both as a share of the floor (their bytes over the measured bandwidth).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from fa3_spec.eagle.gemm import TileConfig, matmul, skinny_mm_triton, tile_config

import floors
import runs
import timing

PROG = "kernel_bench.py gemm"
HELP = "skinny GEMMs (M <= 16) in Triton against cuBLAS, and the model's GEMM sequence"

SHAPES = {  # llama3-8b, (K, N) = (in, out)
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
    "lm_head": (4096, 128256),
}
MM_TILES = [(32, 128), (32, 256), (64, 128), (64, 256), (128, 64)]  # (BLOCK_N, BLOCK_K), BLOCK_M 16


def configs(K: int):
    """``(label, TileConfig)`` of the sweep; split-K only where it divides ``K``."""
    for bn, bk in MM_TILES:
        for split in (1, 2, 4):
            if K % (split * bk) == 0:
                yield f"{bn}x{bk} s{split}", TileConfig(bn, bk, split)


def sweep_shape(name: str, K: int, N: int, ms_list, errors):
    """Per ``M``: cuBLAS both layouts and the best Triton configurations."""
    nbytes = K * N * 2
    copies = max(1, math.ceil((512 << 20) / nbytes))
    w_kn = [torch.randn(K, N, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    w_nk = [w.t().contiguous() for w in w_kn]
    rows_by_m = {}
    for M in ms_list:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ w_kn[0].float()
        rows = []

        def record(label, kind, gemm):
            try:
                ms = timing.replay_ms(lambda: [gemm(a, b) for a, b in zip(w_kn, w_nk)], reps=20) / copies
                got = gemm(w_kn[0], w_nk[0])
                torch.cuda.synchronize()
                err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
            except Exception as exc:  # a configuration Triton rejects is reported, not fatal
                errors.append(f"{name} M={M} {label}: {type(exc).__name__}: {str(exc)[:200]}")
                return
            rows.append(dict(label=label, kind=kind, us=ms * 1e3, TBps=nbytes / (ms * 1e-3) / 1e12, rel_err=err))

        record("cublas x @ w", "cublas_kn", lambda a, b: torch.mm(x, a, out=out))
        record("cublas F.linear", "cublas_nk", lambda a, b: torch.matmul(x, b.t(), out=out))
        for label, cfg in configs(K):
            record(label, "triton", lambda a, b, cfg=cfg: skinny_mm_triton(x, a, cfg))
        rows.sort(key=lambda r: r["us"])
        rows_by_m[M] = rows
    return copies, rows_by_m


def model_sequence(ms_list, bandwidth):
    """The 32 layers' GEMMs + lm_head in decode order on ``[in, out]`` weights:
    cuBLAS ``x @ w`` against `fa3_spec.eagle.gemm.matmul` (the kernel with
    `tile_config`'s tiles, what the model runs)."""
    weights = {n: [torch.randn(*SHAPES[n], device="cuda", dtype=torch.bfloat16) * 0.02
                   for _ in range(1 if n == "lm_head" else 32)] for n in SHAPES}
    total = sum(w.numel() * 2 for ws in weights.values() for w in ws)
    order = [(n, i) for i in range(32) for n in ("qkv", "o", "gate_up", "down")] + [("lm_head", 0)]
    floor_ms = total / (bandwidth * 1e12) * 1e3
    rows = {}
    for M in ms_list:
        xs = {n: torch.randn(M, SHAPES[n][0], device="cuda", dtype=torch.bfloat16) for n in SHAPES}
        outs = {n: torch.empty(M, SHAPES[n][1], device="cuda", dtype=torch.bfloat16) for n in SHAPES}

        def cublas():
            for n, i in order:
                torch.mm(xs[n], weights[n][i], out=outs[n])

        def library():
            for n, i in order:
                matmul(xs[n], weights[n][i])

        a, b = timing.replay_ms(cublas, 10), timing.replay_ms(library, 10)
        rows[M] = dict(cublas_ms=a, triton_ms=b, cublas_over_triton=a / b,
                       cublas_share_of_floor=floor_ms / a, triton_share_of_floor=floor_ms / b,
                       configs={n: tile_config(*SHAPES[n]) for n in SHAPES})
        print(f"model M={M}: cuBLAS {a:.3f} ms, matmul {b:.3f} ms ({a / b:.3f}x), floor {floor_ms:.3f} ms", flush=True)
    return dict(bytes=total, floor_ms=floor_ms, by_m=rows)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4, 16], help="GEMM rows (at most 16)")
    ap.add_argument("--json", metavar="PATH")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if any(not 1 <= m <= 16 for m in args.m):
        print(f"{PROG}: --m must lie in [1, 16], got {args.m}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"{PROG}: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    start = time.perf_counter()
    bandwidth = floors.read_bandwidth()
    print(f"read bandwidth {bandwidth:.2f} TB/s", flush=True)
    doc = dict(command=runs.command_line(PROG, argv), device=runs.device_name("cuda"),
               torch=torch.__version__, triton=triton.__version__,
               read_bandwidth_TBps=bandwidth, shapes={}, errors=[])
    for name, (K, N) in SHAPES.items():
        copies, rows_by_m = sweep_shape(name, K, N, args.m, doc["errors"])
        for M, rows in rows_by_m.items():
            kn = [r for r in rows if r["kind"] == "triton" and r["rel_err"] < 2e-2]
            cub = {r["kind"]: r["us"] for r in rows if r["kind"].startswith("cublas")}
            rule = tile_config(K, N)
            ruled = [r for r in kn if r["label"] == f"{rule.block_n}x{rule.block_k} s{rule.split}"]
            doc["shapes"][f"{name} M={M}"] = dict(
                K=K, N=N, copies=copies, configs_timed=len(rows), cublas_us=cub,
                best=kn[:3], tile_config=ruled[0] if ruled else None,
                cublas_kn_over_best=cub["cublas_kn"] / kn[0]["us"])
            print(f"{name} M={M}: cuBLAS x@w {cub['cublas_kn']:.1f} us, best Triton "
                  f"{kn[0]['label']} {kn[0]['us']:.1f} us ({cub['cublas_kn'] / kn[0]['us']:.3f}x)",
                  flush=True)
        torch.cuda.empty_cache()
    doc["model"] = model_sequence(args.m, bandwidth)
    doc["seconds"] = time.perf_counter() - start
    if args.json:
        runs.write_json(args.json, doc)
    return 0
