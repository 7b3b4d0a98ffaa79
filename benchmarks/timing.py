"""Timers shared by the benchmarks (medians in microseconds or milliseconds).

Three times of a call ``fn``, each a median over ``iters`` calls after
``warmup`` calls, the device drained before every timed call (``sync`` is
``torch.cuda.synchronize`` on CUDA, `no_sync` on CPU; `synchronizer` picks it):

* host: the Python call alone, no sync inside the timed region: what the
  call costs the host (launches, staging);
* wall: the call plus ``sync()``: what a caller waits for;
* device: CUDA events recorded around the call (CUDA only).

`replay_ms` times a callable captured as one CUDA graph (device time per call)
and `kernels_per_call` counts the kernels one replay launches. Report ratios
within one run, not absolute numbers across runs.
"""

from __future__ import annotations

import statistics
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


def graph_of(fn, inner: int = 1):
    """``fn`` called ``inner`` times, captured as one CUDA graph after a side-stream warm-up."""
    from fa3_spec.graphs import capture

    graph, _ = capture(lambda: [fn() for _ in range(inner)], warmup=2)
    return graph


def replay_ms(fn, reps: int = 50, inner: int = 1) -> float:
    """Median device ms of one ``fn()`` captured as a CUDA graph (``inner`` calls per graph)."""
    _, device = event_samples(graph_of(fn, inner).replay, reps, warmup=3)
    return statistics.median(device) * 1e3 / inner


def kernels_per_call(fn) -> int:
    """CUDA kernels, copies and memsets one replay of ``fn`` captured as a graph launches."""
    from torch.profiler import ProfilerActivity, profile

    graph = graph_of(fn)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def copy_leaves(static, fresh):
    """Copy ``fresh`` into the captured buffers ``static`` (the same pytree of
    tensors): the host half of a timed host-metadata path."""
    for dst, src in zip(pytree.tree_leaves(static), pytree.tree_leaves(fresh)):
        dst.copy_(src)
