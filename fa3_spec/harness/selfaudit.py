"""The project's self-audit: every builder and whole step, through `fa3_spec.audit`.

Two scopes. A "builder" row audits one metadata builder (forward mode x
configuration x draft step, or every draft step built together, ``step =
"all"``, branch semantics); its reference is the upstream-style builder, or
for ancestor semantics (``draft_attention="ancestors"``) the key-set oracle.
A "step" row audits a
whole captured step of `fa3_spec.harness.toy` (metadata + attention + LSE
merge + KV writes: the full draft iteration, verify, or extend), with FA3 on
CUDA and the torch backend on CPU; its parity is compiled vs eager (relative
error <= 1e-2 in bf16, 1e-4 in fp32). Each row is one `fa3_spec.audit.audit_callable`
run (through `fa3_spec.audit.audit_function`, which labels it), and checks its list.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional, Union

import torch

from ..audit import AuditRow, audit_function
from ..builders import build_draft_iteration_metadata
from ..config import SpecConfig
from ..modes import MODES, build_metadata
from .oracle import expected_key_slots, key_slots_read, metadata_mismatches, num_queries
from .upstream import UpstreamStyleBuilder
from .worlds import make_world

#: The draft-decode "step" of a row that builds every step together
#: (`fa3_spec.build_draft_iteration_metadata`).
ALL_STEPS = "all"


@dataclasses.dataclass(frozen=True)
class AuditCase:
    """One audited builder call: ``mode`` under ``cfg`` at draft ``step``."""

    mode: str
    cfg: SpecConfig
    step: Union[int, str] = 0  # a draft step, or ALL_STEPS
    batch_size: int = 4
    num_padding: int = 1
    scope: str = "builder"  # "builder": a metadata builder; "step": a whole step; "loop": EAGLE
    draft_attention: Optional[str] = None  # draft decode and the loop: "branch" or "ancestors"

    def __post_init__(self) -> None:
        if self.mode in ("draft_decode", LOOP) and self.draft_attention is None:
            raise ValueError(f"an AuditCase of {self.mode} needs draft_attention")

    @property
    def tree(self) -> bool:
        """Target verify audits the tree cascade when topk > 1, else the chain."""
        return self.cfg.topk > 1


def default_grid(
    page_sizes: Iterable[int] = (1, 2, 16, 64),
    topks: Iterable[int] = (1, 8),
    num_steps: int = 5,
    max_context_len: int = 256,
) -> list:
    """All modes x page sizes x topk; draft decode at its first and last step,
    and every draft step built together (``step = ALL_STEPS``); with topk > 1
    also ancestor-semantics draft decode at its last (widest) step."""
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
            for mode in MODES.values():
                steps = (0, num_steps - 2, ALL_STEPS) if mode.per_step else (0,)
                cases.extend(AuditCase(mode.name, cfg, step, draft_attention="branch")
                             for step in steps)
            if k > 1:
                cases.append(AuditCase("draft_decode", cfg, num_steps - 2,
                                       draft_attention="ancestors"))
    return cases


def step_grid(page_sizes: Iterable[int] = (1, 2, 16, 64), topks: Iterable[int] = (1, 8),
              num_steps: int = 5, max_context_len: int = 64) -> list:
    """Whole-step cases: draft iteration, verify (tree when topk > 1), extend.

    One configuration per topk (compiling whole steps costs more than
    builders): page size 2 for topk > 1 when selected (the #27360 case),
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
            cases.append(AuditCase(mode, cfg, scope="step", draft_attention="branch"))
    return cases


#: The row label of a whole EAGLE iteration (`fa3_spec.eagle.eagle_iteration`):
#: every mode's metadata, attention, tree, acceptance, commit and extend.
LOOP = "eagle_iteration"


def loop_grid(topks: Iterable[int] = (1, 8)) -> list:
    """Whole EAGLE iterations (scope ``"loop"``): the tiny models, mid-run
    states with joins and padding rows; page size 2 for topk > 1, 16 else;
    both draft semantics for topk > 1."""
    cases = []
    for k in topks:
        cfg = SpecConfig(page_size=2 if k > 1 else 16, topk=k, num_steps=4,
                         num_draft_tokens=6 if k > 1 else 4, max_bs=4, max_context_len=64)
        for attention in ("branch", "ancestors") if k > 1 else ("branch",):
            cases.append(AuditCase(LOOP, cfg, scope="loop", draft_attention=attention))
    return cases


def _builder(case: AuditCase, names: list) -> Callable:
    if case.step == ALL_STEPS:
        def build_all_steps(*tensors):
            return build_draft_iteration_metadata(case.cfg, **dict(zip(names, tensors)))

        return build_all_steps

    def build_one(*tensors):
        return build_metadata(case.mode, case.cfg, step=case.step, **dict(zip(names, tensors)))

    return build_one


def _steps_mismatches(got, want) -> list:
    """`metadata_mismatches` over the per-step metadata of a draft iteration."""
    if len(got) != len(want):
        return [f"{len(got)} steps, expected {len(want)}"]
    return [f"step {i}: {m}" for i, (g, w) in enumerate(zip(got, want))
            for m in metadata_mismatches(g, w)]


class _Subject:
    """What one audit row exercises: ``fn(*args)`` on two argument sets."""

    def __init__(self, fn, args, same, reference_problems, restore=lambda: None):
        self.fn = fn
        self.args = args  # two lists of tensors: equal shapes, other values
        self.same = same  # same(got, want) -> list of problems
        self.reference_problems = reference_problems  # (index, eager out) -> problems, or None
        self.restore = restore  # reset mutable state (KV caches) before a run


def _builder_subject(case: AuditCase, device: str) -> _Subject:
    worlds = [make_world(case.cfg, case.batch_size, num_padding=case.num_padding,
                         seed=seed, device=device) for seed in (1, 2)]
    iteration = case.step == ALL_STEPS
    mode, attention = case.mode, case.draft_attention
    step = 0 if iteration else case.step
    kwargs = [w.mode_kwargs(mode, tree=case.tree, step=step, draft_attention=attention)
              for w in worlds]
    names = [k for k, v in kwargs[0].items() if v is not None]
    reference = UpstreamStyleBuilder(case.cfg, device)
    steps = range(case.cfg.num_steps - 1) if iteration else [case.step]
    same = _steps_mismatches if iteration else metadata_mismatches

    def reference_problems(i, eager):
        if attention == "ancestors":  # no upstream builder: the key-set oracle
            want = expected_key_slots(worlds[i], mode, step=step, draft_attention=attention)
            read = key_slots_read(eager, num_queries(worlds[i], mode))
            return [] if read == want else ["vs the key-set oracle: other keys read"]
        want = [reference.build(mode, step=s, **kwargs[i]) for s in steps]
        return [f"vs reference: {m}" for m in same(eager, want if iteration else want[0])]

    return _Subject(_builder(case, names), [[kw[n] for n in names] for kw in kwargs],
                    same, reference_problems)


def _step_subject(case: AuditCase, device: str) -> _Subject:
    from ..attention import resolve_attention_backend
    from .toy import ToyModel, make_step, step_inputs, world_batch
    from .worlds import rebase_world

    cfg = case.cfg
    step_mode = case.mode
    on_gpu = device != "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    base = make_world(cfg, case.batch_size, num_padding=case.num_padding, seed=1, device=device)
    worlds = [base, rebase_world(make_world(cfg, case.batch_size, num_padding=case.num_padding,
                                            seed=2, device=device), base.req_to_token)]
    model = ToyModel.create(layers=1, num_pages=base.num_pages, page_size=cfg.page_size,
                            num_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype, device=device)
    initial = (model.k_cache.clone(), model.v_cache.clone())
    attention_backend = resolve_attention_backend("auto", device)
    step = make_step(step_mode, cfg, model, base.req_to_token, attention_backend=attention_backend,
                     tree=case.tree)
    names = list(step_inputs(step_mode, tree=case.tree))
    g = torch.Generator().manual_seed(0)
    rows = cfg.topk if step_mode == "draft_decode" else cfg.num_draft_tokens
    args = []
    for w in worlds:
        hidden = torch.randn(case.batch_size, rows, model.hidden, generator=g).to(device, dtype)
        batch = world_batch(step_mode, w, hidden, tree=case.tree)
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

    return _Subject(fn, args, same, None, restore)


def _loop_subject(case: AuditCase, device: str) -> _Subject:
    """Two mid-run states of the EAGLE loop (after 1 and 2 iterations: same
    shapes, other values), the iteration as a function of the state tensors."""
    import dataclasses as dc

    from ..eagle import EagleEngine, LoopConfig, eagle_iteration, make_models
    from ..eagle.cli import workload

    cfg = case.cfg
    models = make_models("tiny", seed=0, device=device,
                         dtype=torch.bfloat16 if device != "cpu" else torch.float32)
    spec = dc.replace(cfg, num_pages=cfg.pool_pages(2 * cfg.max_bs, case.draft_attention))
    lc = LoopConfig(spec, max_new_tokens=24,
                    attention_backend="auto" if device != "cpu" else "torch",
                    draft_attention=case.draft_attention)
    engine = EagleEngine(lc, models, device=device)
    prompts, news = workload(cfg.max_bs - 1, page_size=cfg.page_size, max_prompt=32, max_new=24,
                             vocab=512, seed=0)
    for prompt, m in zip(prompts, news):
        engine.submit(prompt, m)
    states = []
    for _ in range(2):
        engine.step()
        states.append({k: v.clone() for k, v in engine.state.items()})
    pool = engine.pool
    names = sorted(states[0])
    kv = [pool.target_kv.k, pool.target_kv.v, pool.draft_kv.k, pool.draft_kv.v]
    initial = [t.clone() for t in kv]

    def restore():
        for t, s0 in zip(kv, initial):
            t.copy_(s0)

    def fn(*tensors):
        st = {n: t.clone() for n, t in zip(names, tensors)}
        out = eagle_iteration(lc, models, pool.target_kv, pool.draft_kv, pool.req_to_token, st)
        return [out[n] for n in names]

    def same(got, want):
        for n, g, w in zip(names, got, want):
            if g.is_floating_point():
                err = float((g.float() - w.float()).norm() / w.float().norm().clamp(min=1e-6))
                if not torch.isfinite(g).all() or err > 1e-2:
                    return [f"{n}: relative error {err:.2e}"]
            elif not torch.equal(g, w):
                return [f"{n} differs"]
        return []

    return _Subject(fn, [[st[n] for n in names] for st in states], same, None, restore)


def audit_case(case: AuditCase, *, compile_backend: str = "aot_eager",
               device: str = "cpu") -> AuditRow:
    """Audit one case (`fa3_spec.audit.audit_function`: `audit_callable`, labelled)."""
    cfg = case.cfg
    subject = {"builder": _builder_subject, "step": _step_subject,
               "loop": _loop_subject}[case.scope](case, device)
    return audit_function(
        subject.fn, subject.args, same=subject.same,
        reference_problems=subject.reference_problems, restore=subject.restore,
        compile_backend=compile_backend, device=device, mode=case.mode, scope=case.scope,
        config=dict(page_size=cfg.page_size, topk=cfg.topk, num_steps=cfg.num_steps,
                    num_draft_tokens=cfg.num_draft_tokens,
                    tree=case.tree if case.mode == "target_verify" else None,
                    draft_attention=(case.draft_attention
                                     if case.mode in ("draft_decode", LOOP) else None)),
        step=case.step if case.mode == "draft_decode" and case.scope == "builder" else None,
    )


