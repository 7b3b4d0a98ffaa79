"""Audit a function for CUDA-graph readiness: the engine behind ``fa3-spec audit``.

`audit_function` takes a function and two (or more) argument lists of equal
shapes and dtypes but different values, and reports, as one `AuditRow`:

1. graph breaks when dynamo traces it, with their reasons;
2. recompiles when only values change (a second compiled frame), and every
   data-dependent node of the graph (``item``, unbacked symbols from
   ``nonzero`` or value-sized shapes): each is a host sync on CUDA;
3. parity: the compiled function equals eager on every argument list, and
   eager equals a reference (both comparisons supplied by the caller);
4. on CUDA only: host syncs of an eager and a compiled run under
   ``torch.cuda.set_sync_debug_mode("warn")``, then a CUDA-graph capture of
   the compiled function on the first argument list, refilled with the
   second, replayed and compared with eager. On CPU these are reported as
   not measured (``host_syncs = None``, ``cuda_graph = "skipped"``).

The project's self-audit (`fa3_spec.harness.selfaudit`) runs it on every
builder and whole step.

`audit_callable` is the same audit for anyone's function (an engine's own
metadata code): it takes one example call and variants of it (same shapes and
dtypes, other values), compares compiled with eager itself (pytree-wise by
default), also checks that inputs are not written unless declared writable,
and returns one row whose ``findings`` give, for every problem, the column it
counts in, the file, line and op, and a message (`Finding`). The CLI is
``fa3-spec audit --callable module:function --inputs module:factory``.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import time
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch.utils import _pytree

from . import _validate
from .probes import (RecordingBackend, capture, count_host_syncs, graph_break_sites,
                     graph_breaks, host_sync_sites, recompile_reasons, user_frame)

#: The columns a `Finding` can count in (``AuditRow`` fields of the same names).
COLUMNS = ("graph_breaks", "data_dependent", "recompiles", "mutations", "host_syncs",
           "cuda_graph", "parity")


@dataclasses.dataclass
class Finding:
    """One problem, with what is needed to fix it.

    Attributes:
        column: the `AuditRow` column it counts in (one of `COLUMNS`).
        op: the operation (``item``, ``nonzero``, ``add_``, a guard, ...).
        file, line: where it is in the user's source (None when unknown).
        code: that source line, stripped ("" when unknown).
        message: what torch said, or what the audit saw.
    """

    column: str
    op: str
    file: Optional[str]
    line: Optional[int]
    message: str
    code: str = ""

    def __str__(self) -> str:
        where = f"{os.path.basename(self.file)}:{self.line}" if self.file else "?"
        text = f"{self.column:<14} {where:<28} {self.op}: {self.message}"
        return text + (f"   | {self.code}" if self.code else "")


@dataclasses.dataclass
class AuditRow:
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
    reference_problems: Callable[[int, object], list] = lambda i, out: [],
    restore: Callable[[], None] = lambda: None,
    backend: str = "aot_eager",
    device: str = "cpu",
    mode: str = "function",
    scope: str = "function",
    config: Optional[dict] = None,
    step: Optional[int] = None,
) -> "AuditRow":
    """Audit ``fn(*args[i])``; see the module docstring for what is checked.

    Args:
        fn: the function, taking positional tensors.
        args: at least two argument lists, equal shapes/dtypes, other values.
        same: ``same(got, want) -> list of problems`` (empty when equal).
        reference_problems: ``(i, eager_output) -> problems`` against an
            independent reference (optional).
        restore: resets mutable state (e.g. KV caches) before each run.
        backend: ``torch.compile`` backend for the compiled runs.
        device: ``"cpu"`` or ``"cuda"``: host syncs and capture on CUDA only.
        mode, scope, config, step: labels copied into the row.
    """
    start = time.perf_counter()
    parity_problems, other = [], []

    restore()
    breaks, reasons = graph_breaks(fn, *args[0])
    counter = RecordingBackend(backend)
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    compiles = True
    for i, arg in enumerate(args):
        restore()
        eager = fn(*arg)
        parity_problems += reference_problems(i, eager)
        restore()
        try:
            got = compiled(*arg)
        except Exception as exc:  # a fullgraph failure is a finding, not a crash
            parity_problems.append(
                f"fullgraph compile failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            compiles = False
            break
        parity_problems += [f"compiled vs eager: {m}" for m in same(got, eager)]
    recompiles = max(counter.frame_count - 1, 0)
    other += [f"data-dependent op: {op}" + (f" at {os.path.basename(w[0])}:{w[1]}" if w else "")
              for op, w in counter.data_dependent_sites]

    host_syncs, cuda_graph = None, ("skipped" if compiles else "fail")
    if compiles and device != "cpu" and torch.cuda.is_available():
        syncs = []
        for f in (fn, compiled):
            restore()
            syncs.append(count_host_syncs(f, *args[0]))
        host_syncs = sum(n for n, _ in syncs)
        other += [f"host sync: {m}" for _, msgs in syncs for m in msgs[:3]]
        try:
            restore()
            want = fn(*args[1])
            restore()
            cuda_graph = _capture_and_replay(compiled, args[0], args[1], want, same, restore)
        except Exception as exc:  # report, do not abort the audit
            cuda_graph = "fail"
            other.append(f"capture: {type(exc).__name__}: {exc}")
    restore()

    return AuditRow(
        mode=mode,
        scope=scope,
        config=dict(config or {}),
        step=step,
        graph_breaks=breaks,
        break_reasons=reasons,
        recompiles=recompiles,
        data_dependent=len(counter.data_dependent_sites),
        host_syncs=host_syncs,
        cuda_graph=cuda_graph,
        parity=not parity_problems,
        problems=parity_problems + other,
        seconds=round(time.perf_counter() - start, 2),
    )


def _capture_and_replay(fn: Callable, args_a, args_b, expected, same: Callable,
                        restore: Callable) -> str:
    """Capture ``fn`` on copies of ``args_a``, refill with ``args_b``, replay, compare."""
    static = [a.clone() for a in args_a]
    graph, out = capture(fn, *static)
    for dst, src in zip(static, args_b):
        dst.copy_(src)
    restore()  # e.g. reset KV caches the warm-up runs wrote into
    graph.replay()
    torch.cuda.synchronize()
    return "fail" if same(out, expected) else "ok"


def format_table(rows: list) -> str:
    """A fixed-width table of audit rows, one line each, plus a summary."""
    head = f"{'mode':<16}{'scope':<8}{'P':>4}{'K':>3}{'S':>3}{'step':>5}  {'breaks':>6}{'recomp':>7}{'dd':>4}{'syncs':>6}  {'graph':<8}{'parity':<7}{'sec':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        c = r.config
        syncs = "-" if r.host_syncs is None else str(r.host_syncs)
        step = "-" if r.step is None else str(r.step)
        lines.append(
            f"{r.mode:<16}{r.scope:<8}{c['page_size']:>4}{c['topk']:>3}{c['num_steps']:>3}{step:>5}  "
            f"{r.graph_breaks:>6}{r.recompiles:>7}{r.data_dependent:>4}{syncs:>6}  {r.cuda_graph:<8}"
            f"{'yes' if r.parity else 'NO':<7}{r.seconds:>6.1f}"
        )
        for reason in r.break_reasons + r.problems:
            lines.append(f"    ! {reason}")
    bad = sum(not r.clean for r in rows)
    lines.append("-" * len(head))
    lines.append(f"{len(rows)} cases, {len(rows) - bad} clean, {bad} unclean")
    return "\n".join(lines)


# ------------------------------------------------------------------ any callable
def pytree_mismatches(got, want, *, rtol: Optional[float] = None,
                      atol: Optional[float] = None) -> list:
    """Problems (empty when equal) between two pytrees of tensors and Python values.

    Tensors: equal shape and dtype, then values exactly for integer and bool
    dtypes and within ``torch.testing.assert_close``'s dtype tolerances (or
    ``rtol``/``atol``) for floating ones, NaNs equal. Dataclasses that are not
    registered pytrees are compared field by field; other leaves with ``==``.
    """
    if dataclasses.is_dataclass(got) and not isinstance(got, type) and type(got) is type(want) \
            and _pytree._get_node_type(got) not in _pytree.SUPPORTED_NODES:
        got = {f.name: getattr(got, f.name) for f in dataclasses.fields(got)}
        want = {f.name: getattr(want, f.name) for f in dataclasses.fields(want)}
    got_leaves, got_spec = _pytree.tree_flatten(got)
    want_leaves, want_spec = _pytree.tree_flatten(want)
    if got_spec != want_spec:
        return [f"structure differs: {got_spec} vs {want_spec}"]
    problems = []
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        if isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor):
            if g.shape != w.shape or g.dtype != w.dtype:
                problems.append(f"leaf {i}: {tuple(g.shape)} {g.dtype} vs {tuple(w.shape)} {w.dtype}")
                continue
            try:
                torch.testing.assert_close(g.cpu(), w.cpu(), rtol=rtol, atol=atol, equal_nan=True)
            except AssertionError as exc:
                problems.append(f"leaf {i}: " + " ".join(str(exc).split())[:160])
        elif dataclasses.is_dataclass(g) and not isinstance(g, type):
            problems += [f"leaf {i}.{m}" for m in pytree_mismatches(g, w, rtol=rtol, atol=atol)]
        else:
            try:
                equal = bool(g == w)
            except Exception:  # e.g. objects whose == is not a bool
                equal = g is w
            if not equal:
                problems.append(f"leaf {i}: {g!r} vs {w!r}")
    return problems


def _clone(tree):
    """A copy of ``tree`` whose tensors are fresh clones (other leaves shared)."""
    return _pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


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


def audit_callable(
    fn: Callable,
    example,
    *,
    variants: Iterable = (),
    backend: str = "aot_eager",
    device: Optional[str] = None,
    same: Optional[Callable[[object, object], list]] = None,
    writable: Iterable[str] = (),
    restore: Callable[[], None] = lambda: None,
    name: Optional[str] = None,
) -> AuditRow:
    """Audit any function for ``torch.compile(fullgraph=True)`` + CUDA graphs.

    Args:
        fn: the function (or any callable) to audit.
        example: its arguments: a tuple/list of positional arguments, or a dict
            of keyword arguments. Tensors, Python values and pytrees of
            tensors (lists, tuples, dicts, registered dataclasses) are fine.
        variants: other argument values for ``fn``, each of the layout of
            ``example`` (same pytree structure; tensors of the same shapes,
            dtypes and devices). A recompile on one of them is a
            value-dependent guard; give at least one to measure recompiles.
        backend: ``torch.compile`` backend (``aot_eager``, ``eager``, ``inductor``).
        device: ``"cpu"`` or ``"cuda"``; default: ``"cuda"`` when a tensor of
            ``example`` is on CUDA. Host syncs and CUDA-graph capture are
            measured on CUDA only (``host_syncs = None``, ``cuda_graph =
            "skipped"`` on CPU).
        same: ``same(got, want) -> list of problems`` (empty when equal);
            default `pytree_mismatches` (exact for ints/bools, dtype tolerance
            for floats). It compares ``(output, arguments after the call)``,
            so a function that fills caller-provided buffers is compared on
            what it wrote.
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
        * ``parity``: compiled differs from eager on some call.

    Raises:
        TypeError, ValueError: ``example``/``variants`` malformed (named).
    """
    start = time.perf_counter()
    calls = [_validate.call_arguments("example", example)]
    for i, v in enumerate(variants):
        call = _validate.call_arguments(f"variants[{i}]", v)
        _validate.same_call_layout(f"variants[{i}]", call, calls[0])
        calls.append(call)
    writable = set(writable)
    same = same or pytree_mismatches
    leaves = [x for x in _pytree.tree_leaves(calls[0]) if isinstance(x, torch.Tensor)]
    if device is None:
        device = "cuda" if any(x.is_cuda for x in leaves) else "cpu"
    label = name or getattr(fn, "__qualname__", None) or type(fn).__name__
    findings: list = []

    # 1. Eager: the reference observations, and inputs written.
    eager_obs, mutated = [], {}
    for call in calls:
        fresh = _clone(call)
        restore()
        out = _call(fn, fresh)
        eager_obs.append(_clone((out, fresh)))
        for (arg, before), (_, after) in zip(_argument_names(fn, call), _argument_names(fn, fresh)):
            if arg not in writable and arg not in mutated and pytree_mismatches(after, before,
                                                                                 rtol=0, atol=0):
                mutated[arg] = True

    # 2. Graph breaks as dynamo's explain sees them.
    sites: dict = {}
    try:
        restore()
        _, breaks = graph_break_sites(fn, *_clone(calls[0])[0], **_clone(calls[0])[1])
        for reason, frame in breaks:
            head, _, rest = reason.strip().partition("\n")
            f = _frame_finding("graph_breaks", head[:80], " ".join(rest.split())[:200]
                               or "graph break", frame)
            sites.setdefault((f.file, f.line), f)
    except Exception as exc:  # explain itself failed: report, go on
        f = _failure_finding(exc)
        sites.setdefault((f.file, f.line), f)

    # 3. fullgraph compile on the example and each variant: parity, recompiles,
    #    data-dependent nodes, in-place ops on inputs.
    torch._dynamo.reset()
    counter = RecordingBackend(backend)
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
            f = _frame_finding("host_syncs", "synchronizing call", " ".join(message.split())[:160],
                               frame)
            if (f.file, f.line) not in seen:
                seen.add((f.file, f.line))
                findings.append(f)
        if compiled_syncs:
            findings.append(Finding("host_syncs", "synchronizing call (compiled)", None, None,
                                    f"{len(compiled_syncs)} in 2 compiled calls"))
        restore()
        cuda_graph = _capture_callable(compiled, calls, eager_obs, same, findings, restore)
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


def _capture_callable(compiled: Callable, calls: list, eager_obs: list, same: Callable,
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
    static_leaves = _pytree.tree_leaves(static)
    refills = list(range(1, len(calls))) or [0]
    for i in refills:
        new_leaves = _pytree.tree_leaves(calls[i])
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


def format_findings(rows: list) -> str:
    """A table of `audit_callable` rows, each followed by its findings."""
    head = (f"{'function':<40}{'breaks':>7}{'recomp':>7}{'dd':>4}{'mut':>4}{'syncs':>6}  "
            f"{'graph':<8}{'parity':<7}{'sec':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        syncs = "-" if r.host_syncs is None else str(r.host_syncs)
        lines.append(f"{r.mode[:39]:<40}{r.graph_breaks:>7}{r.recompiles:>7}{r.data_dependent:>4}"
                     f"{r.mutations:>4}{syncs:>6}  {r.cuda_graph:<8}"
                     f"{'yes' if r.parity else 'NO':<7}{r.seconds:>6.1f}")
        lines += [f"    ! {f}" for f in r.findings]
    bad = sum(not r.clean for r in rows)
    lines.append("-" * len(head))
    lines.append(f"{len(rows)} functions, {len(rows) - bad} clean, {bad} unclean")
    return "\n".join(lines)
