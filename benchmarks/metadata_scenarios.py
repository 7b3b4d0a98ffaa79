"""Metadata cost, the draft loop and verify: fa3_spec against the
upstream-style host path, over named scenarios (CUDA + FA3; ``--smoke`` is a
tiny CPU run of every code path).

Per scenario point (config x batch), in one process:

metadata (one draft iteration: every draft step + verify + extend)
  a  upstream-style: `UpstreamStyleBuilder` (host-synced, in-place buffers,
     prefix rebuilt every step); wall time per iteration, synced at the end.
  b  fa3_spec: the iteration's builders in one compiled function
     (`build_draft_iteration_metadata` + verify + extend), launched eagerly.
  c  the same function captured in one CUDA graph; replay launch and device
     time (CUDA events); kernels of (b) per iteration.

draft_loop (all draft steps of one iteration, 1 attention layer, FA3)
  a  upstream: sglang 0.5.23's own per-step replay metadata when it loads
     (``upstream_baseline``), else the upstream-style model, filled on the
     host before each step's captured attention graph.
  b  fa3_spec: one captured graph, metadata inside (`CUDAGraphRunner`).
  c  floor: one captured graph of the same attention with precomputed metadata.
  Metadata kernels per step = (kernels of b - kernels of c) / draft steps.

verify (the target's verify pass over ``--layers`` layers, default 32): the
  same three ways (a: the model's host metadata into a captured verify graph).

compile: ``compile.py runner`` in a subprocess (cold inductor cache).

All times are medians of ``--iters`` runs after warm-up, with the
interquartile range; report ratios within a run, not absolute numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time

import torch

import fa3_spec
from fa3_spec import builders
from fa3_spec.attention import provider_version
from fa3_spec.graphs import CompilePolicy, CUDAGraphRunner, capture, compile_fullgraph
from fa3_spec.harness.toy import ToyModel, example_batch, make_step, verify_slots, world_batch
from fa3_spec.harness.worlds import make_world
from fa3_spec.harness.upstream import UpstreamStyleBuilder
from fa3_spec.tree import flat_from_tree_mask

import runs
import timing
from metadata_staging import staging_row

PROG = "metadata.py scenarios"
HELP = "metadata, draft loop and verify against the upstream-style path, per scenario"

# name: (batches, contexts, [(num_steps, topk, num_draft_tokens)], page sizes)
SCENARIOS = {
    "seed": ([1, 8, 32], [4096], [(5, 8, 16)], [2]),
    "latency": ([1], [4096], [(5, 4, 8)], [1, 16]),
    "wide-tree": ([4], [4096], [(5, 8, 32)], [1, 2]),
    "page-sweep": ([8], [8192], [(5, 4, 8)], [1, 2, 16, 64, 128]),
    "throughput": ([64], [4096], [(5, 4, 8), (3, 1, 4)], [16]),
    "long-context": ([16], [32768], [(5, 4, 8)], [1, 64]),
    # Scaling curves around the "seed" scenario (P = 2, topk = 8, 5 steps).
    # With "seed" they give batch 1..256, context 1K..128K and topk 1..10.
    "scale-batch": ([4, 16, 64, 256], [4096], [(5, 8, 16)], [2]),
    "scale-context": ([8], [1024, 16384, 131072], [(5, 8, 16)], [2]),
    "scale-topk": ([8], [4096], [(5, k, 16) for k in (1, 4, 10)], [2]),
}
#: The default scenarios (the scaling ones add points around "seed").
TABLE = ("seed", "latency", "wide-tree", "page-sweep", "throughput", "long-context")
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B


def _wall(fn, iters, device):
    return timing.wall_us(fn, iters, timing.synchronizer(device))


def _kernels(fn):
    return len(_kernel_names(fn))


def _kernel_names(fn):
    """Names of the kernels one call of ``fn`` launches (profiler, after a warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _print_profile(label, fn, top=12):
    """Kernel-level breakdown of one call (CUDA-graph kernels included)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"--- profile: {label}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60))


def _three_way(row, upstream, ours_graph, floor_graph, iters, device):
    """Time upstream-style vs fa3_spec's graph vs the floor's graph into ``row``."""
    row["upstream_us"], row["upstream_iqr_us"] = _wall(upstream, iters, device)
    row["fa3_spec_us"], row["fa3_spec_iqr_us"] = _wall(ours_graph.replay, iters, device)
    row["floor_us"], row["floor_iqr_us"] = _wall(floor_graph.replay, iters, device)
    _, (row["fa3_spec_device_us"], _) = timing.event_us(ours_graph.replay, iters)
    _, (row["floor_device_us"], _) = timing.event_us(floor_graph.replay, iters)
    row["upstream_over_fa3_spec"] = round(row["upstream_us"] / row["fa3_spec_us"], 2)
    row["fa3_spec_over_floor_minus_1"] = round(row["fa3_spec_device_us"] / row["floor_device_us"] - 1, 4)


def metadata_row(cfg, world, bs, args):
    """One draft iteration's metadata: upstream-style host path vs one compiled function vs its graph."""
    device, iters = args.device, args.iters
    tree = cfg.topk > 1
    batch = world.batch()
    flat = flat_from_tree_mask(world.tree_mask, world.seq_lens) if tree else None
    ref = UpstreamStyleBuilder(cfg, device)
    steps = range(cfg.num_steps - 1)

    def upstream():
        for step in steps:
            ref.draft_decode(step, **batch, out_cache_loc=world.out_cache_loc)
        ref.target_verify(**batch, custom_mask=flat)
        ref.draft_extend(**batch, extend_seq_lens=world.extend_seq_lens)

    compile_backend = args.compile_backend
    mask = world.tree_mask if tree else None
    loc = world.out_cache_loc

    def draft_metadata(**kw):
        return builders.build_draft_iteration_metadata(cfg, **kw, out_cache_loc=loc)

    def iteration_metadata(**kw):
        return (draft_metadata(**kw),
                builders.build_target_verify_metadata(cfg, **kw, tree_mask=mask),
                builders.build_draft_extend_metadata(cfg, **kw, extend_seq_lens=world.extend_seq_lens))

    ours_c = compile_fullgraph(iteration_metadata, compile_backend=compile_backend)

    def ours():
        return ours_c(**batch)

    row = dict(kind="metadata", page_size=cfg.page_size, topk=cfg.topk, num_steps=cfg.num_steps,
               num_draft_tokens=cfg.num_draft_tokens, batch=bs, context=cfg.max_context_len,
               upstream_baseline="model")
    row["upstream_host_us"], row["upstream_host_iqr_us"] = _wall(upstream, iters, device)
    row["compiled_eager_host_us"], row["compiled_eager_host_iqr_us"] = _wall(ours, iters, device)
    if device == "cuda":
        graph, _ = capture(ours)
        (row["graph_launch_us"], row["graph_launch_iqr_us"]), (row["graph_device_us"], row["graph_device_iqr_us"]) = timing.event_us(graph.replay, iters)
        row["upstream_over_graph_device"] = round(row["upstream_host_us"] / row["graph_device_us"], 1)
        row["kernels_per_iteration"] = _kernels(ours)
    return row


def _loop_setup(mode, cfg, world, bs, args, *, layers=1):
    """(model, attention backend, hidden, batch, kw, runner) of a one-graph ``mode`` step.

    The toy model (Llama-3-8B heads on CUDA, tiny on CPU), the step's batch
    from ``world`` and a `CUDAGraphRunner` over the single bucket ``bs`` whose
    static inputs already hold the batch.
    """
    device = args.device
    heads = (HEADS, KV_HEADS, HEAD_DIM) if device == "cuda" else (4, 2, 16)
    model = ToyModel.create(layers=layers, num_pages=world.num_pages, page_size=cfg.page_size,
                            num_heads=heads[0], num_kv_heads=heads[1], head_dim=heads[2],
                            dtype=torch.bfloat16, device=device)
    attention_backend = "fa3" if device == "cuda" else "torch"
    tree = mode == "target_verify" and cfg.topk > 1
    rows = cfg.topk if mode == "draft_decode" else cfg.num_draft_tokens
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(bs, rows, model.hidden, device=device, generator=g).bfloat16()
    batch = world_batch(mode, world, hidden, tree=tree)
    step = make_step(mode, cfg, model, world.req_to_token, attention_backend=attention_backend,
                     tree=tree)
    policy = CompilePolicy(compile_backend=args.compile_backend) if device == "cuda" else CompilePolicy.eager()
    runner = CUDAGraphRunner(step, buckets=[bs], policy=policy,
                             example=lambda b: example_batch(mode, cfg, model, b, device=device,
                                                             tree=tree))
    runner.capture()
    for name, buf in runner.static_inputs(bs).items():
        buf.copy_(batch[name])
    return model, attention_backend, hidden, batch, world.batch(), runner


def sglang_draft_steps(upstream, cfg, world, bs):
    """sglang 0.5.23's own replay-metadata call per draft step, or None.

    ``upstream`` is `fa3_spec.harness.sglang_upstream.load_upstream_or_reason`'s
    object; each returned callable fills that step backend's CUDA-graph
    buffers in place, as sglang's runner does before each replay.
    """
    if upstream is None:
        return None
    from fa3_spec.integrations.sglang import SglangConfig

    scfg = SglangConfig(page_size=cfg.page_size, topk=cfg.topk, num_steps=cfg.num_steps,
                        num_draft_tokens=cfg.num_draft_tokens, max_bs=bs,
                        context_len=cfg.max_context_len)
    backends = upstream.draft_backends(scfg, world.req_to_token)
    kw = dict(req_pool_indices=world.req_pool_indices, seq_lens=world.seq_lens,
              out_cache_loc=world.out_cache_loc.reshape(-1))
    return [lambda b=b: b.draft_decode(**kw) for b in backends]


def draft_loop_row(cfg, world, bs, args):
    """All draft steps of one iteration, 1 layer: upstream vs one graph vs floor.

    The upstream column runs sglang 0.5.23's own per-step replay metadata
    (``upstream_baseline: "sglang-0.5.23"``) when ``args.upstream`` holds it,
    else the project's `UpstreamStyleBuilder` model (``"model"``). With
    sglang, each step's attention graph reads this library's metadata of that
    step, which the adapter tests show bitwise equal to the buffers sglang
    fills: the attention work is the same, the metadata cost is sglang's.
    """
    device, iters = args.device, args.iters
    model, attention_backend, hidden, batch, kw, runner = _loop_setup("draft_decode", cfg, world,
                                                                      bs, args)
    loc = batch["out_cache_loc"].reshape(bs * cfg.topk, cfg.num_steps)

    def attend_with(md):
        return lambda q, k, v: fa3_spec.cascade_attention(q, k, v, md,
                                                          attention_backend=attention_backend)

    # c: floor, same attention with precomputed metadata.
    prefix = (builders.build_draft_prefix_metadata(cfg, **kw, draft_attention="branch")
              if cfg.topk > 1 else None)
    mds = [builders.build_draft_decode_metadata(cfg, s, draft_attention="branch", **kw,
                                                out_cache_loc=loc, prefix=prefix)
           for s in range(cfg.num_steps - 1)]
    tails = fa3_spec.draft_tail_copy_slots(cfg, seq_lens=world.seq_lens, out_cache_loc=loc)

    def floor_fn():  # returns what the step returns: every step's output, stacked
        model.copy_slots(*tails)
        x = hidden.reshape(bs * cfg.topk, -1)
        outs = []
        for s, md in enumerate(mds):
            x = model.forward(x, loc[:, s], attend_with(md))
            outs.append(x)
        return torch.stack(outs, dim=1)

    floor_c = compile_fullgraph(floor_fn, compile_backend=args.compile_backend)

    # a: host metadata per step, then per-step attention graphs reading it.
    ref = UpstreamStyleBuilder(cfg, device)
    sglang_steps, why = None, "sglang 0.5.23 not loaded"
    try:
        sglang_steps = sglang_draft_steps(getattr(args, "upstream", None), cfg, world, bs)
        if sglang_steps is not None:
            for fill in sglang_steps:  # run once: sglang's code accepts this world
                fill()
    except Exception as e:  # noqa: BLE001 -- the labelled fallback, with the reason
        sglang_steps, why = None, f"{type(e).__name__}: {e}"
    if sglang_steps is None:
        static_mds = [ref.draft_decode(s, **kw, out_cache_loc=loc) for s in range(cfg.num_steps - 1)]
    else:
        static_mds = mds
    x_static = [hidden.reshape(bs * cfg.topk, -1).clone() for _ in static_mds]

    def attn_step(s):
        def fn():
            if s == 0:
                model.copy_slots(*tails)
            return model.forward(x_static[s], loc[:, s], attend_with(static_mds[s]))
        return fn

    row = dict(kind="draft_loop", page_size=cfg.page_size, topk=cfg.topk, num_steps=cfg.num_steps,
               batch=bs, context=cfg.max_context_len, layers=1,
               upstream_baseline="model" if sglang_steps is None else "sglang-0.5.23")
    if sglang_steps is None:
        row["upstream_baseline_why"] = why
    if device == "cuda":
        graphs = [capture(attn_step(s)) for s in range(len(static_mds))]

        def upstream_loop():
            for s, (graph, out) in enumerate(graphs):
                if sglang_steps is None:
                    timing.copy_leaves(static_mds[s], ref.draft_decode(s, **kw, out_cache_loc=loc))
                else:
                    sglang_steps[s]()
                graph.replay()
                if s + 1 < len(graphs):
                    x_static[s + 1].copy_(out)

        floor_graph, _ = capture(floor_c)
        _three_way(row, upstream_loop, runner.graph(bs), floor_graph, iters, device)
        if args.profile:
            _print_profile("upstream-style loop", upstream_loop)
            _print_profile("floor graph", floor_graph.replay)
        static = runner.static_inputs(bs)
        loop_names = _kernel_names(lambda: runner.compiled_step(**static))
        floor_names = _kernel_names(floor_c)
        row["fa3_spec_kernels"], row["floor_kernels"] = len(loop_names), len(floor_names)
        if getattr(args, "kernel_names", False):
            row["fa3_spec_kernel_names"] = [n[:100] for n in loop_names]
            row["floor_kernel_names"] = [n[:100] for n in floor_names]
        row["metadata_kernels_per_step"] = round(
            (row["fa3_spec_kernels"] - row["floor_kernels"]) / (cfg.num_steps - 1), 2)
    else:
        row["fa3_spec_us"], row["fa3_spec_iqr_us"] = _wall(lambda: runner(**batch), iters, device)
        row["floor_us"], row["floor_iqr_us"] = _wall(floor_c, iters, device)
    staging = staging_row(runner, batch, bs, iters, device)
    row["runner_staging_us"] = staging["runner_staging_us"]
    row["zero_copy_staging_us"] = staging.get("zero_copy_staging_us")
    return row


def verify_row(cfg, world, bs, args):
    """Target verify over ``args.layers`` layers: upstream-style vs one graph vs floor.

    a  upstream-style: host metadata (tree verify cut from the flat custom
       mask, given ready-made) copied into the static buffers of a captured
       verify graph, replayed.
    b  fa3_spec: the whole verify step (metadata inside) in one graph.
    c  floor: the same layers with metadata and KV slots precomputed.
    """
    device, iters = args.device, args.iters
    layers = args.layers if device == "cuda" else 2
    tree = cfg.topk > 1
    n = cfg.num_draft_tokens
    model, attention_backend, hidden, batch, kw, runner = _loop_setup("target_verify", cfg, world,
                                                                      bs,
                                                                 args, layers=layers)
    mask = world.tree_mask if tree else None

    slots = verify_slots(cfg, **kw)
    x_flat = hidden.reshape(bs * n, model.hidden)

    def forward_with(md):
        return lambda: model.forward(
            x_flat, slots, lambda q, k, v: fa3_spec.cascade_attention(q, k, v, md,
                                                                      attention_backend=attention_backend))

    md = builders.build_target_verify_metadata(cfg, **kw, tree_mask=mask)
    floor_c = compile_fullgraph(forward_with(md), compile_backend=args.compile_backend)
    ref = UpstreamStyleBuilder(cfg, device)
    flat = flat_from_tree_mask(world.tree_mask, world.seq_lens) if tree else None
    static_md = ref.target_verify(**kw, custom_mask=flat)
    upstream_c = compile_fullgraph(forward_with(static_md), compile_backend=args.compile_backend)

    row = dict(kind="verify", page_size=cfg.page_size, topk=cfg.topk, num_steps=cfg.num_steps,
               num_draft_tokens=n, batch=bs, context=cfg.max_context_len, layers=layers,
               upstream_baseline="model")
    if device != "cuda":
        row["fa3_spec_us"], row["fa3_spec_iqr_us"] = _wall(lambda: runner(**batch), iters, device)
        row["floor_us"], row["floor_iqr_us"] = _wall(floor_c, iters, device)
        return row
    up_graph, _ = capture(upstream_c)

    def upstream():
        timing.copy_leaves(static_md, ref.target_verify(**kw, custom_mask=flat))
        up_graph.replay()

    floor_graph, _ = capture(floor_c)
    _three_way(row, upstream, runner.graph(bs), floor_graph, iters, device)
    return row


KINDS = {"metadata": metadata_row, "draft_loop": draft_loop_row, "verify": verify_row}


def load_sglang(args):
    """sglang 0.5.23's metadata code for the upstream column, or None (reason printed)."""
    if args.upstream == "model":
        return None
    from fa3_spec.harness.sglang_upstream import load_upstream_or_reason

    upstream, why = load_upstream_or_reason(device=args.device, fetch=not args.smoke,
                                            compile_expand=not args.smoke)
    if upstream is None:
        print(f"upstream column: the model (sglang 0.5.23 unavailable: {why})", file=sys.stderr)
    return upstream


def points(names, smoke, args_batches=None):
    """``(scenario, SpecConfig, batch)`` of every point of ``names`` (one tiny point with ``smoke``)."""
    if smoke:
        yield "smoke", fa3_spec.SpecConfig(page_size=2, topk=4, num_steps=3, num_draft_tokens=4,
                                           max_bs=2, max_context_len=64), 2
        return
    for name in names:
        batches, contexts, shapes, page_sizes = SCENARIOS[name]
        for context in contexts:
            for steps, topk, n in shapes:
                for p in page_sizes:
                    for bs in (args_batches or batches):
                        yield name, fa3_spec.SpecConfig(page_size=p, topk=topk, num_steps=steps,
                                                        num_draft_tokens=n, max_bs=bs,
                                                        max_context_len=context), bs


def _write(path, args, rows):
    runs.write_json(path, dict(device=runs.device_name(args.device), torch=torch.__version__,
                               fa3=provider_version(), command=args.command, rows=rows))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", nargs="+", default=list(TABLE), choices=list(SCENARIOS))
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS) + ["compile"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--layers", type=int, default=32, help="target layers of the verify kind")
    ap.add_argument("--json", help="written after every row, so a cut-off run keeps its rows")
    ap.add_argument("--profile", action="store_true", help="print kernel tables (draft_loop)")
    ap.add_argument("--batches", type=int, nargs="+", help="override scenario batches")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run of every code path")
    ap.add_argument("--upstream", choices=("auto", "model"), default="auto",
                    help="draft_loop's upstream column: sglang 0.5.23's own code when it "
                         "loads (auto; FA3_SPEC_SGLANG_SRC offline), else the model")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    args.command = runs.command_line(PROG, argv)
    args.device = "cpu" if args.smoke else "cuda"
    args.compile_backend = "eager" if args.smoke else "inductor"  # smoke: tracing, no compile
    args.upstream = load_sglang(args)
    if args.smoke:
        args.iters = min(args.iters, 3)
    rows = []
    if "compile" in args.kinds:  # its own process: a cold inductor cache
        cmd = [sys.executable, runs.script("compile.py"), "runner", "--json", "-"] + (
            ["--smoke"] if args.smoke else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows += json.loads(out.strip().splitlines()[-1])["rows"]
        for row in rows:
            print(json.dumps(row), flush=True)
        if args.json:
            _write(args.json, args, rows)
    kinds = [k for k in args.kinds if k != "compile"]
    for name, cfg, bs in points(args.scenarios, args.smoke, args.batches):
        lo = max(1, cfg.max_context_len * 3 // 4)
        g = torch.Generator().manual_seed(bs)
        seqs = torch.randint(lo, cfg.max_context_len + 1, (bs,), generator=g).tolist()
        world = make_world(cfg, bs, seq_lens=seqs, seed=1, device=args.device)
        cfg = dataclasses.replace(cfg, num_pages=world.num_pages)  # page ids clamped into the pool
        for kind in kinds:
            torch._dynamo.reset()
            start = time.perf_counter()
            row = KINDS[kind](cfg, world, bs, args)
            row["scenario"] = name
            row["bench_s"] = round(time.perf_counter() - start, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                _write(args.json, args, rows)
        del world
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return 0
