"""Where a GPU trace's time goes: the span of GPU activity split into busy
time, gaps inside one CUDA-graph launch and gaps between launches, with each
kernel category's and kernel name's total (`breakdown`), from the chrome trace
of a profiled run (`profile_events`).
"""

from __future__ import annotations

import json
import os
import re
import tempfile

import torch

#: Chrome-trace categories of GPU work.
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
#: Kernel-name patterns of the categories, tried in order (else "other").
#: fa3_spec's own kernels by their exact names: inductor names a fused
#: kernel after the ops it feeds, so ``triton_..._skinny_mm_0`` is not a GEMM.
CATEGORIES = (
    ("attention", re.compile(r"flash|fmha|FlashAttn|^expand_attention_kernel$", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|sm90_|^skinny_mm_kernel$"
                        r"|^sum_partials_kernel$", re.I)),
    ("triton", re.compile(r"^triton_")),
    # the K/V writes: index_copy_, or fa3_spec's fused store_kv kernel
    ("copy", re.compile(r"memcpy|memset|copy|store_kv", re.I)),
)


def category(event: dict) -> str:
    """The category of one GPU op of a chrome trace.

        >>> [category(dict(cat="kernel", name=n)) for n in ("skinny_mm_kernel",
        ...  "triton_red_fused_add_rsqrt_skinny_mm_0", "expand_attention_kernel")]
        ['gemm', 'triton', 'attention']
    """
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


def breakdown(events: list, top: int = 8, top_kernels: int | None = 30) -> dict:
    """Split the span of GPU activity of chrome-trace ``events`` (µs).

    Returns ``span_us``, ``busy_us``, ``idle_in_graph_us``,
    ``idle_between_launches_us``, their fractions of the span (``*_frac``,
    busy + both idles = 1), ``ops``, ``graph_launches``, ``by_category_us``
    (kernel time, overlaps counted in each op), ``largest_gaps`` (the
    ``top`` largest, each with its kind and the ops before and after it) and
    ``kernels`` (the ``top_kernels`` names with the most time, all of them where
    it is None, each with its ``count`` and ``total_us``; names as
    `kernel_name` shortens them).

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


def gpu_idle_share(fn, reps: int = 3):
    """Median over ``reps`` runs of 1 - busy / span of GPU activity in one
    ``fn()`` (`breakdown` of a CUDA-only profile), or None when no GPU op ran."""
    shares = []
    for _ in range(reps):
        r = breakdown(profile_events(fn, 1, cpu=False))
        if r["ops"]:
            shares.append(1 - r["busy_us"] / r["span_us"] if r["span_us"] > 0 else 0.0)
    return round(sorted(shares)[len(shares) // 2], 4) if shares else None
