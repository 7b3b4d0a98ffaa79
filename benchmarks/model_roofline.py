"""The target model against the GPU's read-bandwidth floor (H200).

Measured in one process, each as a CUDA graph replayed many times (median of
CUDA-event timings):

* ``read_bandwidth_TBps``: a streaming reduction over a 4 GiB buffer;
* ``gemm``: the 32 layers' GEMMs (fused QKV, O, fused gate/up, down) plus the
  lm_head at ``M`` rows, in both weight layouts: ``x @ w`` with ``w [in, out]``
  and ``F.linear`` with ``w [out, in]``, against the bytes they read;
* ``attention``: one layer's decode FA3 call at batch 1 for several split counts;
* ``decode``: one plain decode step of the whole model (`fa3_spec.eagle.decode_step`,
  metadata + 32 layers + lm_head + argmax) at each batch, eager-captured and
  compiled with inductor (the layers inline, the models' default), with
  compile time, kernels per step and the share of the floor (weights + KV at
  the context, over the measured bandwidth).

    python3 benchmarks/model_roofline.py --json benchmarks/results/model_roofline_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import fa3_spec
from fa3_spec.eagle import KVPool, make_models
from fa3_spec.eagle.decode import decode_step
from fa3_spec.eagle.vocab import vocab_argmax
from fa3_spec.graphs import capture, compile_fullgraph

import timing


def _graph(fn, inner: int = 1):
    """``fn`` called ``inner`` times, captured as one CUDA graph after a side-stream warm-up."""
    graph, _ = capture(lambda: [fn() for _ in range(inner)], warmup=2)
    return graph


def replay_ms(fn, reps: int = 50, inner: int = 1) -> float:
    """Median ms of one ``fn()`` captured as a CUDA graph (``inner`` calls per graph)."""
    _, device = timing.event_samples(_graph(fn, inner).replay, reps, warmup=3)
    return statistics.median(device) * 1e3 / inner


def kernels_per_call(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    graph = _graph(fn)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def read_bandwidth() -> float:
    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda").view(torch.float32)
    x.fill_(1.0)
    out = torch.empty((), device="cuda")
    ms = replay_ms(lambda: torch.sum(x, 0, out=out), reps=20)
    return x.numel() * 4 / (ms * 1e-3) / 1e12


def matmul_throughput(n: int = 8192, dtype=torch.bfloat16) -> float:
    """Dense TFLOP/s of one ``[n, n] @ [n, n]`` matmul (cuBLAS), replayed as a
    graph: the compute roof the loop's large-batch rows are held against."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    out = torch.empty(n, n, device="cuda", dtype=dtype)
    ms = replay_ms(lambda: torch.mm(a, b, out=out), reps=20, inner=4)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def gemm_rows(shape, ms_list, dtype=torch.bfloat16):
    h, i, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * d
    mats = [(qkv, h), (h, shape.num_heads * d), (2 * i, h), (h, i)] * shape.num_layers
    mats.append((shape.vocab_size, h))
    out_in = [torch.randn(o, n, device="cuda", dtype=dtype) for o, n in mats]
    in_out = [w.t().contiguous() for w in out_in]
    nbytes = sum(w.numel() * w.element_size() for w in out_in)
    rows = []
    for m in ms_list:
        xs = {n: torch.randn(m, n, device="cuda", dtype=dtype) for n in {n for _, n in mats}}
        lin = replay_ms(lambda: [F.linear(xs[w.shape[1]], w) for w in out_in], reps=20)
        mm = replay_ms(lambda: [xs[w.shape[0]] @ w for w in in_out], reps=20)
        rows.append(dict(M=m, bytes=nbytes, F_linear_ms=round(lin, 4), x_at_w_ms=round(mm, 4)))
    del out_in, in_out
    return rows


def attention_rows(shape, context, splits_list, page_size):
    hkv, d, hq = shape.num_kv_heads, shape.head_dim, shape.num_heads
    spec = fa3_spec.SpecConfig(page_size=page_size, topk=1, num_steps=2, num_draft_tokens=1,
                               max_bs=1, max_context_len=context + 64)
    pages = -(-spec.min_row_len // page_size) + 1
    k = torch.randn(pages, page_size, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    r2t = torch.arange(page_size, pages * page_size, dtype=torch.int32, device="cuda").view(1, -1)
    md = fa3_spec.build_decode_metadata(spec, req_to_token=r2t,
                                        req_pool_indices=torch.zeros(1, dtype=torch.int64, device="cuda"),
                                        seq_lens=torch.full((1,), context, dtype=torch.int64, device="cuda"))
    q = torch.randn(1, hq, d, device="cuda", dtype=torch.bfloat16)
    rows = []
    for s in splits_list:
        ms = replay_ms(lambda: fa3_spec.cascade_attention(q, k, v, md, backend="fa3", num_splits=s),
                       reps=30, inner=32)
        rows.append(dict(num_splits=s, us_per_call=round(1e3 * ms, 2)))
    default = fa3_spec.attention.default_num_splits(1, hkv, md.max_seqlen_k)
    return dict(context=context, page_size=page_size, default_num_splits=default, rows=rows)


def decode_rows(models, batches, context, bandwidth, compile_backends, page_size=16):
    shape = models.target.shape
    weight_bytes = sum(t.numel() * t.element_size() for w in models.target.layers
                       for t in (w.wqkv, w.wo, w.w_gate_up, w.w_down)) + \
        models.target.lm_head.numel() * 2
    out = []
    for bs in batches:
        spec = fa3_spec.SpecConfig(page_size=page_size, topk=1, num_steps=2, num_draft_tokens=1,
                                   max_bs=bs, max_context_len=context + 64)
        spec = dataclasses.replace(spec, num_pages=spec.pool_pages(bs))
        pool = KVPool(spec, max_reqs=bs, target_layers=models.num_target_layers, draft_layers=1,
                      num_kv_heads=models.num_kv_heads, head_dim=models.head_dim,
                      dtype=models.dtype, device="cuda")
        rows = [pool.allocate(context, 8) for _ in range(bs)]
        rpi = torch.tensor(rows, dtype=torch.int64, device="cuda")
        seq = torch.full((bs,), context, dtype=torch.int64, device="cuda")
        tok = torch.randint(0, shape.vocab_size, (bs,), device="cuda")
        kv_bytes = 2 * shape.num_layers * bs * context * shape.num_kv_heads * shape.head_dim * 2
        floor_ms = (weight_bytes + kv_bytes) / (bandwidth * 1e12) * 1e3

        def step(fn):
            return lambda: tok.copy_(vocab_argmax(fn(models, spec, pool.target_kv,
                                                     pool.req_to_token, rpi, seq, tok,
                                                     backend="fa3")))

        for be in compile_backends:
            torch._dynamo.reset()
            t0 = time.perf_counter()
            if be == "none":
                fn = decode_step
            else:
                fn = compile_fullgraph(decode_step, backend=be)
                torch._dynamo.mark_dynamic(rpi, 0)
                torch._dynamo.mark_dynamic(seq, 0)
                torch._dynamo.mark_dynamic(tok, 0)
                step(fn)()
            compile_s = time.perf_counter() - t0
            ms = replay_ms(step(fn), reps=30)
            row = dict(batch=bs, context=context, compile=be, ms_per_step=round(ms, 4),
                       floor_ms=round(floor_ms, 4), roofline_frac=round(floor_ms / ms, 4),
                       compile_s=round(compile_s, 1), kernels_per_step=kernels_per_call(step(fn)))
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--gemm-m", type=int, nargs="+", default=[1, 8, 16, 64])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--compile", nargs="+", default=["none", "inductor"])
    ap.add_argument("--skip", nargs="*", default=[], choices=["gemm", "attention", "decode"])
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("model_roofline.py needs CUDA", file=sys.stderr)
        return 2
    res = dict(command="python3 benchmarks/model_roofline.py " + " ".join(sys.argv[1:] if argv is None else argv),
               torch=torch.__version__, device=torch.cuda.get_device_name())
    res["read_bandwidth_TBps"] = round(read_bandwidth(), 3)
    print("read bandwidth", res["read_bandwidth_TBps"], "TB/s", flush=True)
    models = make_models(args.preset, draft="random", device="cuda", num_layers=args.num_layers)
    shape = models.target.shape
    if "gemm" not in args.skip:
        res["gemm"] = gemm_rows(shape, args.gemm_m)
        for r in res["gemm"]:
            r["floor_ms"] = round(r["bytes"] / (res["read_bandwidth_TBps"] * 1e12) * 1e3, 4)
            print(json.dumps(r), flush=True)
    if "attention" not in args.skip:
        res["attention"] = [attention_rows(shape, args.context, args.splits, p) for p in (16, 2)]
        print(json.dumps(res["attention"]), flush=True)
    if "decode" not in args.skip:
        res["decode"] = decode_rows(models, args.batches, args.context, res["read_bandwidth_TBps"],
                                    args.compile)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
