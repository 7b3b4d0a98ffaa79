"""Audit a function for CUDA-graph readiness: the engine behind ``fa3-spec audit``.

`audit_callable` takes a function, one example call and variants of it (same
shapes and dtypes, other values), and returns one `AuditRow` whose
``findings`` give, for every problem, the column it counts in, the file,
line and op, and a message (`Finding`):

1. graph breaks when dynamo traces it, with their reasons;
2. recompiles when only values change (a second compiled frame), and every
   data-dependent node of the graph (``item``, unbacked symbols from
   ``nonzero`` or value-sized shapes): each is a host sync on CUDA;
3. mutations: an argument written that was not declared writable, whether
   its tensors sit in a pytree or in the fields and attributes of a plain
   object (an unregistered dataclass, a buffers holder); the caller's own
   tensors are never written, every run gets copies;
4. parity: the compiled function equals eager on every call, and eager
   equals a reference when one is given;
5. on CUDA only: host syncs of an eager and a compiled run under
   ``torch.cuda.set_sync_debug_mode("warn")``, then a CUDA-graph capture of
   the compiled function on the example, refilled with each variant,
   replayed and compared with eager. On CPU these are reported as not
   measured (``host_syncs = None``, ``cuda_graph = "skipped"``).

`audit_function` is the thin layer the project's self-audit
(`fa3_spec.harness.selfaudit`) runs on every builder and whole step:
positional argument lists, an output comparison, a reference, and the row's
labels. `format_table` prints rows of either kind. The CLI is ``fa3-spec
audit`` (the self-audit) and ``fa3-spec audit --callable module:function
--inputs module:factory`` (any function).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import inspect
import logging
import os
import time
import types
import warnings
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch.utils import _pytree

from . import _validate
from .graphs import capture
from .probes import (RecordingBackend, graph_break_sites, host_sync_sites, recompile_reasons,
                     user_frame)

#: The columns a `Finding` can count in (``AuditRow`` fields of the same names).
COLUMNS = ("graph_breaks", "data_dependent", "recompiles", "mutations", "host_syncs",
           "cuda_graph", "parity")

#: Characters of a finding's message shown in a `format_table` line (cut at a
#: word); `Finding.message` and the JSON keep the whole text.
TABLE_MESSAGE_CHARS = 200


def _cut(text: str, limit: int) -> str:
    """``text`` on one line, cut at the last word boundary before ``limit`` characters."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    head = text[:limit + 1]
    cut = head.rfind(" ")
    return (head[:cut] if cut > limit // 2 else text[:limit]).rstrip(" ,;:") + " ..."


class EagerCallFailed(RuntimeError):
    """The audited function raised when run eagerly on the example or a variant:
    nothing can be measured. Its exception is ``__cause__``."""


@dataclasses.dataclass
class Finding:
    """One problem, with what is needed to fix it.

    Attributes:
        column: the `AuditRow` column it counts in (one of `COLUMNS`).
        op: the operation (``item``, ``nonzero``, ``add_``, a guard, ...).
        file, line: where it is in the user's source (None when unknown).
        code: that source line, stripped ("" when unknown).
        message: what torch said, or what the audit saw (whole).
    """

    column: str
    op: str
    file: Optional[str]
    line: Optional[int]
    message: str
    code: str = ""

    def summary(self, limit: Optional[int] = None) -> str:
        """One line: column, place, op and message (cut at a word to ``limit``
        characters when given), then the source line."""
        where = f"{os.path.basename(self.file)}:{self.line}" if self.file else "?"
        message = self.message if limit is None else _cut(self.message, limit)
        op = self.op if limit is None else _cut(self.op, 80)
        text = f"{self.column:<14} {where:<28} {op}: {message}"
        return text + (f"   | {self.code}" if self.code else "")

    def __str__(self) -> str:
        return self.summary()


@dataclasses.dataclass
class AuditRow:
    """One audited function: a count per column, and the findings behind them.

    ``mode`` labels the row (a self-audit row's forward mode, or the audited
    function's name); ``scope`` is ``"builder"``, ``"step"`` or ``"loop"``
    for self-audit rows and ``"callable"`` for `audit_callable`; ``config``
    and ``step`` label self-audit rows. ``break_reasons`` and ``problems``
    are the graph-break findings' messages and every finding as text, whole.
    """

    mode: str
    scope: str
    config: dict
    step: Optional[int]
    graph_breaks: int
    break_reasons: list
    recompiles: int
    data_dependent: int
    host_syncs: Optional[int]
    cuda_graph: str
    parity: bool
    problems: list
    seconds: float
    mutations: int = 0  # inputs written that were not declared writable
    findings: list = dataclasses.field(default_factory=list)  # of `Finding`

    @property
    def clean(self) -> bool:
        return (
            self.graph_breaks == 0
            and self.recompiles == 0
            and self.data_dependent == 0
            and self.mutations == 0
            and self.parity
            and self.host_syncs in (None, 0)
            and self.cuda_graph in ("ok", "skipped")
        )

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def audit_function(
    fn: Callable,
    args: Sequence[Sequence[torch.Tensor]],
    *,
    same: Callable[[object, object], list],
    reference_problems: Optional[Callable[[int, object], list]] = None,
    restore: Callable[[], None] = lambda: None,
    compile_backend: str = "aot_eager",
    device: str = "cpu",
    mode: str = "function",
    scope: str = "function",
    config: Optional[dict] = None,
    step: Optional[int] = None,
) -> AuditRow:
    """`audit_callable` on positional argument lists, labelled as a self-audit row.

    Args:
        fn: the function, taking positional tensors.
        args: at least two argument lists, equal shapes/dtypes, other values:
            the first is the example call, the others its variants.
        same: ``same(got, want) -> list of problems`` (empty when equal)
            between two outputs of ``fn``.
        reference_problems: ``(i, eager_output) -> problems`` against an
            independent reference (optional).
        restore, compile_backend, device: as for `audit_callable`.
        mode, scope, config, step: labels copied into the row.
    """
    row = audit_callable(fn, tuple(args[0]), variants=[tuple(a) for a in args[1:]],
                         compile_backend=compile_backend, device=device, restore=restore, name=mode,
                         same=lambda got, want: same(got[0], want[0]),
                         reference=reference_problems)
    return dataclasses.replace(row, scope=scope, config=dict(config or {}), step=step)


# ------------------------------------------------------------------ the table
def _syncs(r: AuditRow) -> str:
    return "-" if r.host_syncs is None else str(r.host_syncs)


#: Columns of `format_table`: ``(header, format spec, value of a row)``; a
#: str between them is printed as it is. Self-audit rows and function rows.
_OUTCOME = (
    "  ", ("graph", "<8", lambda r: r.cuda_graph),
    ("parity", "<7", lambda r: "yes" if r.parity else "NO"), ("sec", ">6.1f", lambda r: r.seconds),
)
_CASE_COLUMNS = (
    ("mode", "<16", lambda r: r.mode), ("scope", "<8", lambda r: r.scope),
    ("P", ">4", lambda r: r.config.get("page_size", "-")),
    ("K", ">3", lambda r: r.config.get("topk", "-")),
    ("S", ">3", lambda r: r.config.get("num_steps", "-")),
    ("step", ">5", lambda r: "-" if r.step is None else str(r.step)), "  ",
    ("draft", "<10", lambda r: r.config.get("draft_attention") or "-"),
    ("breaks", ">6", lambda r: r.graph_breaks), ("recomp", ">7", lambda r: r.recompiles),
    ("dd", ">4", lambda r: r.data_dependent), ("syncs", ">6", _syncs),
) + _OUTCOME
_FUNCTION_COLUMNS = (
    ("function", "<40", lambda r: r.mode[:39]),
    ("breaks", ">7", lambda r: r.graph_breaks), ("recomp", ">7", lambda r: r.recompiles),
    ("dd", ">4", lambda r: r.data_dependent), ("mut", ">4", lambda r: r.mutations),
    ("syncs", ">6", _syncs),
) + _OUTCOME


def format_table(rows: list) -> str:
    """A fixed-width table of audit rows, one line each followed by its
    findings (messages cut at a word to `TABLE_MESSAGE_CHARS`), and a summary.

    Rows of `audit_callable` (scope ``"callable"``) are labelled by function
    and show input mutations; self-audit rows by mode, scope, page size,
    topk, draft steps and step.
    """
    functions = bool(rows) and all(r.scope == "callable" for r in rows)
    columns = _FUNCTION_COLUMNS if functions else _CASE_COLUMNS

    def line(cell) -> str:
        return "".join(c if isinstance(c, str) else cell(*c) for c in columns)

    head = line(lambda header, spec, _: format(header, spec.split(".")[0]))
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(line(lambda _, spec, value: format(value(r), spec)))
        lines += [f"    ! {f.summary(TABLE_MESSAGE_CHARS)}" for f in r.findings]
    bad = sum(not r.clean for r in rows)
    lines.append("-" * len(head))
    lines.append(f"{len(rows)} {'functions' if functions else 'cases'}, {len(rows) - bad} clean, "
                 f"{bad} unclean")
    return "\n".join(lines)


# ------------------------------------------------------------------ arguments
#: Values never entered when looking for tensors.
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device,
          enum.Enum, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
          types.MethodType)


def _attribute_dict(x) -> Optional[dict]:
    """The fields of a dataclass that is not a registered pytree, or the
    ``__dict__`` of another plain object; None for tensors, pytree nodes and
    Python values."""
    if isinstance(x, (torch.Tensor,) + _PLAIN):
        return None
    if _pytree._get_node_type(x) in _pytree.SUPPORTED_NODES:
        return None
    if dataclasses.is_dataclass(x):
        return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    attrs = getattr(x, "__dict__", None)
    return dict(attrs) if isinstance(attrs, dict) else None


def _reaches_a_tensor(tree, seen: set) -> bool:
    for leaf in _pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            return True
        attrs = _attribute_dict(leaf)
        if attrs is not None and id(leaf) not in seen:
            seen.add(id(leaf))
            if _reaches_a_tensor(attrs, seen):
                return True
    return False


def _object_attributes(x) -> Optional[dict]:
    """`_attribute_dict` of ``x`` when a tensor is reachable through it, else None.

    Such objects (a plain ``@dataclass Buffers``, an object with tensor
    attributes) are leaves to ``torch.utils._pytree``: the audit enters them
    itself, to copy, compare and refill their tensors.
    """
    attrs = _attribute_dict(x)
    return attrs if attrs is not None and _reaches_a_tensor(attrs, {id(x)}) else None


def _enter(x, path: tuple) -> tuple:
    if id(x) in path:
        raise TypeError(f"an argument holds a {type(x).__name__} that refers back to itself: "
                        "the audit cannot copy it; pass the tensors it holds instead")
    return path + (id(x),)


def _expand(tree, _path: tuple = ()):
    """``tree`` with each plain object holding tensors replaced by
    ``{"<module.Type>": its attributes}`` (recursively): a pytree whose leaves
    are the same tensors and values, whose structure names the types."""
    def leaf(x):
        attrs = _object_attributes(x)
        if attrs is None:
            return x
        kind = f"<{type(x).__module__}.{type(x).__qualname__}>"
        return {kind: _expand(attrs, _enter(x, _path))}

    return _pytree.tree_map(leaf, tree)


def _clone(tree, _path: tuple = ()):
    """A copy of ``tree`` whose tensors are fresh clones, plain objects holding
    tensors included (each copied, its tensors cloned); other leaves shared."""
    def leaf(x):
        if isinstance(x, torch.Tensor):
            return x.clone()
        attrs = _object_attributes(x)
        if attrs is None:
            return x
        path = _enter(x, _path)
        try:
            twin = copy.copy(x)
        except Exception as exc:
            raise TypeError(f"an argument holds a {type(x).__name__} with tensors that the "
                            f"audit cannot copy ({type(exc).__name__}: {exc}); pass the "
                            "tensors it holds instead") from exc
        for name, value in attrs.items():
            object.__setattr__(twin, name, _clone(value, path))
        return twin

    return _pytree.tree_map(leaf, tree)


def pytree_mismatches(got, want, *, rtol: Optional[float] = None,
                      atol: Optional[float] = None) -> list:
    """Problems (empty when equal) between two pytrees of tensors and Python values.

    Tensors: equal shape and dtype, then values exactly for integer and bool
    dtypes and within ``torch.testing.assert_close``'s dtype tolerances (or
    ``rtol``/``atol``) for floating ones, NaNs equal. Plain objects that hold
    tensors (dataclasses that are not registered pytrees, objects with tensor
    attributes) are compared type and attribute by attribute; other leaves
    with ``==``.
    """
    got_leaves, got_spec = _pytree.tree_flatten(_expand(got))
    want_leaves, want_spec = _pytree.tree_flatten(_expand(want))
    if got_spec != want_spec:
        return [f"structure differs: {got_spec} vs {want_spec}"]
    problems = []
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        if isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor):
            if g.shape != w.shape or g.dtype != w.dtype:
                problems.append(f"leaf {i}: {tuple(g.shape)} {g.dtype} vs "
                                f"{tuple(w.shape)} {w.dtype}")
                continue
            try:
                torch.testing.assert_close(g.cpu(), w.cpu(), rtol=rtol, atol=atol, equal_nan=True)
            except AssertionError as exc:
                problems.append(f"leaf {i}: " + _cut(str(exc), 160))
        else:
            try:
                equal = bool(g == w)
            except Exception:  # e.g. objects whose == is not a bool
                equal = g is w
            if not equal:
                problems.append(f"leaf {i}: {g!r} vs {w!r}")
    return problems


def _call(fn: Callable, call: tuple):
    args, kwargs = call
    return fn(*args, **kwargs)


def _argument_names(fn: Callable, call: tuple) -> list:
    """``[(name, value)]`` of a call's top-level arguments (positional ones named
    from ``fn``'s signature when it has one, else ``"arg<i>"``)."""
    args, kwargs = call
    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    named = [(params[i] if i < len(params) else f"arg{i}", a) for i, a in enumerate(args)]
    return named + list(kwargs.items())


def check_call_layout(example, variants: Iterable = ()) -> list:
    """``[(args, kwargs)]`` of ``example`` and each variant, checked.

    Raises:
        TypeError, ValueError: ``example`` is not a tuple/list/dict of
            arguments, or a variant differs from it in structure, type, or a
            tensor's shape, dtype or device (the message names it); an
            argument holds tensors in an object the audit cannot copy.
    """
    calls = [_validate.call_arguments("example", example)]
    layout = _expand(calls[0])
    for i, v in enumerate(variants):
        call = _validate.call_arguments(f"variants[{i}]", v)
        _validate.same_call_layout(f"variants[{i}]", _expand(call), layout)
        calls.append(call)
    _clone(calls[0])  # raises now, naming the object, if one cannot be copied
    return calls


# ------------------------------------------------------------------ findings
def _frame_finding(column: str, op: str, message: str, frame) -> Finding:
    if frame is None:
        return Finding(column, op, None, None, message)
    return Finding(column, op, frame.filename, frame.lineno, message, (frame.line or "").strip())


def _site_finding(column: str, op: str, message: str, where) -> Finding:
    """``where``: ``(file, line, code)`` from an FX node's stack trace, or None."""
    if not where:
        return Finding(column, op, None, None, message)
    return Finding(column, op, where[0], where[1], message, where[2])


def _failure_finding(exc: BaseException) -> Finding:
    """A fullgraph compile failure: dynamo's break type and the user frame it stopped at."""
    frames = getattr(exc, "real_stack", None) or []
    frame = user_frame(frames) or getattr(exc, "innermost_user_frame_summary", None)
    op = getattr(exc, "gb_type", None) or type(exc).__name__
    first = (str(exc).strip().splitlines() or [""])[0]
    return _frame_finding("graph_breaks", str(op), f"fullgraph compile failed: {first}", frame)


@contextlib.contextmanager
def _quiet_torch() -> Iterator[None]:
    """Hold back torch's own warnings (log records and Python warnings) while
    auditing: what they say is in the findings, at the user's line."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"torch(\.|$)")
            yield
    finally:
        logger.setLevel(level)


# ------------------------------------------------------------------ the audit
def audit_callable(
    fn: Callable,
    example,
    *,
    variants: Iterable = (),
    compile_backend: str = "aot_eager",
    device: Optional[str] = None,
    same: Optional[Callable[[object, object], list]] = None,
    reference: Optional[Callable[[int, object], list]] = None,
    writable: Iterable[str] = (),
    restore: Callable[[], None] = lambda: None,
    name: Optional[str] = None,
) -> AuditRow:
    """Audit any function for ``torch.compile(fullgraph=True)`` + CUDA graphs.

    Args:
        fn: the function (or any callable) to audit.
        example: its arguments: a tuple/list of positional arguments, or a dict
            of keyword arguments. Tensors, Python values, pytrees of tensors
            (lists, tuples, dicts, registered dataclasses) and plain objects
            holding tensors (unregistered dataclasses, objects with tensor
            attributes: copied by `copy.copy`, their tensors cloned) are fine.
            The caller's tensors are never written: every run gets copies.
        variants: other argument values for ``fn``, each of the layout of
            ``example`` (same structure and types; tensors of the same shapes,
            dtypes and devices). A recompile on one of them is a
            value-dependent guard; give at least one to measure recompiles.
        compile_backend: the ``torch.compile`` backend (``aot_eager``, ``eager``, ``inductor``).
        device: ``"cpu"`` or ``"cuda"``; default: ``"cuda"`` when a tensor of
            ``example`` is on CUDA. Host syncs and CUDA-graph capture are
            measured on CUDA only (``host_syncs = None``, ``cuda_graph =
            "skipped"`` on CPU).
        same: ``same(got, want) -> list of problems`` (empty when equal);
            default `pytree_mismatches` (exact for ints/bools, dtype tolerance
            for floats). It compares ``(output, arguments after the call)``,
            so a function that fills caller-provided buffers is compared on
            what it wrote.
        reference: ``reference(i, eager_output) -> list of problems`` of call
            ``i`` (0 = the example) against an independent reference; each is
            a ``parity`` finding.
        writable: names of top-level arguments ``fn`` may write (the buffers
            an engine's fill function fills). Writing any other input is a
            ``mutations`` finding.
        restore: resets state ``fn`` reads or writes outside its arguments
            (buffers it closes over, KV caches) in place; called before every
            run, so that a buffer's untouched entries do not carry one run's
            values into the next comparison.
        name: the row's label (default: ``fn``'s qualified name).

    Returns:
        An `AuditRow` (``scope = "callable"``) whose ``findings`` list a
        `Finding` per problem, in the column it counts in:

        * ``graph_breaks``: dynamo's break reasons (``torch._dynamo.explain``)
          and a fullgraph compile failure, each at its user line;
        * ``data_dependent``: each node of the compiled graph that introduces
          an unbacked symbol (``item``, ``tolist``, ``nonzero``, boolean-mask
          indexing, ...), at the line of its FX ``stack_trace``: a host sync
          on CUDA even when ``fullgraph=True`` accepted it;
        * ``recompiles``: every guard that failed on a variant, with the line
          that installed it (``torch._dynamo.utils.guard_failures``);
        * ``mutations``: an input not in ``writable`` whose values changed in
          an eager call, at the in-place op of the graph that wrote it;
        * ``host_syncs`` (CUDA): each synchronizing call of the eager function
          under ``torch.cuda.set_sync_debug_mode("warn")``, at its user line,
          and a count for the compiled one;
        * ``cuda_graph`` (CUDA): a capture failure (message and user line), or
          a replay (refilled with each variant) that differs from eager;
        * ``parity``: compiled differs from eager on some call, or eager from
          the reference.

        torch's own warnings are held back while it runs (the findings say
        what they would).

    Raises:
        TypeError, ValueError: ``example``/``variants`` malformed (named; see
            `check_call_layout`).
        EagerCallFailed: ``fn`` raised when run eagerly on a call.
    """
    start = time.perf_counter()
    calls = check_call_layout(example, variants)
    writable = set(writable)
    same = same or pytree_mismatches
    leaves = [x for x in _pytree.tree_leaves(_expand(calls[0])) if isinstance(x, torch.Tensor)]
    if device is None:
        device = "cuda" if any(x.is_cuda for x in leaves) else "cpu"
    label = name or getattr(fn, "__qualname__", None) or type(fn).__name__
    with _quiet_torch():
        return _audit(fn, calls, label=label, start=start, compile_backend=compile_backend,
                      device=device,
                      same=same, reference=reference, writable=writable, restore=restore)


def _audit(fn: Callable, calls: list, *, label: str, start: float, compile_backend: str,
           device: str,
           same: Callable, reference: Optional[Callable], writable: set,
           restore: Callable) -> AuditRow:
    """The runs behind `audit_callable`, on checked ``calls``."""
    findings: list = []

    # 1. Eager: the reference observations, and inputs written.
    eager_obs, mutated = [], {}
    for i, call in enumerate(calls):
        fresh = _clone(call)
        restore()
        try:
            out = _call(fn, fresh)
        except Exception as exc:
            what = "the example" if i == 0 else f"variants[{i - 1}]"
            raise EagerCallFailed(f"{label} raised {type(exc).__name__} on {what} (eager): "
                                  f"{exc}") from exc
        eager_obs.append(_clone((out, fresh)))
        for (arg, before), (_, after) in zip(_argument_names(fn, call), _argument_names(fn, fresh)):
            if arg not in writable and arg not in mutated and pytree_mismatches(after, before,
                                                                                 rtol=0, atol=0):
                mutated[arg] = True
        if reference is not None:
            findings += [Finding("parity", "vs reference", None, None, f"call {i}: {m}")
                         for m in reference(i, eager_obs[i][0])]

    # 2. Graph breaks as dynamo's explain sees them.
    sites: dict = {}
    try:
        restore()
        _, breaks = graph_break_sites(fn, *_clone(calls[0])[0], **_clone(calls[0])[1])
        for reason, frame in breaks:
            head, _, rest = reason.strip().partition("\n")
            f = _frame_finding("graph_breaks", head.strip(), " ".join(rest.split())
                               or "graph break", frame)
            sites.setdefault((f.file, f.line), f)
    except Exception as exc:  # explain itself failed: report, go on
        f = _failure_finding(exc)
        sites.setdefault((f.file, f.line), f)

    # 3. fullgraph compile on the example and each variant: parity, recompiles,
    #    data-dependent nodes, in-place ops on inputs.
    torch._dynamo.reset()
    counter = RecordingBackend(compile_backend)
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    compiles = True
    for i, call in enumerate(calls):
        fresh = _clone(call)
        restore()
        try:
            out = _call(compiled, fresh)
        except Exception as exc:  # a fullgraph failure is a finding, not a crash
            f = _failure_finding(exc)
            sites.setdefault((f.file, f.line), f)
            compiles = False
            break
        for m in same((out, fresh), eager_obs[i]):
            findings.append(Finding("parity", "compiled vs eager", None, None,
                                    f"call {i}: {m}"))
    findings = list(sites.values()) + findings
    reasons = recompile_reasons()
    recompiles = max(counter.frame_count - 1, 0)
    findings += [Finding("recompiles", "guard failed", file, line, guard, code)
                 for guard, file, line, code in reasons]
    if recompiles and not reasons:
        findings.append(Finding("recompiles", "recompile", None, None,
                                f"{recompiles} recompiles, no guard failure recorded"))
    findings += [_site_finding("data_dependent", op, "data-dependent value (a host sync on "
                               "CUDA; an unbacked symbol in the graph)", where)
                 for op, where in counter.data_dependent_sites]
    for arg in mutated:
        ops = [(op, where) for inp, op, where in counter.inplace_on_inputs
               if inp.lower().startswith(f"l_{arg.lower()}_")]
        op, where = ops[0] if ops else ("write", None)
        findings.append(_site_finding("mutations", op, f"input {arg!r} is written "
                                      "(pass writable=[...] if it is an output buffer)", where))

    # 4. CUDA only: host syncs, capture, replay on every variant.
    host_syncs, cuda_graph = None, ("skipped" if compiles else "fail")
    if compiles and device != "cpu" and torch.cuda.is_available():
        restore()
        eager_syncs = host_sync_sites(fn, *_clone(calls[0])[0], **_clone(calls[0])[1])
        restore()
        compiled_syncs = host_sync_sites(compiled, *_clone(calls[0])[0], **_clone(calls[0])[1])
        host_syncs = len(eager_syncs) + len(compiled_syncs)
        seen = set()
        for message, frame in eager_syncs:
            f = _frame_finding("host_syncs", "synchronizing call", " ".join(message.split()),
                               frame)
            if (f.file, f.line) not in seen:
                seen.add((f.file, f.line))
                findings.append(f)
        if compiled_syncs:
            findings.append(Finding("host_syncs", "synchronizing call (compiled)", None, None,
                                    f"{len(compiled_syncs)} in 2 compiled calls"))
        restore()
        cuda_graph = _capture_and_replay(compiled, calls, eager_obs, same, findings, restore)
    restore()

    return AuditRow(
        mode=label, scope="callable", config={}, step=None,
        graph_breaks=sum(f.column == "graph_breaks" for f in findings),
        break_reasons=[f.message for f in findings if f.column == "graph_breaks"],
        recompiles=recompiles,
        data_dependent=sum(f.column == "data_dependent" for f in findings),
        host_syncs=host_syncs, cuda_graph=cuda_graph,
        parity=not any(f.column == "parity" for f in findings),
        problems=[str(f) for f in findings],
        seconds=round(time.perf_counter() - start, 2),
        mutations=len(mutated), findings=findings,
    )


def _capture_and_replay(compiled: Callable, calls: list, eager_obs: list, same: Callable,
                        findings: list, restore: Callable[[], None]) -> str:
    """Capture ``compiled`` on a copy of ``calls[0]``; refill with each call
    (variants, or the example alone), replay, compare with eager."""
    static = _clone(calls[0])
    try:
        graph, out = capture(compiled, *static[0], **static[1])
    except Exception as exc:  # report, do not abort the audit
        import traceback

        frame = user_frame(traceback.extract_tb(exc.__traceback__))
        findings.append(_frame_finding("cuda_graph", "capture", f"{type(exc).__name__}: "
                                       + (str(exc).strip().splitlines() or [""])[0], frame))
        return "fail"
    status = "ok"
    static_leaves = _pytree.tree_leaves(_expand(static))
    refills = list(range(1, len(calls))) or [0]
    for i in refills:
        new_leaves = _pytree.tree_leaves(_expand(calls[i]))
        if any(not isinstance(s, torch.Tensor) and s != n
               for s, n in zip(static_leaves, new_leaves)):
            findings.append(Finding("cuda_graph", "replay", None, None,
                                    f"variant {i} changes a Python value: not replayable"))
            status = "fail"
            continue
        for s, n in zip(static_leaves, new_leaves):
            if isinstance(s, torch.Tensor):
                s.copy_(n)
        restore()
        graph.replay()
        torch.cuda.synchronize()
        for m in same(_clone((out, static)), eager_obs[i]):
            findings.append(Finding("cuda_graph", "replay", None, None,
                                    f"replay of call {i} differs from eager: {m}"))
            status = "fail"
    return status
