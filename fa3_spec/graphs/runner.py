"""`CUDAGraphRunner`: one captured step per batch-size bucket.

The runner owns static, batch-major input buffers per bucket. A call checks
each batch tensor against its buffer (trailing shape, dtype, device: the
error names the argument), copies the real batch into the first ``bs`` rows
of the smallest bucket that holds it, keeps the rest **zero**, replays, and
returns views of the outputs' live rows. Zero rows are padding rows by
construction (``seq_len == 0`` reads nothing; slot 0 is the reserved dummy
page), so a large batch followed by a small one in the same bucket leaves no
stale row that is read.

Host cost per call (the "staging" between the engine and ``replay()``):

* the checks run **once per shape signature** (`_signature`): they read only
  the keys, each value's type, dtype, shape and device, all of which are in
  the signature, against buffers fixed at capture; a signature that passed
  once passes again, so later calls with it skip them (`_route`);
* all live rows move with **one** ``torch._foreach_copy_`` over byte views
  of every (buffer, input) pair: its multi-tensor path is one launch on
  CUDA but needs one dtype across the list, and a list of mixed dtypes falls
  back to one ``copy_`` per input (inputs whose last dimension is strided
  are copied with one call per dtype instead);
* zero-filling is skipped when the bucket's previous call had ``<= bs`` live
  rows: the runner tracks, per bucket, the high-water mark of rows that may
  be non-zero and zeroes only ``[bs, mark)`` (the step must not write its
  batch inputs; none of the library's steps does);
* the live output views (manual strategy) are built once per ``(bucket, bs)``.

Zero-copy: an engine may write ``runner.static_inputs(bucket)[name][:bs]``
itself (rows ``[:bs]`` only) and call ``runner.replay(bucket, bs)``, which
skips the checks and the copies and keeps the zero-fill rule above.

Outputs need not be batch-major row for row: at capture the runner learns,
per output tensor, how its leading dimension grows with the batch
(``rows = a * B + c``: ``B`` for per-request rows, ``B * K`` for per-branch
expand rows, ``B + 1`` for ``cu_seqlens``, a constant for flags) and returns
``[: max(a * bs + c, 0)]``. An output whose *other* dimensions grow with the batch
is refused at capture, as is one whose leading dimension is not affine in it.

Engine-owned tensors (``req_to_token``, KV caches, weights) are not runner
inputs: the step closes over them and the graph bakes in their addresses.

How the step is compiled and captured is one `fa3_spec.graphs.CompilePolicy`:

* graphs (the default, inductor): ``torch.compile(step, fullgraph=True)``
  once, with the batch dimension marked dynamic so that the buckets above 1
  share one compiled graph, then ``torch.cuda.graph`` capture per bucket into
  one shared memory pool. Buffers and outputs have fixed addresses;
  metadata, FA3 and the merge replay with zero host work. Capture is
  explicit and happens once, at start-up. With ``compile_backend=None`` the
  step is captured uncompiled (for debugging a compiled step);
* `CompilePolicy.compiled`: compiled and called directly (no graph), what a
  CPU test of a compiled step needs;
* `CompilePolicy.eager`: no compile, no graph: the same padding logic.

Caller-owned buffers (``buffers=``): an engine whose step updates its own
state in place (the EAGLE loop's `fa3_spec.eagle.step_in_place`) hands the
runner views of one ``max_bs``-row state, ``state[k][:bucket]``, instead of
letting it allocate a copy per bucket: consecutive iterations in different
buckets then share rows with no copy, and the engine keeps the padding rule
(the runner zero-fills nothing). Such a runner is driven by `replay` only.

Capture is all or nothing: `CUDAGraphRunner.capture` builds every bucket
aside and keeps them only when all succeeded, so a failed capture (a step
that raises while warming up, ``"manual"`` without CUDA) leaves the runner as
it was, and the next call raises the same error or captures again.

Cold start: ``cache_path=`` keeps PyTorch's compile caches in one file
(`fa3_spec.graphs.cache`), loaded before the first compile and written after
`capture`.

`capture` (one call warmed up on a side stream, then captured) is the
building block, for any step an engine captures itself.
"""

from __future__ import annotations

import operator
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

from ..probes import RecordingBackend
from .cache import load_compile_cache, save_compile_cache
from .policy import CompilePolicy, bound_batch, mark_batch, size_oblivious


def check_buckets(buckets, largest: Optional[int] = None) -> List[int]:
    """``buckets`` (batch sizes) sorted and deduplicated, checked.

    Each must be an int >= 1 (integer-likes such as numpy or 0-d torch ints
    are taken; bools are not); with ``largest`` (a state of that many rows),
    none may exceed it and the largest must equal it, so every batch the
    state can hold has a bucket.

    Raises:
        TypeError: ``buckets`` is not a sequence of ints.
        ValueError: empty, a size below 1, or (with ``largest``) a size above
            it or none equal to it; the message names ``buckets``.
    """
    def is_bool(b) -> bool:  # operator.index takes these as 0 / 1
        return isinstance(b, bool) or (isinstance(b, torch.Tensor) and b.dtype == torch.bool)
    try:
        if isinstance(buckets, (str, bytes, dict)):
            raise TypeError
        given = list(buckets)
        if any(is_bool(b) for b in given):
            raise TypeError
        values = [operator.index(b) for b in given]
    except TypeError:
        raise TypeError(f"buckets must be a sequence of ints, got {buckets!r}") from None
    if not values:
        raise ValueError("buckets must hold at least one batch size, got none")
    if min(values) < 1:
        raise ValueError(f"buckets must be batch sizes >= 1, got {values!r}")
    if largest is not None and max(values) > largest:
        raise ValueError(f"buckets must not exceed max_bs={largest} (the state's rows), "
                         f"got {values!r}")
    if largest is not None and max(values) != largest:
        raise ValueError(f"the largest bucket must be max_bs={largest}, so that every batch "
                         f"of up to max_bs requests has a bucket; got {values!r}")
    return sorted(set(values))


def capture(fn: Callable, *args, warmup: int = 2, pool=None, **kwargs):
    """Warm ``fn(*args, **kwargs)`` up on a side stream, then capture one call.

    Returns ``(graph, out)``: replaying ``graph`` recomputes ``out`` in place
    from the same input buffers. ``pool`` shares a memory pool between graphs.
    CUDA only.
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


class CopyGroup(NamedTuple):
    """The inputs of one dtype: their names and the live-row views they are copied into."""

    names: List[str]
    views: List[torch.Tensor]


class LivePlan(NamedTuple):
    """What a call with ``bs`` live rows of a bucket needs, built once per ``(bucket, bs)``."""

    groups: Tuple[CopyGroup, ...]  # per-dtype copy groups of the bucket's inputs
    outputs: object  # the captured outputs' live rows (manual strategy), else None


class Route(NamedTuple):
    """A checked batch signature: where it goes and how its rows are copied in."""

    bucket: int
    bs: int
    copy: Callable[[Dict[str, torch.Tensor]], None]  # copy(batch): the live rows into the buffers
    plan: LivePlan

class CUDAGraphRunner:
    """Capture ``step(**batch)`` per bucket; replay it with fresh batches.

    Args:
        step: ``step(**batch) -> pytree of tensors``; every batch tensor and
            every output tensor has the batch as dimension 0.
        example: ``example(bs) -> dict`` of batch tensors for a batch of
            ``bs`` (values do not matter; shapes, dtypes and device do).
        buckets: batch sizes to capture (a call with ``bs`` uses the
            smallest bucket ``>= bs``).
        policy: how the step is compiled and captured (`CompilePolicy`;
            default: inductor, the batch dynamic, one CUDA graph per bucket).
        warmup: eager-compiled runs before each capture.
        cache_path: a file for PyTorch's compile caches: loaded (if it
            exists) before the first compile, written after `capture`, so a
            second process skips most of inductor's work (`load_compile_cache`).
            One file per runner: runners that share one leave it to their
            owner to load before and save after them all (`fa3_spec.graphs.cache`).
            Without graphs the step compiles on its first call, after
            `capture`, so only the owner can save it (as `EagleEngine.run` does).
        buffers: ``buffers(bucket) -> dict`` of caller-owned input tensors
            for the bucket (see the module docstring); ``example`` may then
            be omitted. The step may update them in place; the runner never
            zero-fills them.

    Attributes: ``compiled_step`` (the step as the policy compiles it; what
    each bucket captures), ``strategy`` (`CompilePolicy.strategy`). After
    `capture`: ``capture_seconds`` per bucket and
    ``compile_counter`` (a `fa3_spec.probes.RecordingBackend`: compiled frames
    and data-dependent ops seen).
    """

    def __init__(self, step: Callable, *,
                 example: Optional[Callable[[int], Dict[str, torch.Tensor]]] = None,
                 buckets: Sequence[int], policy: Optional[CompilePolicy] = None,
                 warmup: int = 2, cache_path: Optional[str] = None,
                 buffers: Optional[Callable[[int], Dict[str, torch.Tensor]]] = None):
        policy = CompilePolicy() if policy is None else policy
        if not isinstance(policy, CompilePolicy):
            raise TypeError(f"policy must be a CompilePolicy, got {type(policy).__name__}")
        if example is None and buffers is None:
            raise ValueError("give example= (runner-owned buffers) or buffers= (caller-owned)")
        self.step = step
        self.example = example if example is not None else buffers
        self.buffers = buffers
        self.buckets = check_buckets(buckets)
        self.policy = policy
        self.strategy = policy.strategy
        self.dynamic_batch = policy.dynamic_batch
        self.warmup = warmup
        self.compile_counter = RecordingBackend(policy.compile_backend, options=policy.options)
        self.capture_seconds: Dict[int, float] = {}
        self._static: Dict[int, Dict[str, torch.Tensor]] = {}
        self._outputs: Dict[int, object] = {}
        self._graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self._out_rows: Optional[List[Tuple[int, int]]] = None  # per output leaf: (a, c)
        self._pool = None
        self.cache_path = cache_path
        self._routes: Dict[tuple, Route] = {}  # batch signature -> its checked route
        self._dirty: Dict[int, int] = {}  # bucket -> rows [mark:] of its inputs are known zero
        self._live: Dict[Tuple[int, int], LivePlan] = {}  # (bucket, bs) -> its plan
        if policy.compile_backend is None:
            self.compiled_step = step
        else:
            # A static runner says so (dynamic=False): dynamo would otherwise make
            # the batch symbolic by itself when the same step code was compiled
            # before at another batch, e.g. by an earlier runner of one bucket.
            traced = bound_batch(step, max(self.buckets)) if policy.unbacked_batch else step
            compiled = torch.compile(traced, fullgraph=True, backend=self.compile_counter,
                                     dynamic=None if policy.dynamic_batch else False)
            self.compiled_step = size_oblivious(compiled) if policy.size_oblivious else compiled

    @property
    def captured(self) -> bool:
        """True once `capture` has built every bucket."""
        return bool(self._static)

    # ---------------------------------------------------------------- capture
    def capture(self) -> Dict[int, float]:
        """Allocate buffers and capture every bucket (largest first).

        All or nothing: the buckets are built aside and kept only when every
        one of them was captured and the outputs' row rule was learnt; on any
        error the runner is left as it was and the error propagates.

        Raises:
            RuntimeError: a policy with graphs without CUDA.
        """
        if self.strategy == "manual" and not torch.cuda.is_available():
            raise RuntimeError("a policy with graphs=True captures CUDA graphs and needs CUDA; "
                               "use CompilePolicy.eager() or .compiled() without CUDA")
        if self.cache_path is not None and self.strategy != "eager":
            load_compile_cache(self.cache_path)
        statics: Dict[int, Dict[str, torch.Tensor]] = {}
        outputs: Dict[int, object] = {}
        graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        seconds: Dict[int, float] = {}
        pool = self._pool
        for bucket in reversed(self.buckets):
            start = time.perf_counter()
            if self.buffers is not None:
                static = dict(self.buffers(bucket))
            else:
                static = {k: v.clone() for k, v in self.example(bucket).items()}
            statics[bucket] = static
            if self.strategy in ("manual", "compile") and self.dynamic_batch:
                mark_batch(static, bucket, max(self.buckets), self.policy.unbacked_batch)
            if self.strategy == "manual":
                pool = pool if pool is not None else torch.cuda.graph_pool_handle()
                graphs[bucket], outputs[bucket] = capture(
                    self.compiled_step, warmup=self.warmup, pool=pool, **static)
            if torch.cuda.is_available() and self.strategy != "eager":
                torch.cuda.synchronize()
            seconds[bucket] = time.perf_counter() - start
        # Caller-owned buffers without captured outputs: learnt on first use, if any.
        out_rows = self._learn_output_rows(outputs) if outputs or self.buffers is None else None
        # Every bucket is built: keep them all.
        self._static, self._outputs, self._graphs, self._pool = statics, outputs, graphs, pool
        self._out_rows, self.capture_seconds = out_rows, seconds
        self._dirty = {bucket: bucket for bucket in statics}  # example values: zero-fill
        self._routes.clear()
        self._live.clear()
        if self.cache_path is not None and self.strategy != "eager":
            save_compile_cache(self.cache_path)
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

    def _learn_output_rows(self, outputs: Dict[int, object]) -> List[Tuple[int, int]]:
        """Per output leaf ``(a, c)`` with ``rows = a * B + c``; refuse any other layout
        (checked on the captured ``outputs`` of every bucket too). A step whose
        captured outputs hold no tensor (an in-place step) needs no tracing."""
        if outputs and not any(pytree.tree_leaves(out) for out in outputs.values()):
            return []
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
        for bucket, out in outputs.items():  # check the rule on every captured bucket
            for i, (t, (a, c)) in enumerate(zip(pytree.tree_leaves(out), rows)):
                if t.dim() and t.shape[0] != a * bucket + c:
                    raise ValueError(
                        f"output leaf {i} has {t.shape[0]} rows at bucket {bucket}, not "
                        f"{a} * B + {c}: its leading dimension is not affine in the batch")
        return rows

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

    @staticmethod
    def _signature(batch: Dict[str, torch.Tensor]) -> Optional[tuple]:
        """Everything the checks and the copy plan read from ``batch``: keys
        (in order), and per value its type, dtype, shape, strides and device.
        None if a value is not tensor-like (the full checks then raise)."""
        try:
            return tuple((name, type(x), x.dtype, x.shape, x.stride(), x.device)
                         for name, x in batch.items())
        except (AttributeError, TypeError):
            return None

    def _checked_bs(self, batch: Dict[str, torch.Tensor]) -> int:
        """``bs`` of ``batch`` after the full checks (`_check_batch`)."""
        if not batch:
            raise ValueError("the batch is empty: pass the step's batch tensors")
        first = next(iter(batch.values()))
        bs = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else 0
        return self._check_batch(batch, self._static[self.bucket_for(bs)])

    def _route(self, batch: Dict[str, torch.Tensor]) -> Route:
        """The `Route` of ``batch``, built once per signature.

        The checks (`_check_batch`) are a pure function of the signature and
        of the bucket's buffers (fixed from `capture` on; `capture` clears
        this cache), and the bucket is itself chosen from the signature (the
        first value's leading dimension): a signature that passed once passes
        every time, so later calls with it skip them. ``copy(batch)`` moves
        the live rows: when every source can be viewed as bytes (its last
        dimension has stride 1, which the signature's strides decide) it is
        **one** ``torch._foreach_copy_`` over uint8 views of every pair (the
        multi-tensor path needs one dtype across the list; a mixed list falls
        back to one copy per tensor); otherwise one per dtype.
        """
        sig = self._signature(batch)
        route = self._routes.get(sig) if sig is not None else None
        if route is not None:
            return route
        bs = self._checked_bs(batch)
        bucket = self.bucket_for(bs)
        plan = self._plan(bucket, bs)
        names = list(self._static[bucket])

        def copy_per_dtype(batch):
            for group in plan.groups:
                torch._foreach_copy_(group.views, [batch[name] for name in group.names])

        try:  # buffers and sources must both have a byte view (last-dimension stride 1)
            dst = [self._static[bucket][name][:bs].view(torch.uint8) for name in names]
            for name in names:
                batch[name].view(torch.uint8)
        except RuntimeError:
            dst = None
        if dst is None:
            copy = copy_per_dtype
        else:
            def copy(batch):
                try:  # a conj/neg-bit view has no byte view: the signature does not see those bits
                    src = [batch[name].view(torch.uint8) for name in names]
                except RuntimeError:
                    return copy_per_dtype(batch)
                torch._foreach_copy_(dst, src)
        route = Route(bucket, bs, copy, plan)
        if sig is not None:
            self._routes[sig] = route
        return route

    def _plan(self, bucket: int, bs: int) -> LivePlan:
        """The `LivePlan` of ``bs`` live rows in ``bucket``, built once per (bucket, bs)."""
        plan = self._live.get((bucket, bs))
        if plan is None:
            groups: Dict[torch.dtype, CopyGroup] = {}
            for name, buf in self._static[bucket].items():
                group = groups.setdefault(buf.dtype, CopyGroup([], []))
                group.names.append(name)
                group.views.append(buf[:bs])
            live_out = None
            if self.strategy == "manual":
                live_out = self._live_outputs(self._outputs[bucket], bs)
            plan = LivePlan(tuple(groups.values()), live_out)
            self._live[(bucket, bs)] = plan
        return plan

    def _live_outputs(self, out, bs: int):
        leaves, spec = pytree.tree_flatten(out)
        if not leaves:
            return out
        if self._out_rows is None:
            self._out_rows = self._learn_output_rows({})
        live = [t[: max(a * bs + c, 0)] if t.dim() else t for t, (a, c) in zip(leaves, self._out_rows)]
        return pytree.tree_unflatten(live, spec)

    def _zero_padding(self, bucket: int, bs: int) -> None:
        """Zero rows ``[bs, mark)`` of the bucket's inputs; rows past the mark are zero already.
        Caller-owned buffers are the caller's to pad: never touched."""
        if self.buffers is not None:
            return
        mark = self._dirty[bucket]
        if mark > bs:
            torch._foreach_zero_([buf[bs:mark] for buf in self._static[bucket].values()])
        self._dirty[bucket] = bs

    def _run(self, bucket: int, bs: int, plan: LivePlan):
        self._zero_padding(bucket, bs)
        if self.strategy == "manual":
            self._graphs[bucket].replay()
            return plan.outputs
        out = self.compiled_step(**self._static[bucket])
        return self._live_outputs(out, bs)

    def __call__(self, **batch: torch.Tensor):
        """Copy ``batch`` into its bucket, replay, return the outputs' live rows.

        Outputs of the manual strategy are views of the captured buffers: the
        next call overwrites them (clone what must outlive it).
        """
        if self.buffers is not None:
            raise RuntimeError("a runner with caller-owned buffers is driven by replay(bucket, bs): "
                               "write the batch into buffers(bucket) and replay")
        if not self._static:
            self.capture()
        route = self._route(batch)
        route.copy(batch)
        return self._run(route.bucket, route.bs, route.plan)

    def replay(self, bucket: int, bs: int):
        """Zero-copy call: the engine has written rows ``[:bs]`` of every
        ``static_inputs(bucket)`` tensor itself (and no other rows).

        Zero-fills rows ``[bs:]`` where a previous call may have left data,
        replays, and returns the live output rows as `__call__` does. No
        shape, dtype or device checks: the engine writes into the buffers,
        whose shapes and dtypes are the captured ones.
        """
        if not self._static:
            self.capture()
        if bucket not in self._static:
            raise ValueError(f"bucket must be one of {self.buckets}, got {bucket!r}")
        if isinstance(bs, bool) or not isinstance(bs, int) or not 0 <= bs <= bucket:
            raise ValueError(f"bs must be an int in [0, {bucket}], got {bs!r}")
        return self._run(bucket, bs, self._plan(bucket, bs))

    def route(self, batch: Dict[str, torch.Tensor]) -> Route:
        """What a call does with ``batch`` before copying: its checked `Route`
        (bucket, live rows, copy function, plan), built once per signature
        and looked up after (for measuring the host cost of a call)."""
        if not self._static:
            self.capture()
        return self._route(batch)

    def copy_groups(self, bucket: int, bs: int) -> Tuple[CopyGroup, ...]:
        """The per-dtype `CopyGroup`s (input names, live-row views of the
        bucket's buffers) a call with ``bs`` rows copies into."""
        return self._plan(bucket, bs).groups

    def graph(self, bucket: int) -> torch.cuda.CUDAGraph:
        """The captured graph of ``bucket`` (manual strategy)."""
        return self._graphs[bucket]

    def output_buffers(self, bucket: int) -> Optional[object]:
        """The captured outputs of ``bucket`` (manual strategy)."""
        return self._outputs.get(bucket)
