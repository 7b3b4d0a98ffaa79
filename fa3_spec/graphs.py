"""A CUDA-graph runner: one captured step per batch-size bucket.

The runner owns static, batch-major input buffers per bucket. A call checks
each batch tensor against its buffer (trailing shape, dtype, device: the
names the argument otherwise), copies the real batch into the first ``bs``
rows of the smallest bucket that holds it, **zero-fills the rest**, replays,
and returns views of the outputs' live rows. Zero rows are padding rows by
construction (``seq_len == 0`` reads nothing; slot 0 is the reserved dummy
page), so a large batch followed by a small one in the same bucket leaves no
stale row that is read.

Outputs need not be batch-major row for row: at capture the runner learns,
per output tensor, how its leading dimension grows with the batch
(``rows = a * B + c``: ``B`` for per-request rows, ``B * K`` for per-branch
expand rows, ``B + 1`` for ``cu_seqlens``, a constant for flags) and returns
``[: a * bs + c]``. An output whose *other* dimensions grow with the batch
is refused at capture, as is one whose leading dimension is not affine in it.

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
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

from .probes import RecordingBackend, capture

STRATEGIES = ("manual", "reduce-overhead", "eager")


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

    Attributes: ``compiled_step`` (the step as the strategy compiles it; what
    each bucket captures). After `capture`: ``capture_seconds`` per bucket and
    ``compile_counter`` (a `fa3_spec.probes.RecordingBackend`: compiled frames
    and data-dependent ops seen).
    """

    def __init__(self, step: Callable, *, example: Callable[[int], Dict[str, torch.Tensor]],
                 buckets: Sequence[int], strategy: str = "manual", backend: str = "inductor",
                 dynamic_batch: bool = True, warmup: int = 2):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {buckets!r}")
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
        self._out_rows: Optional[List[Tuple[int, int]]] = None  # per output leaf: (a, c)
        self._pool = None
        if strategy == "eager":
            self.compiled_step = step
        elif strategy == "reduce-overhead":
            self.compiled_step = torch.compile(step, fullgraph=True, mode="reduce-overhead")
        else:
            self.compiled_step = torch.compile(step, fullgraph=True, backend=self.compile_counter)

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
                    self.compiled_step(**static)
            if torch.cuda.is_available() and self.strategy != "eager":
                torch.cuda.synchronize()
            self.capture_seconds[bucket] = time.perf_counter() - start
        self._out_rows = self._learn_output_rows()
        return self.capture_seconds

    def _output_shapes(self, bs: int) -> list:
        """Shapes of the step's output leaves for a batch of ``bs``, traced
        with fake tensors (no compute, no writes to engine-owned tensors)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        example = self.example(bs)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = {k: mode.from_tensor(v) for k, v in example.items()}
            out = self.step(**fake)
        return [tuple(t.shape) for t in pytree.tree_leaves(out)]

    def _learn_output_rows(self) -> List[Tuple[int, int]]:
        """Per output leaf ``(a, c)`` with ``rows = a * B + c``; refuse any other layout."""
        # Two batch sizes the step accepts: two buckets, or the only one and one less.
        b0, b1 = self.buckets[:2] if len(self.buckets) > 1 else (self.buckets[0] - 1, self.buckets[0])
        shapes = [self._output_shapes(b) for b in (b0, b1)]
        rows = []
        for i, (s0, s1) in enumerate(zip(*shapes)):
            if len(s0) != len(s1) or s0[1:] != s1[1:]:
                raise ValueError(
                    f"output leaf {i} has shape {s0} at batch {b0} and {s1} at batch "
                    f"{b1}: only its leading dimension may depend on the batch; "
                    "return it batch-major")
            if not s0:
                rows.append((0, 0))  # a scalar: returned whole
                continue
            a, rem = divmod(s1[0] - s0[0], b1 - b0)
            c = s0[0] - a * b0
            if a < 0 or rem:
                raise ValueError(f"output leaf {i} has {s0[0]} rows at batch {b0} and {s1[0]} at "
                                 f"batch {b1}: not a * B + c rows with a >= 0")
            rows.append((a, c))
        for bucket, out in self._outputs.items():  # check the rule on every captured bucket
            for i, (t, (a, c)) in enumerate(zip(pytree.tree_leaves(out), rows)):
                if t.dim() and t.shape[0] != a * bucket + c:
                    raise ValueError(
                        f"output leaf {i} has {t.shape[0]} rows at bucket {bucket}, not "
                        f"{a} * B + {c}: its leading dimension is not affine in the batch")
        return rows

    def _capture_manual(self, bucket: int, static: Dict[str, torch.Tensor]) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        self._graphs[bucket], self._outputs[bucket] = capture(
            self.compiled_step, warmup=self.warmup, pool=self._pool, **static)

    # ----------------------------------------------------------------- replay
    def bucket_for(self, bs: int) -> int:
        for bucket in self.buckets:
            if bucket >= bs:
                return bucket
        raise ValueError(f"batch size {bs} exceeds the largest bucket {self.buckets[-1]}")

    def static_inputs(self, bucket: int) -> Dict[str, torch.Tensor]:
        """The bucket's input buffers (fixed addresses across replays)."""
        return self._static[bucket]

    def _check_batch(self, batch: Dict[str, torch.Tensor], static: Dict[str, torch.Tensor]) -> int:
        """Validate ``batch`` against the bucket's buffers; return ``bs``."""
        if set(batch) != set(static):
            raise ValueError(f"batch must have keys {sorted(static)}, got {sorted(batch)}")
        bs = None
        for name, buf in static.items():
            x = batch[name]
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dtype != buf.dtype:
                raise TypeError(f"{name} must have dtype {buf.dtype} (the captured buffer's), "
                                f"got {x.dtype}")
            if x.dim() != buf.dim() or tuple(x.shape[1:]) != tuple(buf.shape[1:]):
                raise ValueError(f"{name} must have shape [B, {', '.join(map(str, buf.shape[1:]))}]"
                                 f" (the captured buffer's trailing shape), got {tuple(x.shape)}")
            if x.device != buf.device:
                raise ValueError(f"{name} is on {x.device}, the captured buffer on {buf.device}")
            if bs is None:
                bs = x.shape[0]
            elif x.shape[0] != bs:
                raise ValueError(f"batch tensors disagree on the batch size: {name} has "
                                 f"{x.shape[0]} rows, others {bs}")
        return bs

    def __call__(self, **batch: torch.Tensor):
        if not self._static:
            self.capture()
        if not batch:
            raise ValueError("the batch is empty: pass the step's batch tensors")
        first = next(iter(batch.values()))
        bs = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else 0
        bucket = self.bucket_for(bs)
        static = self._static[bucket]
        bs = self._check_batch(batch, static)
        for name, buf in static.items():
            buf[:bs].copy_(batch[name])
            buf[bs:].zero_()  # padding rows: seq_len 0, slot 0
        if self.strategy == "manual":
            self._graphs[bucket].replay()
            out = self._outputs[bucket]
        elif self.strategy == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
            out = pytree.tree_map(torch.clone, self.compiled_step(**static))
        else:
            out = self.compiled_step(**static)
        leaves, spec = pytree.tree_flatten(out)
        live = [t[: a * bs + c] if t.dim() else t for t, (a, c) in zip(leaves, self._out_rows)]
        return pytree.tree_unflatten(live, spec)

    def graph(self, bucket: int) -> torch.cuda.CUDAGraph:
        """The captured graph of ``bucket`` (manual strategy)."""
        return self._graphs[bucket]

    def output_buffers(self, bucket: int) -> Optional[object]:
        """The captured outputs of ``bucket`` (manual strategy)."""
        return self._outputs.get(bucket)
