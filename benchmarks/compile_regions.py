"""What compiling the layers as regions saves: compile time against depth,
layers inline against layers as compiled regions.

One target forward (a prefill of ``--tokens`` tokens, `fa3_spec.eagle`'s
models at the ``tiny`` preset's widths, ``--layers`` deep), or with ``--what
iteration`` the engine's whole EAGLE iteration (`ITERATION_CONFIG`, one
bucket, no CUDA graph), compiled with ``--compile-backend`` two ways, each in a fresh
process with an empty inductor cache:

  inline   the layers traced into the forward's graph;
  regions  each layer a ``fa3_spec_eagle`` layer op compiled once per program
           (`fa3_spec.eagle.regions`; the engine's default under inductor).

Per row: seconds of the first call (trace + compile + run) and of the second
(run), the region programs compiled, and for the forward the largest
difference from the eager forward. ``--restart`` (with ``--what iteration``):
each cold row is followed by a fresh process with an empty inductor cache
that loads the compile-cache file the cold run wrote, and the rows count
inductor's FX-graph cache hits and misses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import torch

import fa3_spec
from fa3_spec.eagle import KVPool, make_models, regions
from fa3_spec.graphs import load_compile_cache, save_compile_cache

import runs
import workload

PROG = "compile.py regions"
HELP = "compile time against depth: the layers inline against compiled regions"
#: The iteration's (P, topk, steps, N) with ``--what iteration``.
ITERATION_CONFIG = (2, 4, 3, 6)


def child(layers: int, mode: str, tokens: int, compile_backend: str, device: str) -> dict:
    """One fresh process: the first and second call of one compiled target forward."""
    torch.manual_seed(0)
    dtype = torch.float32 if device == "cpu" else None
    models = make_models("tiny", draft="random", num_layers=layers, dtype=dtype, device=device)
    if mode == "regions":
        models = models.with_compile_regions(compile_backend)
    spec = fa3_spec.SpecConfig(page_size=2, topk=1, num_steps=2, num_draft_tokens=2, max_bs=1,
                               max_context_len=tokens + 4)
    spec = dataclasses.replace(spec, num_pages=spec.pool_pages(1, "branch"))
    pools = [KVPool(spec, max_reqs=1, target_layers=layers, draft_layers=1,
                    num_kv_heads=models.num_kv_heads, head_dim=models.head_dim,
                    dtype=models.dtype, device=device, draft_attention="branch")
             for _ in range(2)]
    row = pools[0].allocate(tokens, 1)
    pools[1].allocate(tokens, 1)
    lens = torch.tensor([tokens], device=device)
    md = fa3_spec.build_prefill_metadata(
        spec, req_to_token=pools[0].req_to_token,
        req_pool_indices=torch.tensor([row], device=device), seq_lens=lens,
        extend_seq_lens=lens, max_seqlen_q=tokens)
    ids = torch.randint(0, models.vocab_size, (tokens,), device=device)
    pos = torch.arange(tokens, device=device)
    slots = pools[0].req_to_token[row, :tokens].to(torch.int64)
    attn = "fa3" if device == "cuda" else "torch"
    fn = torch.compile(lambda kv: models.target_forward(ids, pos, slots, md, kv,
                                                        attention_backend=attn),
                       fullgraph=True, backend=compile_backend)

    def timed(kv):
        start = time.perf_counter()
        out = fn(kv)
        if device == "cuda":
            torch.cuda.synchronize()
        return out, time.perf_counter() - start

    with torch.no_grad():
        out, first = timed(pools[0].target_kv)
        _, second = timed(pools[1].target_kv)
        eager = models.with_compile_regions(None).target_forward(
            ids, pos, slots, md, pools[1].target_kv, attention_backend=attn)
    return dict(layers=layers, mode=mode, compile_backend=compile_backend, device=device,
                tokens=tokens,
                first_call_s=round(first, 2), second_call_s=round(second, 4),
                region_programs=regions.compiled_programs(),
                max_abs_diff_vs_eager=float((out.float() - eager.float()).abs().max()))


def child_iteration(layers: int, mode: str, compile_backend: str, device: str,
                    cache: str = "") -> dict:
    """The engine's whole EAGLE iteration (`ITERATION_CONFIG`, one bucket of
    1), compiled by `EagleEngine` with the layers inline or as regions.
    ``cache``: a file of PyTorch's compile caches, loaded before the first
    launch and written after it (`fa3_spec.graphs.load_compile_cache` and
    `save_compile_cache`: what `EagleEngine(cache_path=)` does around
    `EagleEngine.capture`, which this uncaptured launch does not call)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    dtype = torch.float32 if device == "cpu" else None
    models = make_models("tiny", draft="derived", num_layers=layers, dtype=dtype, device=device)
    lc = workload.loop_config(ITERATION_CONFIG, batch=1, context=16, max_new=24, pool_rows=2,
                              attention_backend="fa3" if device == "cuda" else "torch")
    eng = workload.engine(lc, models, scripted=True, buckets=[1], graphs=False,
                          compile_backend=compile_backend, regions=mode == "regions", device=device)
    eng.submit(list(range(1, 17)), 24)
    eng.admit()

    def timed():
        start = time.perf_counter()
        eng.launch(1)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    loaded = bool(cache) and load_compile_cache(cache)
    first = timed()
    if cache:
        save_compile_cache(cache)
    second = timed()
    return dict(what="iteration", layers=layers, mode=mode, compile_backend=compile_backend,
                device=device,
                config=list(ITERATION_CONFIG), first_call_s=round(first, 2), second_call_s=round(second, 4),
                frames=eng.runner.compile_counter.frame_count,
                region_programs=regions.compiled_programs(),
                dynamo_graphs=counters["stats"]["unique_graphs"], cache_loaded=loaded,
                fxgraph_cache_hits=counters["inductor"]["fxgraph_cache_hit"],
                fxgraph_cache_misses=counters["inductor"]["fxgraph_cache_miss"])


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--modes", nargs="+", choices=["inline", "regions"],
                    default=["inline", "regions"])
    ap.add_argument("--what", choices=["forward", "iteration"], default="forward",
                    help="one target forward, or the engine's whole EAGLE iteration")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--compile-backend", choices=regions.REGION_COMPILE_BACKENDS,
                    default="inductor")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--restart", action="store_true",
                    help="with --what iteration: after each cold row, a fresh process (empty "
                         "inductor cache) that loads the cold run's cache_path file")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU smoke run: 2 layers as regions, the eager backend, 8 tokens")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--_child", nargs=3, default=None, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.smoke:
        args.layers, args.modes, args.compile_backend, args.tokens = [2], ["regions"], "eager", 8
    if min(args.layers + [args.tokens]) < 1:
        print("--layers and --tokens must be >= 1", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda needs CUDA", file=sys.stderr)
        return 2
    if args.restart and args.what != "iteration":
        print("--restart needs --what iteration", file=sys.stderr)
        return 2
    if args._child:
        layers, mode, cache = int(args._child[0]), args._child[1], args._child[2]
        if args.what == "iteration":
            row = child_iteration(layers, mode, args.compile_backend, args.device, cache)
        else:
            row = child(layers, mode, args.tokens, args.compile_backend, args.device)
        print(json.dumps(row))
        return 0
    doc = dict(command=runs.command_line(PROG, argv), torch=torch.__version__,
               cpu_count=os.cpu_count(), rows=[])
    with tempfile.TemporaryDirectory() as tmp:
        phases = ["cold", "restart"] if args.restart else ["cold"]
        plan = [(n, m, p) for n in args.layers for m in args.modes for p in phases]
        for i, (layers, mode, phase) in enumerate(plan):
            # The restart loads the file its cold run wrote (an empty string: no file).
            cache = os.path.join(tmp, f"{layers}-{mode}.cache") if args.restart else ""
            cmd = [sys.executable, runs.script("compile.py"), "regions", "--_child", str(layers),
                   mode, cache, "--tokens", str(args.tokens), "--compile-backend", args.compile_backend,
                   "--device", args.device, "--what", args.what]
            row = runs.fresh_process_row(cmd, os.path.join(tmp, f"inductor-{i}"),
                                         f"{mode} at {layers} layers")
            if args.restart:
                row["phase"] = phase
            print(json.dumps(row), flush=True)
            doc["rows"].append(row)
            if args.json:
                runs.write_json(args.json, doc)
    return 0
