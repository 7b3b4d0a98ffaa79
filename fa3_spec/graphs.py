"""A CUDA-graph runner: one captured step per batch-size bucket.

The runner owns static, batch-major input buffers per bucket. A call copies
the real batch into the first ``bs`` rows of the smallest bucket that holds
it, **zero-fills the rest**, replays, and returns views of the outputs' first
``bs`` rows. Zero rows are padding rows by construction (``seq_len == 0``
reads nothing; slot 0 is the reserved dummy page), so a large batch followed
by a small one in the same bucket leaves no stale row that is read.

Engine-owned tensors (``req_to_token``, KV caches, weights) are not runner
inputs: the step closes over them and the graph bakes in their addresses.

Two capture strategies:

* ``"manual"`` (recommended): ``torch.compile(step, fullgraph=True)`` once,
  with the batch dimension marked dynamic so all buckets above 1 share one
  compiled graph, then ``torch.cuda.graph`` capture per bucket into one
  shared memory pool. Buffers and outputs have fixed addresses; metadata,
  FA3 and the merge replay with zero host work. Capture is explicit and
  happens once, at start-up.
* ``"reduce-overhead"``: ``torch.compile(mode="reduce-overhead")`` and let
  CUDA-graph trees record each bucket on first use. Less code, but recording
  happens lazily on the serving path, and outputs are overwritten by the next
  replay (the runner clones them).
* ``"eager"``: no compile, no graph: the same padding logic, for CPU tests.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.utils._pytree as pytree

STRATEGIES = ("manual", "reduce-overhead", "eager")


def capture(fn: Callable, *args, warmup: int = 2, pool=None, **kwargs):
    """Warm ``fn(*args, **kwargs)`` up on a side stream, then capture one call.

    Returns ``(graph, out)``: replaying ``graph`` recomputes ``out`` in place
    from the same input buffers. ``pool`` shares a memory pool between graphs.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn(*args, **kwargs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn(*args, **kwargs)
    return graph, out


class CUDAGraphRunner:
    """Capture ``step(**batch)`` per bucket; replay it with fresh batches.

    Args:
        step: ``step(**batch) -> pytree of tensors``; every batch tensor and
            every output tensor has the batch as dimension 0.
        example: ``example(bs) -> dict`` of batch tensors for a batch of
            ``bs`` (values do not matter; shapes, dtypes and device do).
        buckets: batch sizes to capture (a call with ``bs`` uses the
            smallest bucket ``>= bs``).
        strategy: ``"manual"``, ``"reduce-overhead"`` or ``"eager"``.
        backend: ``torch.compile`` backend (``"inductor"`` on GPU).
        dynamic_batch: mark the batch dimension dynamic so buckets share a
            compiled graph (``"manual"``).
        warmup: eager-compiled runs before each capture.

    Attributes (after `capture`): ``capture_seconds`` per bucket and
    ``compile_counter`` (a `fa3_spec.audit.RecordingBackend`: compiled frames
    and data-dependent ops seen).
    """

    def __init__(self, step: Callable, *, example: Callable[[int], Dict[str, torch.Tensor]],
                 buckets: Sequence[int], strategy: str = "manual", backend: str = "inductor",
                 dynamic_batch: bool = True, warmup: int = 2):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {buckets!r}")
        from .audit import RecordingBackend

        self.step = step
        self.example = example
        self.buckets = sorted(set(buckets))
        self.strategy = strategy
        self.dynamic_batch = dynamic_batch
        self.warmup = warmup
        self.compile_counter = RecordingBackend(backend)
        self.capture_seconds: Dict[int, float] = {}
        self._static: Dict[int, Dict[str, torch.Tensor]] = {}
        self._outputs: Dict[int, object] = {}
        self._graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        if strategy == "eager":
            self._fn = step
        elif strategy == "reduce-overhead":
            self._fn = torch.compile(step, fullgraph=True, mode="reduce-overhead")
        else:
            self._fn = torch.compile(step, fullgraph=True, backend=self.compile_counter)

    # ---------------------------------------------------------------- capture
    def capture(self) -> Dict[int, float]:
        """Allocate buffers and capture every bucket (largest first)."""
        for bucket in reversed(self.buckets):
            start = time.perf_counter()
            static = {k: v.clone() for k, v in self.example(bucket).items()}
            self._static[bucket] = static
            if self.strategy == "manual":
                if self.dynamic_batch:
                    for t in static.values():
                        torch._dynamo.maybe_mark_dynamic(t, 0)
                self._capture_manual(bucket, static)
            elif self.strategy == "reduce-overhead":
                for _ in range(max(self.warmup, 2)):  # cudagraph trees record on the 2nd+ call
                    torch.compiler.cudagraph_mark_step_begin()
                    self._fn(**static)
            if torch.cuda.is_available() and self.strategy != "eager":
                torch.cuda.synchronize()
            self.capture_seconds[bucket] = time.perf_counter() - start
        return self.capture_seconds

    def _capture_manual(self, bucket: int, static: Dict[str, torch.Tensor]) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        self._graphs[bucket], self._outputs[bucket] = capture(
            self._fn, warmup=self.warmup, pool=self._pool, **static)

    # ----------------------------------------------------------------- replay
    def bucket_for(self, bs: int) -> int:
        for bucket in self.buckets:
            if bucket >= bs:
                return bucket
        raise ValueError(f"batch size {bs} exceeds the largest bucket {self.buckets[-1]}")

    def static_inputs(self, bucket: int) -> Dict[str, torch.Tensor]:
        """The bucket's input buffers (fixed addresses across replays)."""
        return self._static[bucket]

    def __call__(self, **batch: torch.Tensor):
        if not self._static:
            self.capture()
        sizes = {t.shape[0] for t in batch.values()}
        if len(sizes) != 1:
            raise ValueError(f"batch tensors disagree on the batch size: {sorted(sizes)}")
        bs = sizes.pop()
        bucket = self.bucket_for(bs)
        static = self._static[bucket]
        if set(batch) != set(static):
            raise ValueError(f"batch must have keys {sorted(static)}, got {sorted(batch)}")
        for name, buf in static.items():
            buf[:bs].copy_(batch[name])
            buf[bs:].zero_()  # padding rows: seq_len 0, slot 0
        if self.strategy == "manual":
            self._graphs[bucket].replay()
            out = self._outputs[bucket]
        elif self.strategy == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
            out = pytree.tree_map(torch.clone, self._fn(**static))
        else:
            out = self._fn(**static)
        return pytree.tree_map(lambda t: t[:bs], out)

    def graph(self, bucket: int) -> torch.cuda.CUDAGraph:
        """The captured graph of ``bucket`` (manual strategy)."""
        return self._graphs[bucket]

    def output_buffers(self, bucket: int) -> Optional[object]:
        """The captured outputs of ``bucket`` (manual strategy)."""
        return self._outputs.get(bucket)
