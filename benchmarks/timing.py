"""Timing and results helpers shared by the benchmark scripts.

The scripts run as ``python3 benchmarks/NAME.py`` from the repository root,
with fa3_spec installed; Python puts ``benchmarks/`` first on ``sys.path``,
so ``import timing`` finds this module.

Three times, each a median in microseconds over ``iters`` calls of ``fn``
after ``warmup`` calls, the device drained before every timed call (``sync``
is ``torch.cuda.synchronize`` on CUDA, `no_sync` on CPU; `synchronizer`
picks it):

* host: the Python call alone, no sync inside the timed region: what the
  call costs the host (launches, staging);
* wall: the call plus ``sync()``: what a caller waits for;
* device: CUDA events recorded around the call (CUDA only).

Report ratios within one run, not absolute numbers across runs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time

import torch
import torch.utils._pytree as pytree


def no_sync() -> None:
    """The CPU's ``sync``: nothing to wait for."""


def synchronizer(device):
    """``torch.cuda.synchronize`` for a CUDA ``device``, else `no_sync`."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else no_sync


def samples(fn, iters, sync, *, warmup=0):
    """``(host, wall)``: seconds of each of ``iters`` calls of ``fn``."""
    for _ in range(warmup):
        fn()
    sync()
    host, wall = [], []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        called = time.perf_counter()
        sync()
        host.append(called - start)
        wall.append(time.perf_counter() - start)
    return host, wall


def event_samples(fn, iters, *, warmup=0):
    """``(launch, device)``: seconds of each of ``iters`` calls of ``fn`` on
    the host and between CUDA events recorded around it."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    launch, device = [], []
    for _ in range(iters):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        start = time.perf_counter()
        fn()
        launch.append(time.perf_counter() - start)
        end.record()
        end.synchronize()
        device.append(begin.elapsed_time(end) / 1e3)
    return launch, device


def median_us(seconds):
    """Median of ``seconds`` in µs, rounded to 0.01."""
    return round(statistics.median(seconds) * 1e6, 2)


def median_iqr_us(seconds):
    """``(median, interquartile range)`` of ``seconds`` in µs, rounded to 0.01
    (with fewer than 4 samples the range is max - min)."""
    us = sorted(x * 1e6 for x in seconds)
    q = statistics.quantiles(us, n=4) if len(us) >= 4 else [us[0], us[len(us) // 2], us[-1]]
    return round(statistics.median(us), 2), round(q[2] - q[0], 2)


def host_us(fn, iters, sync, *, warmup=5):
    """Median host time of ``fn`` in µs."""
    return median_us(samples(fn, iters, sync, warmup=warmup)[0])


def wall_us(fn, iters, sync, *, warmup=3):
    """``(median, IQR)`` wall time of ``fn`` in µs."""
    return median_iqr_us(samples(fn, iters, sync, warmup=warmup)[1])


def event_us(fn, iters, *, warmup=3):
    """``((median, IQR) launch, (median, IQR) device)`` of ``fn`` in µs (CUDA)."""
    launch, device = event_samples(fn, iters, warmup=warmup)
    return median_iqr_us(launch), median_iqr_us(device)


def copy_leaves(static, fresh):
    """Copy ``fresh`` into the captured buffers ``static`` (the same pytree of tensors)."""
    for dst, src in zip(pytree.tree_leaves(static), pytree.tree_leaves(fresh)):
        dst.copy_(src)


def fresh_process_row(cmd, inductor_cache_dir: str, what: str) -> dict:
    """Run ``cmd`` (a child benchmark process) with ``inductor_cache_dir`` as
    its inductor cache (a new folder: a cold compile) and return its last
    stdout line parsed as JSON. A child that fails ends this process (exit 1)
    with ``what`` and the tail of the child's stderr."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_cache_dir)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_json(path, doc):
    """Write ``doc`` to ``path`` (its folder made if missing), one-space indent."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
