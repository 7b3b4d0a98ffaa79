"""How a step is compiled and captured: `CompilePolicy`, resolved once.

A `fa3_spec.graphs.CUDAGraphRunner` reads one policy; the EAGLE engine
resolves its own with `CompilePolicy.for_loop` from the device, the compile
backend it was given, whether graphs were asked for, its buckets and whether
its models can run their layers as compiled regions. Every workaround the
compilers need lives here, each with its reason, and nowhere else.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

#: ``compile_backend`` values an engine takes: a ``torch.compile`` backend, or
#: ``"none"`` (no compile; with graphs, eager capture, for debugging);
#: ``"auto"`` is ``"inductor"`` on CUDA and ``"none"`` elsewhere.
COMPILE_BACKENDS = ("auto", "inductor", "aot_eager", "eager", "none")

#: Inductor settings for a compiled step that builds this library's metadata
#: (every policy's default; `compile_fullgraph` applies them too).
#: ``combo_kernels`` turns on inductor's *horizontal* fusion: kernels with no
#: data dependence between them (each draft step's page table, lengths,
#: offsets and expand table are such kernels: they differ in size, so
#: inductor's ordinary vertical fusion keeps them apart) are launched as one
#: kernel, so a draft iteration's metadata costs the dependence depth of its
#: graph in launches rather than one launch per table.
INDUCTOR_OPTIONS: Dict[str, object] = {"combo_kernels": True}


def compile_fullgraph(fn: Callable, *, compile_backend="inductor", options: Optional[dict] = None,
                      **kwargs) -> Callable:
    """``torch.compile(fn, fullgraph=True, backend=compile_backend, **kwargs)`` with
    `INDUCTOR_OPTIONS` (or ``options``) when the backend is inductor.

    The way to compile an engine step that calls the builders, so that its
    metadata kernels fuse. ``mode=`` is accepted (turned into its options).
    Any other backend (``"aot_eager"``, a callable, including a
    `fa3_spec.probes.RecordingBackend` wrapping inductor, which takes its own
    ``options=``) is passed through untouched.
    """
    if compile_backend == "inductor":
        merged = dict(INDUCTOR_OPTIONS if options is None else options)
        mode = kwargs.pop("mode", None)
        if mode is not None:  # torch.compile takes mode or options, not both: spell mode as options
            from torch._inductor import list_mode_options

            merged = {**list_mode_options(mode), **merged}
        kwargs["options"] = merged
    return torch.compile(fn, fullgraph=True, backend=compile_backend, **kwargs)


def with_own_code(fn: Callable, name: str, *, shared: bool = False) -> Callable:
    """``fn`` as a new function with a copy of its code object, named ``name``.

    Dynamo keeps its compiled entries, and its recompile limit, per code
    object: functions made by one factory (closures over different
    constants) would otherwise evict one another, and past the limit a
    ``fullgraph=True`` compile fails instead of compiling again.
    ``shared``: every call with the same code and ``name`` gets the same
    copy, so that functions of one kind (an engine's iteration of one tree
    shape, engine after engine) keep sharing their compiled entries.
    """
    code = _renamed_code(fn.__code__, name) if shared else fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


@functools.lru_cache(maxsize=None)
def _renamed_code(code, name: str):
    return code.replace(co_name=name)


def size_oblivious(compiled: Callable) -> Callable:
    """``compiled`` called under ``backed_size_oblivious``: what dynamo traces
    (and what the compiles nested in it trace) gets no 0/1 specialisation of
    the sizes it marks dynamic. A config, so it acts while a call compiles;
    a call that finds its frame compiled only runs the guards."""
    from torch.fx.experimental import _config as shape_config

    @functools.wraps(compiled)
    def call(*args, **kwargs):
        with shape_config.patch(backed_size_oblivious=True):
            return compiled(*args, **kwargs)

    return call


#: The keyword arguments this torch's ``mark_unbacked`` takes.
_UNBACKED_OPTIONS = frozenset(inspect.signature(torch._dynamo.decorators.mark_unbacked).parameters)


def _unbacked_batch_marks(largest: int) -> dict:
    """`mark_batch`'s ``mark_unbacked`` arguments (later torch releases than
    ``mark_unbacked`` itself): one symbol for every input, and its size hint.
    Its bounds come from `bound_batch`, which every release honours."""
    return dict(shape_id="batch", hint_override=largest)


def mark_batch(inputs: Mapping[str, torch.Tensor], bucket: int, largest: int,
               unbacked: bool) -> None:
    """Mark dimension 0 of a bucket's ``inputs`` (each ``[bucket, ...]``) as the
    dynamic batch: backed (``maybe_mark_dynamic``), or with ``unbacked`` one
    unbacked symbol for all of them, whose size hint is ``largest`` (what
    inductor tunes for: the bucket a backed frame compiles first); the step
    compiled must then be `bound_batch`'s."""
    for name, t in inputs.items():
        if not unbacked:
            torch._dynamo.maybe_mark_dynamic(t, 0)
            continue
        if t.dim() == 0 or t.shape[0] != bucket:
            raise ValueError(f"unbacked_batch needs every input to lead with the batch: "
                             f"{name!r} has shape {tuple(t.shape)} in bucket {bucket}")
        torch._dynamo.decorators.mark_unbacked(t, 0, **_unbacked_batch_marks(largest))


def bound_batch(step: Callable, largest: int) -> Callable:
    """``step`` (called with keyword tensors that lead with the batch) that
    first tells the compiler its batch is in ``[1, largest]``.

    ``torch._check`` on an unbacked size refines the symbol's value range,
    which inductor reads for its index widths and size-oblivious reasoning;
    ``mark_unbacked``'s own ``min``/``max`` exist only in later releases. On
    plain integers (a backed or eager call) the checks are the host's own
    comparisons and raise on a batch outside the range.

    The wrapper gets a code object of its own per step name and ``largest``
    (`with_own_code`): dynamo keeps compiled entries per code object, and a
    second compile of one code whose closure int changed makes that int a
    symbol (automatic dynamic), which would leave the batch bounded by a
    symbol instead of ``largest``: two runners of one engine, each with its
    own largest bucket, would then fail to trace any check against a
    constant above the smaller one. Steps that differ in a closure constant
    need distinct names for the same reason (the engine names each shape's
    step after its shape).
    """

    def call(**inputs):
        batch = next(iter(inputs.values())).shape[0]
        torch._check(batch >= 1, lambda: "the batch is empty")
        torch._check(batch <= largest, lambda: "the batch exceeds the largest bucket")
        return step(**inputs)

    name = f"{getattr(step, '__name__', 'step')}_batch_within_{largest}"
    return functools.wraps(step)(with_own_code(call, name, shared=True))


@dataclasses.dataclass(frozen=True)
class CompilePolicy:
    """How a runner compiles and captures its step.

    Attributes:
        compile_backend: the ``torch.compile(fullgraph=True)`` backend, or None
            (the step runs as written; with ``graphs``, eager capture).
        graphs: capture one CUDA graph per bucket (CUDA only).
        dynamic_batch: mark the batch dimension dynamic so that the buckets
            share one compiled frame; False compiles each bucket as a static
            frame (``dynamic=False``), whatever was compiled before.
        size_oblivious: with ``dynamic_batch``, trace under PyTorch's
            size-oblivious reasoning for backed sizes, so that a batch of 1
            gets the batch symbol instead of dynamo's 0/1 specialisation and
            bucket 1 shares the frame. The step is then traced as if no batch
            were 1: a step that broadcasts its batch against another, or
            branches on it being 1, would run its batch >= 2 code at batch 1
            (none of the library's steps does).
        unbacked_batch: with ``dynamic_batch``, the batch is one unbacked
            symbol (dynamo's ``mark_unbacked``) that every input shares, in
            ``[1, largest bucket]``: no guard specialises it, so bucket 1
            shares the frame under every backend. ``size_oblivious``
            reaches only what dynamo traces: inductor's lowering of a view of
            a non-contiguous, batch-leading layout still guards a backed batch
            against 1. Every input must then lead with the batch, and a step
            that branches on the batch's value fails to trace instead of
            guarding. With ``regions``, add ``size_oblivious``: the layer
            programs compile inside the frame's call with their row counts
            backed, and size-oblivious tracing keeps bucket 1's one-row calls
            in the programs the other buckets compiled.
        regions: the step's model runs each decoder layer as a compiled
            region (`fa3_spec.eagle.regions`), so the compile does not grow
            with depth.
        inductor_options: inductor config while compiling the step, as
            ``(name, value)`` pairs (default `INDUCTOR_OPTIONS`).
    """

    compile_backend: Optional[str] = "inductor"
    graphs: bool = True
    dynamic_batch: bool = True
    size_oblivious: bool = False
    unbacked_batch: bool = False
    regions: bool = False
    inductor_options: Tuple[Tuple[str, object], ...] = tuple(INDUCTOR_OPTIONS.items())

    def __post_init__(self) -> None:
        for name in ("graphs", "dynamic_batch", "size_oblivious", "unbacked_batch", "regions"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.compile_backend is not None and not isinstance(self.compile_backend, str) \
                and not callable(self.compile_backend):
            raise TypeError(f"compile_backend must be a backend name, a callable or None, "
                            f"got {self.compile_backend!r}")
        if self.size_oblivious and not (self.dynamic_batch and self.compile_backend is not None):
            raise ValueError("size_oblivious=True needs dynamic_batch=True and a compile_backend, "
                             f"got dynamic_batch={self.dynamic_batch!r}, "
                             f"compile_backend={self.compile_backend!r}")
        if self.unbacked_batch:
            if not (self.dynamic_batch and self.compile_backend is not None):
                raise ValueError("unbacked_batch=True needs dynamic_batch=True and a "
                                 f"compile_backend, got dynamic_batch={self.dynamic_batch!r}, "
                                 f"compile_backend={self.compile_backend!r}")
            needed = set(_unbacked_batch_marks(1))
            missing = sorted(needed - _UNBACKED_OPTIONS)
            if missing:
                raise RuntimeError(f"unbacked_batch=True needs torch._dynamo's mark_unbacked "
                                   f"with {', '.join(sorted(needed))}; torch "
                                   f"{torch.__version__} lacks {', '.join(missing)}")
        if self.regions and self.compile_backend is None:
            raise ValueError("regions=True compiles each layer and needs a compile_backend")

    @classmethod
    def eager(cls) -> "CompilePolicy":
        """No compile, no graph: the runner's padding and routing around the step as written."""
        return cls(compile_backend=None, graphs=False)

    @classmethod
    def compiled(cls, compile_backend: str = "inductor", *,
                 dynamic_batch: bool = True) -> "CompilePolicy":
        """Compiled, called directly (no graph): what a CPU run of a compiled step needs."""
        return cls(compile_backend=compile_backend, graphs=False, dynamic_batch=dynamic_batch)

    @property
    def strategy(self) -> str:
        """``"manual"`` (graphs), ``"compile"`` (compiled, no graph) or ``"eager"``."""
        if self.graphs:
            return "manual"
        return "eager" if self.compile_backend is None else "compile"

    @property
    def options(self) -> Dict[str, object]:
        """`inductor_options` as a dict."""
        return dict(self.inductor_options)

    @classmethod
    def for_loop(cls, *, device, compile_backend: Optional[str] = "auto",
                 graphs: Optional[bool] = None, buckets: Sequence[int],
                 regions_available: bool, unbacked_batch: bool = False) -> "CompilePolicy":
        """The EAGLE engine's policy on ``device``.

        * ``compile_backend``: one of `COMPILE_BACKENDS` (None is ``"none"``);
          ``"auto"`` is inductor on CUDA and no compile elsewhere.
        * ``graphs``: default on with CUDA; refused without it.
        * The batch is dynamic unless the backend is inductor with at most one
          bucket above 1 (nothing to share: each frame keeps its batch a
          constant). Under ``aot_eager`` and ``eager`` bucket 1 shares the
          frame (``size_oblivious``); under inductor it is a frame of its
          own, because inductor's lowering of a reshape between ``[B, K]``
          and ``[B * K]`` guards the batch against 1 even then
          (``unbacked_batch``, below, shares it).
        * Decoder layers run as compiled regions under inductor when the
          models offer them: one compile of a layer serves every layer.
        * ``unbacked_batch``: the batch unbacked and, for the layer programs,
          size-oblivious tracing, whatever the backend and buckets: bucket 1
          then compiles nothing of its own.
        * Inductor with a symbolic batch: index propagation off (it fails on
          the iteration's symbolic loop ranges), and with regions or an
          unbacked batch also combo kernels off (it groups a reduction over
          the symbolic batch into one kernel, which it cannot compile: around
          the region ops, or anywhere the batch is unbacked). The regions'
          own programs keep the default options.
        """
        device = torch.device(device)
        compile_backend = "none" if compile_backend is None else compile_backend
        if compile_backend not in COMPILE_BACKENDS:
            raise ValueError(f"compile_backend must be one of {COMPILE_BACKENDS} or None, "
                             f"got {compile_backend!r}")
        cuda = device.type == "cuda"
        if compile_backend == "auto":
            compile_backend = "inductor" if cuda else "none"
        if graphs is None:
            graphs = cuda
        if not isinstance(graphs, bool):
            raise TypeError(f"graphs must be a bool or None, got {graphs!r}")
        if graphs and not cuda:
            raise ValueError("graphs=True needs a CUDA device")
        compiled = compile_backend != "none"
        if not isinstance(unbacked_batch, bool):
            raise TypeError(f"unbacked_batch must be a bool, got {unbacked_batch!r}")
        if unbacked_batch and not compiled:
            raise ValueError(f"unbacked_batch=True needs a compile backend, got "
                             f"compile_backend={compile_backend!r} on {device}")
        inductor = compile_backend == "inductor"
        dynamic = len([b for b in buckets if b > 1]) > 1 or not inductor or unbacked_batch
        regions = inductor and regions_available
        options = dict(INDUCTOR_OPTIONS)
        if inductor and dynamic:
            options["constant_and_index_propagation"] = False
            if regions or unbacked_batch:
                options["combo_kernels"] = False
        return cls(compile_backend=compile_backend if compiled else None, graphs=graphs,
                   dynamic_batch=dynamic,
                   size_oblivious=dynamic and (unbacked_batch
                                               or compile_backend in ("aot_eager", "eager")),
                   unbacked_batch=unbacked_batch,
                   regions=regions, inductor_options=tuple(options.items()))
