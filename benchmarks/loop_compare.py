"""The EAGLE loop end to end: metadata in the graph (a) against host-built
metadata (b) and plain decoding (c), each held against its floor.

For each config (page size, topk, num_steps, num_draft_tokens) and batch, in
one process, over the same prefilled requests (``--context`` prompt tokens):

  a  the engine's iteration (draft steps, tree, verify, accept, commit, draft
     extend, output) as one CUDA graph, its metadata built inside by fa3_spec
     builders (`fa3_spec.eagle.eagle_iteration`).
  b  the same loop with every step's metadata filled on the host before each
     replay, three graphs (`loop_variants`). ``--upstream`` picks the filler
     and every row names it in ``b_metadata_source``: sglang 0.5.23's own
     replay functions (``sglang``; ``auto`` when they load), or the project's
     upstream-style model (``model``; ``auto`` otherwise, ``b_metadata_note``
     saying why).
  c  plain greedy decoding: one decode step (metadata + target + argmax) per
     graph replay.

(a), (b) and (c) run the same compiled model. Random weights accept almost
nothing, so acceptance is scripted by default (``acceptance`` says so; the
tokens are not the model's); ``--real-acceptance`` uses greedy acceptance.
``--kernels`` picks the ops' CUDA kernels for the run (the other arm of a
kernel A/B); every row records the kernels it ran.

Per row: tokens/s, ms per iteration (wall, synced), host CPU ms, host syncs
per iteration, GPU idle share of an iteration; on CUDA the floors: bytes each
forward reads over the measured read bandwidth (``a_floor_ms``,
``c_floor_ms``, ``c_roofline_frac``) and FLOPs over the measured matmul
throughput (``a_compute_floor_ms``), and which of the two binds.

``--smoke`` runs every code path on CPU with the tiny preset (eager calls
instead of graphs, sglang's kernels in Triton's interpreter; timings
meaningless) and checks that (a) and (b) produce the same tokens and the same
whole loop state, and that (b)'s metadata read, query by query, the keys
fa3_spec's builders read (``b_metadata_mismatches``). Offline,
``FA3_SPEC_SGLANG_SRC`` names sglang's extracted sources
(`fa3_spec.harness.sglang_upstream.SOURCE_FILES`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

from fa3_spec.eagle import make_models
from fa3_spec.eagle.kernels import select_kernels, selected_kernels
from fa3_spec.graphs import COMPILE_BACKENDS
from fa3_spec.harness.sglang_upstream import SGLANG_VERSION, load_upstream_or_reason
from fa3_spec.probes import recording_host_syncs

import floors
import gpu_trace
import runs
import workload
from loop_variants import (
    MODEL_SOURCE, SGLANG_SOURCE, HostMetadataLoop, SglangMetadataLoop, greedy_segment,
    metadata_reads_as_builders,
)

PROG = "loop.py compare"
HELP = "the loop (a) against host-built metadata (b) and plain decoding (c), with floors"

#: (page_size, topk, num_steps, num_draft_tokens): a chain, a small tree, and a
#: wide tree (P = 2, topk = 8, 5 steps, 16 draft tokens).
CONFIGS = [(16, 1, 5, 6), (16, 4, 5, 8), (2, 8, 5, 16)]
BATCHES = [1, 8, 32, 64]


def _count_syncs(fn, cuda: bool):
    if not cuda:
        fn()
        return None
    with recording_host_syncs() as syncs:
        fn()
    return len(syncs)


def measure(fn, tokens_fn, iters: int, cuda: bool) -> dict:
    """Time ``iters`` calls of ``fn`` (one iteration each)."""
    for _ in range(2):
        fn()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = tokens_fn()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(iters):
        fn()
    sync()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    tokens = tokens_fn() - t0
    return dict(ms_per_iteration=round(1e3 * wall / iters, 4),
                host_cpu_ms_per_iteration=round(1e3 * cpu / iters, 4),
                tokens_per_s=round(tokens / wall, 2), tokens=int(tokens),
                host_syncs_per_iteration=_count_syncs(fn, cuda),
                gpu_idle_share=gpu_trace.gpu_idle_share(fn) if cuda else None)


def bench_point(cfg_tuple, batch, args, models, bandwidth=None, tflops=None) -> dict:
    """One row: (a), (b) and (c) over the same ``batch`` requests of ``cfg_tuple``."""
    p, k, s, n = cfg_tuple
    cuda = args.device == "cuda"
    total_iters = 2 + args.iters + 1 + 3 + 3  # warm-up, timed, sync count, profiler
    max_new = args.max_new_tokens or 2 * (total_iters * min(n, s + 1) + 8)
    # Branch semantics: (b) fills sglang's metadata, which drafts that way.
    lc = workload.loop_config(cfg_tuple, batch=batch, context=args.context, max_new=max_new,
                              draft_attention="branch", attention_backend=args.attention_backend)
    spec = lc.spec
    eng = workload.engine(lc, models, scripted=not args.real_acceptance, max_reqs=batch,
                          buckets=[batch], graphs=cuda, compile_backend=args.compile_backend,
                          regions=args.compile_regions, device=args.device)
    t0 = time.perf_counter()
    for prompt in workload.random_prompts(batch, args.context, models.vocab_size, seed=batch):
        eng.submit(prompt, max_new)
    eng.admit()  # prefill every request (eager)
    if cuda:
        torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    st = eng.bucket_state(batch)
    snapshot = {key: v.clone() for key, v in st.items()}
    kv = (eng.pool.target_kv.k.clone(), eng.pool.target_kv.v.clone(),
          eng.pool.draft_kv.k.clone(), eng.pool.draft_kv.v.clone()) if args.smoke else None

    def restore():
        for key, v in st.items():
            v.copy_(snapshot[key])
        if kv is not None:
            for dst, src in zip((eng.pool.target_kv.k, eng.pool.target_kv.v,
                                 eng.pool.draft_kv.k, eng.pool.draft_kv.v), kv):
                dst.copy_(src)

    out_tokens = lambda: float(st["out_len"].sum())  # noqa: E731 (a sync, outside the timed loop)
    row = dict(page_size=p, topk=k, num_steps=s, num_draft_tokens=n, batch=batch,
               draft_attention=lc.draft_attention, context=args.context,
               **workload.compiled_as(eng), kernels=dataclasses.asdict(selected_kernels()),
               acceptance="real" if args.real_acceptance else workload.SCRIPTED,
               preset=args.preset, layers=models.num_target_layers,
               draft_layers=models.num_draft_layers, dtype=str(models.dtype).replace("torch.", ""),
               prefill_s=round(prefill_s, 3))

    # (a) metadata in the graph: the engine's own compiled, captured iteration.
    t0 = time.perf_counter()
    eng.capture()
    row["capture_a_s"] = round(time.perf_counter() - t0, 2)
    restore()
    a = measure(lambda: eng.launch(batch), out_tokens, args.iters, cuda)
    row["a_in_graph"] = a
    a_state = {key: v.clone() for key, v in st.items()}
    restore()

    # (b) host-built metadata, three graphs of the same compiled model.
    t0 = time.perf_counter()
    host = (SglangMetadataLoop(eng, batch, cuda, args.upstream_code) if args.upstream_code
            else HostMetadataLoop(eng, batch, cuda))
    row["capture_b_s"] = round(time.perf_counter() - t0, 2)
    restore()
    b = measure(host.iteration, out_tokens, args.iters, cuda)
    row["b_host_metadata"] = b
    row["b_metadata_source"] = host.source
    if args.upstream_note:
        row["b_metadata_note"] = args.upstream_note
    if args.smoke:
        row["a_equals_b"] = bool(torch.equal(a_state["out_tokens"], st["out_tokens"]))
        # The whole loop state (draft features, candidate scores, ...), bitwise:
        # the same attention calls on the same keys give the same floats on CPU.
        row["a_state_equals_b"] = sorted(k for k, v in st.items() if not torch.equal(a_state[k], v)) or True
        row["b_metadata_mismatches"] = metadata_reads_as_builders(host)
    restore()

    # (c) plain greedy decoding, the same compiled model.
    seg, seq = greedy_segment(eng, batch, cuda)
    c = measure(seg.run, lambda: float(seq.sum()), args.iters, cuda)
    row["c_greedy"] = c
    restore()

    # Flat per-row fields; floors from the bytes each forward reads.
    row.update(a_ms_per_iteration=a["ms_per_iteration"], a_gpu_idle=a["gpu_idle_share"],
               a_tokens_per_s=a["tokens_per_s"], c_ms_per_token=c["ms_per_iteration"],
               c_tokens_per_s=c["tokens_per_s"],
               a_over_c=round(a["tokens_per_s"] / c["tokens_per_s"], 3))
    if host.source == SGLANG_SOURCE:  # only sglang's own code is a (b)
        row.update(b_ms_per_iteration=b["ms_per_iteration"], b_source=f"sglang-{SGLANG_VERSION}",
                   a_over_b=round(a["tokens_per_s"] / b["tokens_per_s"], 3))
    else:
        row["model_b_over_a_ms"] = round(b["ms_per_iteration"] / a["ms_per_iteration"], 3)
    if bandwidth:
        nbytes = floors.forward_bytes(models, batch, args.context)
        a_floor = (nbytes["target"] + s * nbytes["draft"]) / (bandwidth * 1e12) * 1e3
        c_floor = nbytes["target"] / (bandwidth * 1e12) * 1e3
        row.update(read_bandwidth_TBps=bandwidth, a_floor_ms=round(a_floor, 4),
                   a_over_floor=round(a["ms_per_iteration"] / a_floor, 3),
                   c_floor_ms=round(c_floor, 4),
                   c_roofline_frac=round(c_floor / c["ms_per_iteration"], 4))
    flops = floors.forward_flops(models, spec, batch, args.context)
    row.update(a_gflop=round(flops["a"] / 1e9, 1), c_gflop=round(flops["c"] / 1e9, 1))
    if tflops:
        # Which roof binds the row: the larger of the two floors.
        a_compute = flops["a"] / (tflops * 1e12) * 1e3
        c_compute = flops["c"] / (tflops * 1e12) * 1e3
        row.update(matmul_TFLOPs=tflops, a_compute_floor_ms=round(a_compute, 4),
                   c_compute_floor_ms=round(c_compute, 4))
        if bandwidth:
            row.update(a_bound="compute" if a_compute > row["a_floor_ms"] else "bandwidth",
                       c_bound="compute" if c_compute > row["c_floor_ms"] else "bandwidth")
    return row


def _resolve_upstream(args):
    """``(UpstreamSglang or None, note)`` for ``--upstream``; before anything imports
    Triton (on CPU sglang's kernels need Triton's interpreter mode)."""
    if args.upstream == "model":
        return None, ""
    # As sglang runs it: draft_decode_set_expand_metadata under torch.compile(dynamic=True)
    # (eager in the CPU smoke run).
    up, why = load_upstream_or_reason(device=args.device, fetch=args.upstream == "sglang",
                                      compile_expand=not args.smoke)
    if up is None and args.upstream == "sglang":
        raise SystemExit(f"--upstream sglang: sglang {SGLANG_VERSION}'s code is unavailable: {why}")
    if up is None:
        print(f"(b) falls back to the {MODEL_SOURCE}: {why}", file=sys.stderr)
        return None, f"sglang {SGLANG_VERSION} unavailable ({why})"
    return up, ""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, every code path")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--configs", nargs="+", default=None,
                    help="P,topk,steps,N tuples, e.g. 16,4,5,8 (default: the three CONFIGS)")
    ap.add_argument("--context", type=int, default=None, help="prompt tokens per request")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--compile-backend", default="auto", choices=list(COMPILE_BACKENDS),
                    help="torch.compile backend of (a), (b) and (c) alike (default: inductor on "
                         "CUDA, none on CPU)")
    ap.add_argument("--compile-regions", action=argparse.BooleanOptionalAction, default=None,
                    help="the layers of (a), (b) and (c) as compiled regions or inline; "
                         "default: the engine's (regions under inductor)")
    ap.add_argument("--kernels", nargs="+", default=[], metavar="NAME=VALUE",
                    help="the ops' CUDA kernels for this run (fa3_spec.eagle.kernels.Kernels: "
                         "gemm=triton|cublas, store_kv=triton|index_copy, rope_kv=fused|split, "
                         "pdl=on|off); default: the library's")
    ap.add_argument("--real-acceptance", action="store_true")
    ap.add_argument("--upstream", choices=("auto", "sglang", "model"), default="auto",
                    help="metadata of (b): sglang 0.5.23's own replay functions (sglang; "
                         "FA3_SPEC_SGLANG_SRC names its sources offline), the project's "
                         "upstream-style model (model), or sglang when it loads (auto)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--append", action="store_true",
                    help="add rows to an existing --json file (split a long run over calls)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.smoke:
        args.device, args.attention_backend = "cpu", "torch"
        args.preset = args.preset or "tiny"
        batches, configs = args.batches or [2], [(2, 4, 3, 6), (16, 1, 3, 4)]
        args.context, args.iters = args.context or 20, args.iters or 3
        torch.set_num_threads(1)
    else:
        args.device, args.attention_backend = "cuda", "fa3"
        args.preset = args.preset or "llama3-8b"
        batches, configs = args.batches or BATCHES, CONFIGS
        args.context, args.iters = args.context or 1024, args.iters or 20
    if args.configs:
        configs = [workload.parse_config(c) for c in args.configs]
    try:
        chosen = workload.kernels(args.kernels)
    except ValueError as exc:
        print(f"--kernels: {exc}", file=sys.stderr)
        return 2
    args.upstream_code, args.upstream_note = _resolve_upstream(args)
    if args.kernels:
        select_kernels(chosen)
    models = make_models(args.preset, draft="random", device=args.device,
                         num_layers=args.num_layers)
    command = runs.command_line(PROG, argv)
    out = dict(torch=torch.__version__, device=runs.device_name(args.device), commands=[command],
               rows=[])
    if args.append and args.json and os.path.exists(args.json):
        with open(args.json) as fh:
            old = json.load(fh)
        out = {**old, "commands": old.get("commands", []) + [command]}
    rows = out["rows"]
    bandwidth = tflops = None
    if args.device == "cuda":
        bandwidth = round(floors.read_bandwidth(), 3)
        tflops = round(floors.matmul_throughput(), 1)
        out.update(read_bandwidth_TBps=bandwidth, matmul_TFLOPs=tflops)
        print(f"read bandwidth {bandwidth} TB/s, bf16 matmul {tflops} TFLOP/s", flush=True)
    for cfg in configs:
        for batch in batches:
            row = bench_point(cfg, batch, args, models, bandwidth, tflops)
            rows.append(row)
            a, b, c = row["a_in_graph"], row["b_host_metadata"], row["c_greedy"]
            print(f"P={cfg[0]} topk={cfg[1]} S={cfg[2]} N={cfg[3]} bs={batch} [{row['acceptance']}]: "
                  f"a {a['tokens_per_s']:.0f} tok/s {a['ms_per_iteration']:.2f} ms/it "
                  f"(floor x{row.get('a_over_floor')}) syncs {a['host_syncs_per_iteration']} "
                  f"idle {a['gpu_idle_share']} | b [{row['b_metadata_source']}] "
                  f"{b['ms_per_iteration']:.2f} ms/it syncs {b['host_syncs_per_iteration']} | "
                  f"c {c['ms_per_iteration']:.2f} ms/token ({row.get('c_roofline_frac')} of roofline) | "
                  f"a/b {row.get('a_over_b')} a/c {row['a_over_c']}", flush=True)
            if args.json:
                runs.write_json(args.json, out)
    return 0
