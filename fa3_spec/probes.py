"""Compile probes shared by the runner and the audit.

Each answers one question about a function, with torch's own machinery:

* `graph_break_sites`: where does dynamo break the graph, and why?
* `RecordingBackend`: a ``torch.compile`` backend that counts compiled
  frames (a second frame for one call site is a recompile) and lists every
  data-dependent node (``item``/``tolist`` and values with unbacked
  symbols): each is a host sync on CUDA, even when ``fullgraph=True``
  accepted it (dynamo may capture ``Tensor.item`` as an unbacked symbol).
* `host_sync_sites`: synchronising CUDA calls, via
  ``torch.cuda.set_sync_debug_mode``, each with the user frame that made it.
* `recompile_reasons`: the guards that failed when dynamo recompiled.
* `user_frame`: the innermost frame of a stack outside torch and this package's
  probes (where a finding is in the user's source).

`fa3_spec.audit` is built on them. `graph_breaks` and `count_host_syncs` are
thin wrappers (counts and messages, no frames) for tests and notebooks.
CUDA-graph capture itself is `fa3_spec.graphs.capture`.
"""

from __future__ import annotations

import contextlib
import operator
import os
import re
import traceback
import warnings
from typing import Callable, Iterator, List, Optional

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(os.path.abspath(__file__))
_OWN_FILES = {os.path.join(_HERE, name) for name in ("probes.py", "audit.py")}


def user_frame(frames) -> Optional[traceback.FrameSummary]:
    """The innermost frame of ``frames`` (outermost first) in user code: not in
    torch, not in Python's own ``warnings``/``contextlib``, not in the audit
    itself. None when there is none."""
    for fr in reversed(list(frames or ())):
        if fr.filename.startswith(("<frozen", "<eval_with_key")):
            continue
        name = os.path.abspath(fr.filename)
        if name.startswith(_TORCH_DIR) or name in _OWN_FILES:
            continue
        if os.path.basename(name) in ("warnings.py", "contextlib.py"):
            continue
        return fr
    return None


_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)(?:, in (\S+))?')


def stack_trace_frame(stack_trace: Optional[str]) -> Optional[tuple]:
    """``(file, line, code)`` of the innermost ``File "...", line N`` of an FX
    node's ``stack_trace`` (the user line that produced the node), or None."""
    if not stack_trace:
        return None
    lines = stack_trace.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = _FILE_LINE.search(lines[i])
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return m.group(1), int(m.group(2)), code
    return None


def graph_breaks(fn: Callable, *args, **kwargs) -> tuple:
    """``(count, reasons)``: `graph_break_sites` without the frames."""
    count, sites = graph_break_sites(fn, *args, **kwargs)
    return count, [reason for reason, _ in sites]


def graph_break_sites(fn: Callable, *args, **kwargs) -> tuple:
    """``(count, [(reason, frame)])`` of graph breaks when dynamo traces
    ``fn(*args, **kwargs)``, each reason with the user frame
    (`traceback.FrameSummary` or None) where dynamo broke.

    Counted from the break reasons as well as ``graph_break_count``: on some
    torch versions (seen on 2.13) a break that ends the frame is listed in
    ``break_reasons`` while ``graph_break_count`` stays 0.
    """
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args, **kwargs)
    sites = [(str(r.reason), user_frame(getattr(r, "user_stack", None)))
             for r in explained.break_reasons]
    torch._dynamo.reset()
    return max(explained.graph_break_count, len(sites)), sites


def recompile_reasons() -> list:
    """``[(guard, file, line, code)]`` of every guard failure dynamo recorded since
    the last ``torch._dynamo.reset()`` (each one caused a recompile): the
    guard's source text (e.g. ``n == 2``) and the user line that installed it."""
    from torch._dynamo.utils import guard_failures

    found = []
    for failures in list(guard_failures.values()):
        for text in failures:
            first = str(text).splitlines()[0] if str(text) else ""
            guard = re.sub(r"^\s*\d+/\d+:\s*", "", first).split("#")[0].strip()
            where = stack_trace_frame(str(text))
            found.append((guard or first, *(where or (None, None, ""))))
    return found


class RecordingBackend:
    """A ``torch.compile`` backend that audits each graph, then delegates.

    Records the number of compiled frames (``frame_count``; more than one for
    one call site means a recompile) and every data-dependent node: ``item``
    / ``tolist`` calls and any value carrying unbacked symbols (``nonzero``,
    value-sized slices, ...). Such nodes are host syncs on CUDA. The check is
    needed because recent torch versions (seen on 2.13) accept ``Tensor.item``
    under ``fullgraph=True`` by capturing it as an unbacked symbol.
    """

    def __init__(self, compile_backend: str = "aot_eager", options: Optional[dict] = None):
        self.compile_backend = compile_backend
        self.options = dict(options or {})  # inductor config patches (inductor backend only)
        self.frame_count = 0
        self.data_dependent: list = []  # "op_kind:op" per data-dependent node
        self.data_dependent_sites: list = []  # (op, (file, line, code) or None)
        self.inplace_on_inputs: list = []  # (input placeholder, op, (file, line, code) or None)

    def __call__(self, gm, example_inputs):
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        def unbacked(node):
            value = node.meta.get("example_value") if hasattr(node, "meta") else None
            return free_unbacked_symbols(value) if value is not None else set()

        self.frame_count += 1
        inputs = {}  # storage of each graph input -> its placeholder
        for node in gm.graph.nodes:
            key = _storage(node) if node.op == "placeholder" else None
            if key is not None:
                inputs.setdefault(key, str(node.target))
        for node in gm.graph.nodes:
            op = getattr(node.target, "__name__", str(node.target))
            where = stack_trace_frame(node.meta.get("stack_trace"))
            # Count the node that introduces an unbacked symbol, not every
            # node that merely carries it on (sym_size, comparisons, asserts).
            inherited = set().union(*(unbacked(a) for a in node.all_input_nodes))
            if node.op == "placeholder" or _reads_a_python_scalar(node):
                # An input's unbacked size was marked so by its caller
                # (mark_unbacked), not read from device data; and dynamo's own
                # unwrapping of a dynamic Python float/int argument.
                pass
            elif (node.op == "call_method" and node.target in ("item", "tolist")) or (
                    unbacked(node) - inherited):
                self.data_dependent.append(f"{node.op}:{op}")
                self.data_dependent_sites.append((op, where))
            if node.op in ("call_method", "call_function") and node.args \
                    and _writes_in_place(node, op):
                # The written tensor shares an input's storage: the input itself
                # or a view of it (x[0].add_(1), x.view(-1).copy_(y)); a fresh
                # tensor computed from an input (x | y) is not the input.
                written = inputs.get(_storage(node.args[0]))
                if written is not None:
                    self.inplace_on_inputs.append((written, op, where))
        compiler = torch._dynamo.lookup_backend(self.compile_backend)
        if self.options and self.compile_backend == "inductor":
            from torch._inductor import config as inductor_config

            with inductor_config.patch(self.options):
                return compiler(gm, example_inputs)
        return compiler(gm, example_inputs)


def _reads_a_python_scalar(node) -> bool:
    """``x.item()`` where ``x`` is a Python number that dynamo passes as a
    tensor (a float argument that changed between calls is made dynamic that
    way): the value comes from the caller's arguments, not from device data,
    so it is no host sync. (Under CUDA-graph replay such a value is frozen at
    capture; the audit's replay parity on the variants catches that.)"""
    if not (node.op == "call_method" and node.target == "item" and node.args):
        return False
    source = node.args[0]
    grapharg = getattr(source, "meta", {}).get("grapharg")
    return getattr(source, "op", None) == "placeholder" and bool(
        getattr(grapharg, "pass_arg_as_tensor", False))


#: Python's augmented assignments and ``x[i] = v``: in place on a tensor.
_INPLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.setitem})


def _writes_in_place(node, op: str) -> bool:
    """``x.add_(...)``, ``torch.Tensor.copy_``, ``x |= y``, ``x[i] = v``; not
    ``operator.or_`` / ``and_`` (``x | y``), whose names merely end in ``_``."""
    if node.target in _INPLACE_OPERATORS:
        return True
    if getattr(node.target, "__module__", None) in ("_operator", "operator"):
        return False
    return op.endswith("_") and not op.startswith("_")


def _storage(node):
    """A hashable handle on the storage of ``node``'s example tensor, or None."""
    from torch.multiprocessing.reductions import StorageWeakRef

    value = getattr(node, "meta", {}).get("example_value")
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return StorageWeakRef(value.untyped_storage())
    except (RuntimeError, NotImplementedError):  # a tensor without a storage
        return None


def count_host_syncs(fn: Callable, *args, calls: int = 2, **kwargs) -> tuple:
    """``(count, messages)``: `host_sync_sites` without the frames."""
    sites = host_sync_sites(fn, *args, calls=calls, **kwargs)
    return len(sites), [message for message, _ in sites]


def host_sync_sites(fn: Callable, *args, calls: int = 2, **kwargs) -> list:
    """``[(message, frame)]``: each synchronizing CUDA call of ``calls`` runs of
    ``fn(*args, **kwargs)``, with the user frame (`traceback.FrameSummary` or
    None) that made it.

    One un-counted warm-up call comes first, so one-time process set-up
    (lazy CUDA/library initialisation) is not charged to the step.
    """
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    with recording_host_syncs() as caught:
        for _ in range(calls):
            fn(*args, **kwargs)
    return caught


@contextlib.contextmanager
def recording_host_syncs() -> Iterator[List[tuple]]:
    """Record the synchronizing CUDA calls made inside the block.

    Yields a list that fills with ``(message, frame)`` per synchronizing call
    (torch's ``set_sync_debug_mode("warn")`` reports; its one-time "prototype
    feature" notice is left out), ``frame`` being the user frame that made it.
    """
    caught: List[tuple] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing" in str(message):
            caught.append((str(message), user_frame(traceback.extract_stack()[:-1])))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")
