"""The graph-break / recompile / host-sync / capture audit behind ``fa3-spec audit``.

Two scopes. A "builder" row audits one metadata builder (forward mode x
configuration x draft step); its parity is against the upstream-style
reference. A "step" row audits a whole captured step of
`fa3_spec.iteration` (metadata + attention + LSE merge + KV writes: the full
draft iteration, verify, or extend), with FA3 on CUDA and the torch backend
on CPU; its parity is compiled vs eager (relative error <= 1e-2 in bf16,
1e-4 in fp32). For each row the audit:

1. traces the builder with ``torch._dynamo.explain`` and records graph
   breaks with their reasons;
2. compiles it with ``fullgraph=True`` and runs it on two worlds of equal
   shapes but different values; more than one compiled frame is a recompile;
   every data-dependent node of the graph (``item``, unbacked symbols from
   ``nonzero`` or value-sized shapes) is counted: each is a host sync on CUDA;
3. checks parity: compiled == eager bitwise, and both == the upstream-style
   reference in every value FA3 reads;
4. on CUDA only: counts host syncs of an eager and a compiled run under
   ``torch.cuda.set_sync_debug_mode("warn")``, then captures the compiled
   builder in a CUDA graph, refills its inputs with the second world,
   replays, and compares with eager. On CPU these are reported as not
   measured (``host_syncs = None``, ``cuda_graph = "skipped"``).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Callable, Iterable, Optional

import torch

from .builders import build_draft_iteration_metadata
from .config import SpecConfig
from .testing import MODES, build, make_world, metadata_mismatches

#: Builder rows: the four modes, plus every draft step built together
#: (`build_draft_iteration_metadata`, checked against the per-step reference).
AUDIT_MODES = MODES + ("draft_iteration",)
from .upstream import UpstreamStyleBuilder


@dataclasses.dataclass(frozen=True)
class AuditCase:
    """One audited builder call: ``mode`` under ``cfg`` at draft ``step``."""

    mode: str
    cfg: SpecConfig
    step: int = 0
    batch_size: int = 4
    num_padding: int = 1
    scope: str = "builder"  # "builder": one metadata builder; "step": a whole step

    @property
    def tree(self) -> bool:
        """Target verify audits the tree cascade when topk > 1, else the chain."""
        return self.cfg.topk > 1


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


def default_grid(
    page_sizes: Iterable[int] = (1, 2, 16, 64),
    topks: Iterable[int] = (1, 8),
    num_steps: int = 5,
    max_context_len: int = 256,
) -> list:
    """All modes x page sizes x topk; draft decode at its first and last step,
    and the whole iteration's draft steps built together."""
    cases = []
    for p in page_sizes:
        for k in topks:
            cfg = SpecConfig(
                page_size=p,
                topk=k,
                num_steps=num_steps,
                num_draft_tokens=6 if k > 1 else 4,
                max_bs=8,
                max_context_len=max_context_len,
            )
            for mode in AUDIT_MODES:
                steps = (0, num_steps - 2) if mode == "draft_decode" else (0,)
                cases.extend(AuditCase(mode, cfg, step) for step in steps)
    return cases


def step_grid(page_sizes: Iterable[int] = (1, 2, 16, 64), topks: Iterable[int] = (1, 8),
              num_steps: int = 5, max_context_len: int = 64) -> list:
    """Whole-step cases: draft iteration, verify (tree when topk > 1), extend.

    One configuration per topk (compiling whole steps costs more than
    builders): page size 2 for topk > 1 when selected (the seed's case),
    else the first page size.
    """
    page_sizes = list(page_sizes)
    cases = []
    for k in topks:
        p = 2 if k > 1 and 2 in page_sizes else page_sizes[0]
        cfg = SpecConfig(page_size=p, topk=k, num_steps=num_steps,
                         num_draft_tokens=6 if k > 1 else 4, max_bs=8,
                         max_context_len=max_context_len)
        for mode in ("draft_decode", "target_verify", "draft_extend"):
            cases.append(AuditCase(mode, cfg, scope="step"))
    return cases


def _builder(case: AuditCase, names: list) -> Callable:
    if case.mode == "draft_iteration":
        def iteration_fn(*tensors):
            return build_draft_iteration_metadata(case.cfg, **dict(zip(names, tensors)))

        return iteration_fn

    def step_fn(*tensors):
        return build(case.mode, case.cfg, step=case.step, **dict(zip(names, tensors)))

    return step_fn


def _steps_mismatches(got, want) -> list:
    """`metadata_mismatches` over the per-step metadata of a draft iteration."""
    if len(got) != len(want):
        return [f"{len(got)} steps, expected {len(want)}"]
    return [f"step {i}: {m}" for i, (g, w) in enumerate(zip(got, want))
            for m in metadata_mismatches(g, w)]


def graph_breaks(fn: Callable, *args) -> tuple:
    """``(count, reasons)`` of graph breaks when dynamo traces ``fn(*args)``.

    Counted from the break reasons as well as ``graph_break_count``: on some
    torch versions (seen on 2.13) a break that ends the frame is listed in
    ``break_reasons`` while ``graph_break_count`` stays 0.
    """
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    reasons = [str(r.reason) for r in explained.break_reasons]
    torch._dynamo.reset()
    return max(explained.graph_break_count, len(reasons)), reasons


class RecordingBackend:
    """A ``torch.compile`` backend that audits each graph, then delegates.

    Records the number of compiled frames (``frame_count``; more than one for
    one call site means a recompile) and every data-dependent node: ``item``
    / ``tolist`` calls and any value carrying unbacked symbols (``nonzero``,
    value-sized slices, ...). Such nodes are host syncs on CUDA. The check is
    needed because recent torch versions (seen on 2.13) accept ``Tensor.item``
    under ``fullgraph=True`` by capturing it as an unbacked symbol.
    """

    def __init__(self, backend: str = "aot_eager"):
        self.backend = backend
        self.frame_count = 0
        self.data_dependent: list = []

    def __call__(self, gm, example_inputs):
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        self.frame_count += 1
        for node in gm.graph.nodes:
            value = node.meta.get("example_value")
            unbacked = free_unbacked_symbols(value) if value is not None else set()
            if (node.op == "call_method" and node.target in ("item", "tolist")) or unbacked:
                self.data_dependent.append(f"{node.op}:{getattr(node.target, '__name__', node.target)}")
        return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)


def count_host_syncs(fn: Callable, *args, calls: int = 2) -> tuple:
    """``(count, messages)`` of synchronizing CUDA calls in ``calls`` runs.

    One un-counted warm-up call comes first, so one-time process set-up
    (lazy CUDA/library initialisation) is not charged to the step.
    """
    fn(*args)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(calls):
                fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Only torch's per-call report counts, not its "prototype feature" notice.
    messages = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    return len(messages), messages


def _capture_and_replay(fn: Callable, args_a: list, args_b: list, expected,
                        same: Optional[Callable] = None,
                        before_replay: Callable = lambda: None) -> str:
    from .graphs import capture

    static = [a.clone() for a in args_a]
    graph, out = capture(fn, *static)
    for dst, src in zip(static, args_b):
        dst.copy_(src)
    before_replay()  # e.g. reset KV caches the warm-up runs wrote into
    graph.replay()
    torch.cuda.synchronize()
    if same is None:
        return "ok" if not metadata_mismatches(out, expected) else "fail"
    return "ok" if same(out, expected) else "fail"


class _Subject:
    """What one audit row exercises: ``fn(*args)`` on two argument sets."""

    def __init__(self, fn, args, same, reference_problems, restore=lambda: None):
        self.fn = fn
        self.args = args  # two lists of tensors: equal shapes, other values
        self.same = same  # same(got, want) -> list of problems
        self.reference_problems = reference_problems  # (index, eager out) -> problems
        self.restore = restore  # reset mutable state (KV caches) before a run


def _builder_subject(case: AuditCase, device: str) -> _Subject:
    worlds = [make_world(case.cfg, case.batch_size, num_padding=case.num_padding,
                         seed=seed, device=device) for seed in (1, 2)]
    iteration = case.mode == "draft_iteration"
    mode = "draft_decode" if iteration else case.mode
    kwargs = [w.mode_kwargs(mode, tree=case.tree) for w in worlds]
    names = [k for k, v in kwargs[0].items() if v is not None]
    reference = UpstreamStyleBuilder(case.cfg, device)
    steps = range(case.cfg.num_steps - 1) if iteration else [case.step]
    same = _steps_mismatches if iteration else metadata_mismatches

    def reference_problems(i, eager):
        want = [reference.build(mode, step=s, **kwargs[i]) for s in steps]
        return [f"vs reference: {m}" for m in same(eager, want if iteration else want[0])]

    return _Subject(_builder(case, names), [[kw[n] for n in names] for kw in kwargs],
                    same, reference_problems)


def _step_subject(case: AuditCase, device: str) -> _Subject:
    from .attention import fa3_available
    from .iteration import STEP_MODES, ToyModel, make_step, world_batch
    from .testing import rebase_world

    cfg = case.cfg
    step_mode = case.mode if case.mode != "target_verify" or case.tree else "target_verify_chain"
    on_gpu = device != "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    base = make_world(cfg, case.batch_size, num_padding=case.num_padding, seed=1, device=device)
    worlds = [base, rebase_world(make_world(cfg, case.batch_size, num_padding=case.num_padding,
                                            seed=2, device=device), base.req_to_token)]
    model = ToyModel.create(layers=1, num_pages=base.num_pages, page_size=cfg.page_size,
                            num_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype, device=device)
    initial = (model.k_cache.clone(), model.v_cache.clone())
    backend = "fa3" if on_gpu and fa3_available() else "torch"
    step = make_step(step_mode, cfg, model, base.req_to_token, backend=backend)
    names = list(STEP_MODES[step_mode])
    g = torch.Generator().manual_seed(0)
    rows = cfg.topk if step_mode == "draft_decode" else cfg.num_draft_tokens
    args = []
    for w in worlds:
        hidden = torch.randn(case.batch_size, rows, model.hidden, generator=g).to(device, dtype)
        batch = world_batch(step_mode, w, hidden)
        args.append([batch[n] for n in names])

    def restore():
        model.k_cache.copy_(initial[0])
        model.v_cache.copy_(initial[1])

    def fn(*tensors):
        return step(**dict(zip(names, tensors)))

    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4

    def same(got, want):
        if not torch.isfinite(got).all():
            return ["non-finite output"]
        err = float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-6))
        return [] if err <= tol else [f"relative error {err:.2e} > {tol:.0e}"]

    return _Subject(fn, args, same, lambda i, eager: [], restore)


def audit_case(case: AuditCase, *, backend: str = "aot_eager", device: str = "cpu") -> AuditRow:
    """Audit one case; see the module docstring for what is checked."""
    start = time.perf_counter()
    cfg = case.cfg
    subject = (_step_subject if case.scope == "step" else _builder_subject)(case, device)
    fn, args = subject.fn, subject.args
    parity_problems, other = [], []

    subject.restore()
    breaks, reasons = graph_breaks(fn, *args[0])
    counter = RecordingBackend(backend)
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    compiles = True
    for i, arg in enumerate(args):
        subject.restore()
        eager = fn(*arg)
        parity_problems += subject.reference_problems(i, eager)
        subject.restore()
        try:
            got = compiled(*arg)
        except Exception as exc:  # a fullgraph failure is a finding, not a crash
            parity_problems.append(
                f"fullgraph compile failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            compiles = False
            break
        parity_problems += [f"compiled vs eager: {m}" for m in subject.same(got, eager)]
    recompiles = max(counter.frame_count - 1, 0)
    other += [f"data-dependent op: {op}" for op in counter.data_dependent]

    host_syncs, cuda_graph = None, ("skipped" if compiles else "fail")
    if compiles and device != "cpu" and torch.cuda.is_available():
        syncs = []
        for f in (fn, compiled):
            subject.restore()
            syncs.append(count_host_syncs(f, *args[0]))
        host_syncs = sum(n for n, _ in syncs)
        other += [f"host sync: {m}" for _, msgs in syncs for m in msgs[:3]]
        try:
            subject.restore()
            want = fn(*args[1])
            subject.restore()
            cuda_graph = _capture_and_replay(compiled, args[0], args[1], want,
                                             same=lambda a, b: not subject.same(a, b),
                                             before_replay=subject.restore)
        except Exception as exc:  # report, do not abort the audit
            cuda_graph = "fail"
            other.append(f"capture: {type(exc).__name__}: {exc}")
    subject.restore()

    return AuditRow(
        mode=case.mode,
        scope=case.scope,
        config=dict(
            page_size=cfg.page_size,
            topk=cfg.topk,
            num_steps=cfg.num_steps,
            num_draft_tokens=cfg.num_draft_tokens,
            tree=case.tree if case.mode == "target_verify" else None,
        ),
        step=case.step if case.mode == "draft_decode" and case.scope == "builder" else None,
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
