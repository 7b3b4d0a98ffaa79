"""Skinny GEMMs (M <= 16 rows) in Triton against cuBLAS, on the target's shapes (H200).

A decode step at batch 1 spends most of its time in GEMMs whose ``M`` (rows)
is 1 to 16 and whose weights stream from DRAM once. This benchmark asks how
far from the read-bandwidth floor cuBLAS leaves those GEMMs, and whether a
plain Triton kernel (split-K with a deterministic reduction, no atomics)
closes the gap, before any of it enters the library.

Measured in one process, every figure a median of CUDA-event timings of a
CUDA graph replay:

* ``read_bandwidth_TBps``: a streaming reduction over a 4 GiB buffer;
* ``shapes``: each llama3-8b GEMM (fused QKV, O, fused gate/up, down,
  lm_head) at each ``M``, over enough weight copies (> 512 MiB) that every
  call streams from DRAM: cuBLAS as ``x @ w`` (``w [in, out]``, the model's
  layout) and as ``F.linear`` (``w [out, in]``), and a sweep of Triton
  configurations in both layouts, the best three kept (relative error
  against fp32 below 2e-2);
* ``model``: the 32 layers' GEMMs plus the lm_head in decode order, one graph,
  cuBLAS ``x @ w`` against Triton on the same ``[in, out]`` weights with the
  best ``[in, out]`` configuration per shape, and both as a share of the floor
  (15.0 GB over the measured bandwidth).

    python3 benchmarks/skinny_gemm.py --json benchmarks/results/skinny_gemm_h200.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

import timing
from fa3_spec.graphs import capture

@triton.jit
def mm_kn(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          PARTIAL: tl.constexpr, EVEN: tl.constexpr):
    """w [K, N] row-major (x @ w). grid (cdiv(N, BN), cdiv(M, BM), split)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk0 = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + rm[:, None] * K
    m_ok = rm[:, None] < M
    for kk in tl.range(0, k_per_split, BLOCK_K):
        rk = k_start + kk + rk0
        if EVEN:
            w = tl.load(w_ptr + rk[:, None] * N + rn[None, :])
        else:
            w = tl.load(w_ptr + rk[:, None] * N + rn[None, :],
                        mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        x = tl.load(x_rows + rk[None, :], mask=m_ok & (rk[None, :] < K), other=0.0)
        acc += tl.dot(x, w)
    o_mask = m_ok & (rn[None, :] < N)
    if PARTIAL:
        tl.store(out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=o_mask)
    else:
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def mm_nk(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          PARTIAL: tl.constexpr, EVEN: tl.constexpr):
    """w [N, K] row-major (F.linear). grid (cdiv(N, BN), cdiv(M, BM), split)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk0 = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + rm[:, None] * K
    m_ok = rm[:, None] < M
    for kk in tl.range(0, k_per_split, BLOCK_K):
        rk = k_start + kk + rk0
        if EVEN:
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :])
        else:
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :],
                        mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
        x = tl.load(x_rows + rk[None, :], mask=m_ok & (rk[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w))
    o_mask = m_ok & (rn[None, :] < N)
    if PARTIAL:
        tl.store(out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=o_mask)
    else:
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def gemv_nk(x_ptr, w_ptr, out_ptr, N, K, k_per_split,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr):
    """M = 1, w [N, K]: CUDA-core dot along the contiguous K. grid (cdiv(N, BN), 1, split)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk0 = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for kk in tl.range(0, k_per_split, BLOCK_K):
        rk = k_start + kk + rk0
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :])
        x = tl.load(x_ptr + rk)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.sum(acc, axis=1)
    if PARTIAL:
        tl.store(out_ptr + pid_k * N + rn, out)
    else:
        tl.store(out_ptr + rn, out.to(out_ptr.dtype.element_ty))


@triton.jit
def gemv_kn(x_ptr, w_ptr, out_ptr, N, K, k_per_split,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr):
    """M = 1, w [K, N]: CUDA-core FMA, reduce over the strided K. grid (cdiv(N, BN), 1, split)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk0 = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for kk in tl.range(0, k_per_split, BLOCK_K):
        rk = k_start + kk + rk0
        w = tl.load(w_ptr + rk[:, None] * N + rn[None, :])
        x = tl.load(x_ptr + rk)
        acc += w.to(tl.float32) * x.to(tl.float32)[:, None]
    out = tl.sum(acc, axis=0)
    if PARTIAL:
        tl.store(out_ptr + pid_k * N + rn, out)
    else:
        tl.store(out_ptr + rn, out.to(out_ptr.dtype.element_ty))


@triton.jit
def reduce_split(part_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * BLOCK + tl.arange(0, BLOCK)
    ok = r < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * MN + r, mask=ok, other=0.0)
    tl.store(out_ptr + r, acc.to(out_ptr.dtype.element_ty), mask=ok)


def launch(kind, x, w, out, part, cfg):
    """``out = x @ w`` (``kind`` kn, gemv_kn) or ``x @ w.T`` (nk, gemv_nk) for
    ``x [M, K]``; ``part`` holds ``split * M * N`` fp32 partials.
    ``cfg``: ``dict(bn, bk, split, warps, stages[, bm])``."""
    M, K = x.shape
    N = w.shape[1] if kind in ("kn", "gemv_kn") else w.shape[0]
    split = cfg["split"]
    bk = cfg["bk"]
    k_per = triton.cdiv(K, split * bk) * bk
    partial = split > 1
    dst = part if partial else out
    grid_n = triton.cdiv(N, cfg["bn"])
    even = (N % cfg["bn"] == 0) and (K % (split * bk) == 0)
    if kind == "kn":
        bm = cfg.get("bm", 16)
        mm_kn[(grid_n, triton.cdiv(M, bm), split)](x, w, dst, M, N, K, k_per, BLOCK_M=bm, BLOCK_N=cfg["bn"],
                                                   BLOCK_K=bk, PARTIAL=partial, EVEN=even,
                                                   num_warps=cfg["warps"], num_stages=cfg["stages"])
    elif kind == "nk":
        bm = cfg.get("bm", 16)
        mm_nk[(grid_n, triton.cdiv(M, bm), split)](x, w, dst, M, N, K, k_per, BLOCK_M=bm, BLOCK_N=cfg["bn"],
                                                   BLOCK_K=bk, PARTIAL=partial, EVEN=even,
                                                   num_warps=cfg["warps"], num_stages=cfg["stages"])
    elif kind == "gemv_nk":
        assert even and M == 1
        gemv_nk[(grid_n, 1, split)](x, w, dst, N, K, k_per, BLOCK_N=cfg["bn"], BLOCK_K=bk, PARTIAL=partial,
                                    num_warps=cfg["warps"], num_stages=cfg["stages"])
    elif kind == "gemv_kn":
        assert even and M == 1
        gemv_kn[(grid_n, 1, split)](x, w, dst, N, K, k_per, BLOCK_N=cfg["bn"], BLOCK_K=bk, PARTIAL=partial,
                                    num_warps=cfg["warps"], num_stages=cfg["stages"])
    else:
        raise ValueError(kind)
    if partial:
        MN = M * N
        reduce_split[(triton.cdiv(MN, 1024),)](part, out, MN, SPLIT=split, BLOCK=1024, num_warps=4)
    return out


SHAPES = {  # llama3-8b, (K, N) = (in, out)
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
    "lm_head": (4096, 128256),
}
MM_TILES = [(32, 128), (32, 256), (64, 128), (64, 256), (128, 64)]  # (BLOCK_N, BLOCK_K), BLOCK_M 16
GEMV_TILES = [(16, 512), (32, 256), (64, 128)]
KN_KINDS = ("kn", "gemv_kn")


def replay_ms(fn, reps: int = 20) -> float:
    """Median ms of one ``fn()`` captured as a CUDA graph."""
    graph, _ = capture(fn, warmup=2)
    _, device = timing.event_samples(graph.replay, reps, warmup=3)
    return statistics.median(device) * 1e3


def read_bandwidth() -> float:
    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda").view(torch.float32)
    x.fill_(1.0)
    out = torch.empty((), device="cuda")
    ms = replay_ms(lambda: torch.sum(x, 0, out=out))
    return x.numel() * 4 / (ms * 1e-3) / 1e12


def configs(K: int, N: int, M: int):
    """``(label, kind, cfg)`` of the sweep; split-K only where it divides ``K``."""
    for kind in ("kn", "nk"):
        for bn, bk in MM_TILES:
            for split in (1, 2, 4):
                if K % (split * bk) == 0:
                    yield f"{kind} {bn}x{bk} s{split}", kind, dict(bn=bn, bk=bk, split=split, warps=4, stages=4)
    if M == 1:
        for kind in ("gemv_kn", "gemv_nk"):
            for bn, bk in GEMV_TILES:
                for warps in (4, 8):
                    for split in (1, 2, 4):
                        if K % (split * bk) == 0 and N % bn == 0:
                            cfg = dict(bn=bn, bk=bk, split=split, warps=warps, stages=3)
                            yield f"{kind} {bn}x{bk} w{warps} s{split}", kind, cfg


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
        part = torch.empty(4 * M * N, device="cuda", dtype=torch.float32)
        ref = x.float() @ w_kn[0].float()
        rows = []

        def record(label, kind, gemm):
            try:
                ms = replay_ms(lambda: [gemm(a, b) for a, b in zip(w_kn, w_nk)]) / copies
                gemm(w_kn[0], w_nk[0])
                torch.cuda.synchronize()
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            except Exception as exc:  # a configuration Triton rejects is reported, not fatal
                errors.append(f"{name} M={M} {label}: {type(exc).__name__}: {str(exc)[:200]}")
                return
            rows.append(dict(label=label, kind=kind, us=ms * 1e3, TBps=nbytes / (ms * 1e-3) / 1e12, rel_err=err))

        record("cublas x @ w", "cublas_kn", lambda a, b: torch.mm(x, a, out=out))
        record("cublas F.linear", "cublas_nk", lambda a, b: torch.matmul(x, b.t(), out=out))
        for label, kind, cfg in configs(K, N, M):
            record(label, kind, lambda a, b, kind=kind, cfg=cfg:
                   launch(kind, x, a if kind in KN_KINDS else b, out, part, cfg))
        rows.sort(key=lambda r: r["us"])
        rows_by_m[M] = rows
    return copies, rows_by_m


def parse_label(label: str):
    kind, tile, *rest = label.split()
    bn, bk = map(int, tile.split("x"))
    warps = int(rest[0][1:]) if rest[0].startswith("w") else 4
    split = int(rest[-1][1:])
    return kind, dict(bn=bn, bk=bk, split=split, warps=warps, stages=3 if kind.startswith("gemv") else 4)


def model_sequence(best_kn, ms_list, bandwidth):
    """The 32 layers' GEMMs + lm_head in decode order on ``[in, out]`` weights."""
    weights = {n: [torch.randn(*SHAPES[n], device="cuda", dtype=torch.bfloat16) * 0.02
                   for _ in range(1 if n == "lm_head" else 32)] for n in SHAPES}
    total = sum(w.numel() * 2 for ws in weights.values() for w in ws)
    order = [(n, i) for i in range(32) for n in ("qkv", "o", "gate_up", "down")] + [("lm_head", 0)]
    floor_ms = total / (bandwidth * 1e12) * 1e3
    rows = {}
    for M in ms_list:
        xs = {n: torch.randn(M, SHAPES[n][0], device="cuda", dtype=torch.bfloat16) for n in SHAPES}
        outs = {n: torch.empty(M, SHAPES[n][1], device="cuda", dtype=torch.bfloat16) for n in SHAPES}
        part = torch.empty(4 * M * SHAPES["lm_head"][1], device="cuda", dtype=torch.float32)
        cfgs = {n: parse_label(best_kn[(n, M)]) for n in SHAPES}

        def cublas():
            for n, i in order:
                torch.mm(xs[n], weights[n][i], out=outs[n])

        def triton_kn():
            for n, i in order:
                kind, cfg = cfgs[n]
                launch(kind, xs[n], weights[n][i], outs[n], part, cfg)

        a, b = replay_ms(cublas, 10), replay_ms(triton_kn, 10)
        rows[M] = dict(cublas_ms=a, triton_ms=b, cublas_over_triton=a / b,
                       cublas_share_of_floor=floor_ms / a, triton_share_of_floor=floor_ms / b,
                       configs={n: best_kn[(n, M)] for n in SHAPES})
        print(f"model M={M}: cuBLAS {a:.3f} ms, Triton {b:.3f} ms ({a / b:.3f}x), floor {floor_ms:.3f} ms", flush=True)
    return dict(bytes=total, floor_ms=floor_ms, by_m=rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4, 16], help="GEMM rows (at most 16)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("skinny_gemm: needs a CUDA GPU", file=sys.stderr)
        return 2
    if any(not 1 <= m <= 16 for m in args.m):
        print(f"skinny_gemm: --m must lie in [1, 16], got {args.m}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth:.2f} TB/s", flush=True)
    doc = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               read_bandwidth_TBps=bandwidth, shapes={}, errors=[])
    best_kn = {}
    for name, (K, N) in SHAPES.items():
        copies, rows_by_m = sweep_shape(name, K, N, args.m, doc["errors"])
        for M, rows in rows_by_m.items():
            ok = [r for r in rows if not r["kind"].startswith("cublas") and r["rel_err"] < 2e-2]
            kn = [r for r in ok if r["kind"] in KN_KINDS]
            cub = {r["kind"]: r["us"] for r in rows if r["kind"].startswith("cublas")}
            best_kn[(name, M)] = kn[0]["label"]
            doc["shapes"][f"{name} M={M}"] = dict(
                K=K, N=N, copies=copies, configs_timed=len(rows), cublas_us=cub,
                best=ok[:3], best_kn=kn[0], cublas_kn_over_best_kn=cub["cublas_kn"] / kn[0]["us"])
            print(f"{name} M={M}: cuBLAS x@w {cub['cublas_kn']:.1f} us, best Triton [in,out] "
                  f"{kn[0]['label']} {kn[0]['us']:.1f} us ({cub['cublas_kn'] / kn[0]['us']:.3f}x)", flush=True)
        torch.cuda.empty_cache()
    doc["model"] = model_sequence(best_kn, args.m, bandwidth)
    doc["seconds"] = time.perf_counter() - start
    if args.json:
        timing.write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
