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
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional, Sequence

import torch

from .probes import RecordingBackend, capture, count_host_syncs, graph_breaks


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

    @property
    def clean(self) -> bool:
        return (
            self.graph_breaks == 0
            and self.recompiles == 0
            and self.data_dependent == 0
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
    other += [f"data-dependent op: {op}" for op in counter.data_dependent]

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
        data_dependent=len(counter.data_dependent),
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
