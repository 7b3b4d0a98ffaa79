"""Where the GPU waits during the EAGLE loop: inside a graph, between launches.

Profiles ``--iters`` back-to-back launches of the engine's captured iteration
((a) in ``eagle_bench.py``), and with ``--decode`` of the plain decode step
((c)), under ``torch.profiler`` with CPU and CUDA activity, exports the
chrome trace and splits the span of GPU activity (`breakdown`):

* ``busy``: the union of the kernel, memcpy and memset intervals;
* ``idle_in_graph``: gaps between consecutive GPU ops of one
  ``cudaGraphLaunch`` (the same correlation id): dependencies and launch
  latency inside the graph, which only fusing kernels removes;
* ``idle_between_launches``: every other gap (the host launching the next
  graph, host work between iterations, an eager op).

It also sums kernel time per category (GEMM, attention, Triton, copies,
other) and lists the largest gaps with the ops on both sides. Scripted
acceptance (``eagle_bench``'s), one bucket per engine, inductor + CUDA graph
(the engine's CUDA default), ``llama3-8b`` shapes, context 1024.

    python3 benchmarks/idle_breakdown.py --configs 2,8,5,16 --batches 1 8 --decode \\
        --json benchmarks/results/idle_h200.json

``--no-fa3-plans``: the target's FA3 calls each plan for themselves
(``LlamaTarget.share_fa3_plans=False``), the A/B of the shared plans.

Needs CUDA (exit 2 without it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
import time

import torch

from fa3_spec.eagle import DEFAULT_SCRIPT, EagleEngine, make_models

import timing
from loop_setup import loop_config, random_prompts

#: Chrome-trace categories of GPU work.
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
#: Kernel-name patterns of the categories, tried in order (else "other").
CATEGORIES = (
    ("attention", re.compile(r"flash|fmha|FlashAttn", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|sm90_", re.I)),
    ("triton", re.compile(r"^triton_")),
    # the K/V writes: index_copy_, or fa3_spec's fused store_kv kernel
    ("copy", re.compile(r"memcpy|memset|copy|store_kv", re.I)),
)


def category(event: dict) -> str:
    """The category of one GPU op of a chrome trace."""
    if event.get("cat") in ("gpu_memcpy", "gpu_memset"):
        return "copy"
    name = event.get("name", "")
    return next((label for label, pattern in CATEGORIES if pattern.search(name)), "other")


#: The first name among one level's template arguments (numbers skipped).
_TEMPLATE_HEAD = re.compile(r"<\s*(?:-?\d+[A-Za-z]*\s*,\s*)*([A-Za-z_][\w:]*)")


def kernel_name(name: str, width: int = 96, depth: int = 3) -> str:
    """A kernel's name with only the first ``depth`` levels of its leading
    template names, cut to ``width`` (cuBLAS/CUTLASS and FA3 names run to
    thousands of characters, and FA3's attention and combine kernels are both
    ``cutlass::device_kernel<...>``, told apart only by their arguments).

        >>> kernel_name("void cutlass::device_kernel<flash::FlashAttnFwdSm90<Shape<_64>, true>>(P)")
        'void cutlass::device_kernel<flash::FlashAttnFwdSm90<Shape<_64>>>'
    """
    head = name.replace("(anonymous namespace)::", "").split("(", 1)[0]
    base = head.split("<", 1)[0].strip() or name
    levels, rest = [], head[len(head.split("<", 1)[0]):]
    while len(levels) < depth:
        m = _TEMPLATE_HEAD.match(rest)
        if not m:
            break
        levels.append(m.group(1))
        rest = rest[m.end():]
        if not rest.startswith("<"):
            break
    out = base + "".join("<" + lv for lv in levels) + ">" * len(levels)
    return out[:width]


def breakdown(events: list, top: int = 8, top_kernels: int = 30) -> dict:
    """Split the span of GPU activity of chrome-trace ``events`` (µs).

    Returns ``span_us``, ``busy_us``, ``idle_in_graph_us``,
    ``idle_between_launches_us``, their fractions of the span (``*_frac``,
    busy + both idles = 1), ``ops``, ``graph_launches``, ``by_category_us``
    (kernel time, overlaps counted in each op), ``largest_gaps`` (the
    ``top`` largest, each with its kind and the ops before and after it) and
    ``kernels`` (the ``top_kernels`` names with the most time, each with its
    ``count`` and ``total_us``; names as `kernel_name` shortens them).

        >>> ev = [dict(cat="cuda_runtime", name="cudaGraphLaunch", args=dict(correlation=1)),
        ...       dict(cat="kernel", name="nvjet_a", ts=0, dur=10, args=dict(correlation=1)),
        ...       dict(cat="kernel", name="triton_b", ts=12, dur=3, args=dict(correlation=1)),
        ...       dict(cat="kernel", name="flash_c", ts=20, dur=5, args=dict(correlation=2))]
        >>> r = breakdown(ev)
        >>> r["busy_us"], r["idle_in_graph_us"], r["idle_between_launches_us"]
        (18.0, 2.0, 5.0)
    """
    launches = {e["args"]["correlation"]: e.get("name", "")
                for e in events if e.get("cat") == "cuda_runtime"
                and "correlation" in e.get("args", {})}
    ops = sorted((e for e in events if e.get("cat") in GPU_CATS and e.get("dur", 0) > 0),
                 key=lambda e: (e["ts"], e["ts"] + e["dur"]))
    by_cat: dict = {}
    by_name: dict = {}
    for e in ops:
        label = category(e)
        by_cat[label] = by_cat.get(label, 0.0) + float(e["dur"])
        entry = by_name.setdefault((label, kernel_name(e.get("name", ""))), [0, 0.0])
        entry[0] += 1
        entry[1] += float(e["dur"])
    kernels = [dict(name=name, category=label, count=n, total_us=round(t, 2))
               for (label, name), (n, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])]
    if not ops:
        return dict(span_us=0.0, busy_us=0.0, idle_in_graph_us=0.0, idle_between_launches_us=0.0,
                    busy_frac=0.0, idle_in_graph_frac=0.0, idle_between_launches_frac=0.0,
                    ops=0, graph_launches=0, by_category_us={}, largest_gaps=[], kernels=[])
    busy = in_graph = between = 0.0
    gaps = []
    last = ops[0]  # the op that ends the merged interval so far
    start, end = float(ops[0]["ts"]), float(ops[0]["ts"] + ops[0]["dur"])
    for e in ops[1:]:
        s, t = float(e["ts"]), float(e["ts"] + e["dur"])
        if s > end:
            busy += end - start
            gap = s - end
            corr = e.get("args", {}).get("correlation")
            same = corr is not None and corr == last.get("args", {}).get("correlation")
            kind = "in_graph" if same and launches.get(corr) == "cudaGraphLaunch" else "between"
            if kind == "in_graph":
                in_graph += gap
            else:
                between += gap
            gaps.append(dict(gap_us=round(gap, 2), kind=kind, before=last.get("name", ""),
                             after=e.get("name", "")))
            start, end, last = s, t, e
        elif t > end:
            end, last = t, e
    busy += end - start
    span = end - float(ops[0]["ts"])  # end: the latest end of any op
    gaps.sort(key=lambda g: -g["gap_us"])
    frac = (lambda x: round(x / span, 4)) if span > 0 else (lambda x: 0.0)
    graph_corrs = {e.get("args", {}).get("correlation") for e in ops} & {
        c for c, name in launches.items() if name == "cudaGraphLaunch"}
    return dict(span_us=round(span, 2), busy_us=round(busy, 2), idle_in_graph_us=round(in_graph, 2),
                idle_between_launches_us=round(between, 2), busy_frac=frac(busy),
                idle_in_graph_frac=frac(in_graph), idle_between_launches_frac=frac(between),
                ops=len(ops), graph_launches=len(graph_corrs),
                by_category_us={k: round(v, 2) for k, v in sorted(by_cat.items())},
                largest_gaps=gaps[:top], kernels=kernels[:top_kernels])


def profile_events(fn, iters: int, cpu: bool = True) -> list:
    """Chrome-trace events of ``iters`` back-to-back ``fn()`` calls. Without
    ``cpu`` only GPU activity is recorded (less host overhead; no launch
    correlations, so every gap counts as between launches)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cpu else [ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            return json.load(fh)["traceEvents"]


def engine_for(models, cfg, batch: int, context: int, iters: int) -> EagleEngine:
    """One captured bucket of ``batch`` requests of ``context`` tokens, admitted."""
    max_new = (iters + 8) * max(DEFAULT_SCRIPT) + 8
    lc = loop_config(cfg, batch=batch, context=context, max_new=max_new, scripted=DEFAULT_SCRIPT)
    eng = EagleEngine(lc, models, max_reqs=batch, buckets=[batch], device="cuda")
    eng.capture()
    for prompt in random_prompts(batch, context, models.vocab_size, seed=batch):
        eng.submit(prompt, max_new)
    eng.admit()
    return eng


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--configs", nargs="+", default=["2,8,5,16"], help="P,topk,steps,N")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--no-fa3-plans", dest="fa3_plans", action="store_false",
                    help="each FA3 call plans for itself (LlamaTarget.share_fa3_plans=False), "
                         "for an A/B against the shared plans")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=5, help="launches profiled back to back")
    ap.add_argument("--decode", action="store_true", help="also the plain decode step (c)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    try:
        configs = [tuple(int(x) for x in c.split(",")) for c in args.configs]
        if any(len(c) != 4 for c in configs):
            raise ValueError
    except ValueError:
        print(f"--configs: expected P,topk,steps,N, got {args.configs}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("idle_breakdown.py needs CUDA (it profiles captured graphs)", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from eagle_bench import greedy_segment

    models = make_models(args.preset, draft="random", device="cuda", num_layers=args.num_layers)
    if not args.fa3_plans:
        models = dataclasses.replace(
            models, target=dataclasses.replace(models.target, share_fa3_plans=False))
    command = "python3 benchmarks/idle_breakdown.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    doc = dict(command=command, torch=torch.__version__, device=torch.cuda.get_device_name(),
               preset=args.preset, acceptance="scripted:" + ",".join(map(str, DEFAULT_SCRIPT)),
               share_fa3_plans=args.fa3_plans, rows=[])
    for cfg in configs:
        for batch in args.batches:
            t0 = time.perf_counter()
            eng = engine_for(models, cfg, batch, args.context, args.iters)
            row = dict(config=list(cfg), batch=batch, context=args.context,
                       compile=eng.compile_backend, draft_attention=eng.lc.draft_attention,
                       capture_s=round(time.perf_counter() - t0, 1))
            for _ in range(3):
                eng.launch(batch)
            row["a"] = breakdown(profile_events(lambda: eng.launch(batch), args.iters))
            if args.decode:
                seg, _ = greedy_segment(eng, batch, graphs=True)
                seg.run()
                row["c"] = breakdown(profile_events(seg.run, args.iters))
            doc["rows"].append(row)
            a = row["a"]
            print(f"{cfg} batch {batch}: busy {a['busy_frac']:.3f}, idle in graph "
                  f"{a['idle_in_graph_frac']:.3f}, between launches "
                  f"{a['idle_between_launches_frac']:.3f}; {a['by_category_us']}", flush=True)
            if args.json:
                timing.write_json(args.json, doc)
            del eng
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
