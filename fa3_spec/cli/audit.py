"""``fa3-spec audit``: the self-audit of every builder, step and iteration, or any
function with ``--callable``. The EAGLE engine is imported only by the rows that
audit an EAGLE iteration, when they run."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

import torch

from ..modes import MODES
from .usage import UsageError, at_least, check_compile_backend, check_writable, usage_exit

AUDIT_HELP = """\
Audit every metadata builder, whole step and EAGLE iteration (61 rows by
default), or, with --callable and --inputs, any function: graph breaks,
recompiles when only values change, data-dependent ops, input mutations,
parity, and on CUDA host syncs and CUDA-graph capture + replay.

Exit status: 0 when every row is clean; 1 when a row is unclean; 2 for an
invalid invocation (one line naming the problem, no traceback): a flag that
needs another (--inputs, --writable without --callable), a --writable name
that is not an argument of the example call, a module that does not import
(whatever its import raises), a function or factory that the module does
not have or that does not run, variants whose structure, shapes or dtypes
differ from the example, a function that raises on its own example,
--device cuda without CUDA, sizes out of range."""


def _usage(problem: object):
    usage_exit("audit", problem)


def _load(spec: str, flag: str):
    """``package.module:attribute`` -> the attribute (the module is imported)."""
    import importlib
    import os

    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        _usage(f"{flag} must be package.module:name, got {spec!r}")
    if os.getcwd() not in sys.path:  # as `python3 -m` would: modules of the current directory
        sys.path.insert(0, os.getcwd())
    try:  # the module's own code runs: whatever it raises is the user's to see, in one line
        obj = importlib.import_module(module)
    except Exception as exc:
        _usage(f"cannot load {flag} {spec!r}: importing module {module!r} raised "
               f"{type(exc).__name__}: {exc}")
    try:
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # AttributeError, or what a module's __getattr__ raises
        _usage(f"cannot load {flag} {spec!r}: {type(exc).__name__}: {exc}")
    return obj


def _argument_names(fn, call: tuple) -> list:
    """The names `audit_callable` gives a call's top-level arguments, which
    ``writable`` refers to: positional ones after ``fn``'s parameters (``arg<i>``
    past them, or without a signature), keyword ones by their keys."""
    import inspect

    args, kwargs = call
    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"arg{i}" for i in range(len(args))] + list(kwargs)


def _audit_callable(args: argparse.Namespace, device: str) -> int:
    """``--callable module:fn --inputs module:factory``: one `audit_callable` row."""
    import inspect

    from ..audit import EagerCallFailed, audit_callable, check_call_layout, format_table

    if not args.inputs:
        _usage("--callable needs --inputs package.module:factory")
    fn, factory = _load(args.callable, "--callable"), _load(args.inputs, "--inputs")
    try:
        takes_device = "device" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes_device = False
    try:
        made = factory(device=device) if takes_device else factory()
    except Exception as exc:
        _usage(f"{args.inputs} raised {type(exc).__name__}: {exc}")
    if not (isinstance(made, tuple) and len(made) == 2):
        _usage(f"{args.inputs} must return (example, variants)")
    example, variants = made
    try:
        variants = list(variants)  # a generator would be used up by the count below
        calls = check_call_layout(example, variants)
    except (TypeError, ValueError) as exc:
        _usage(f"{args.inputs}: {exc}")
    names = _argument_names(fn, calls[0])
    unknown = [w for w in args.writable if w not in names]
    if unknown:
        _usage(f"--writable {', '.join(map(repr, unknown))}: no such argument in the example "
               f"call of {args.callable} (from {args.inputs}); its arguments: "
               f"{', '.join(sorted(names))}")
    print(f"fa3-spec audit: {args.callable}, {len(variants)} variants, torch "
          f"{torch.__version__}, device {device}, backend {args.compile_backend}", flush=True)
    try:
        row = audit_callable(fn, example, variants=variants, compile_backend=args.compile_backend,
                             device=device, writable=args.writable, name=args.callable)
    except EagerCallFailed as exc:  # nothing can be measured on a call that does not run
        _usage(exc)
    print(format_table([row]))
    if row.host_syncs is None:
        print("host syncs and CUDA-graph capture: not measured on CPU "
              "(run with --device cuda on a CUDA machine)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([row.to_json()], fh, indent=1)
        print(f"wrote {args.json}")
    return 0 if row.clean else 1


def _audit(args: argparse.Namespace) -> int:
    from ..audit import format_table
    from ..harness.selfaudit import audit_case, default_grid, loop_grid, step_grid

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        _usage(f"--device must be cpu, cuda or auto, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        _usage("--device cuda: no CUDA device is available")
    try:
        check_compile_backend("--compile-backend", args.compile_backend)
        if args.json:
            check_writable("--json", args.json)
    except UsageError as exc:
        _usage(exc)
    if args.callable:
        return _audit_callable(args, device)
    for flag, value in (("--inputs", args.inputs), ("--writable", args.writable)):
        if value:
            _usage(f"{flag} goes with --callable")
    cases = default_grid(page_sizes=args.page_sizes, topks=args.topks, num_steps=args.num_steps)
    if not args.no_steps:
        cases += step_grid(page_sizes=args.page_sizes, topks=args.topks, num_steps=args.num_steps)
        cases += loop_grid(topks=args.topks)
    if args.modes:
        cases = [c for c in cases if c.mode in args.modes]
    print(
        f"fa3-spec audit: {len(cases)} cases, torch {torch.__version__}, device {device}, "
        f"backend {args.compile_backend}",
        flush=True,
    )
    rows = []
    for i, case in enumerate(cases, 1):
        row = audit_case(case, compile_backend=args.compile_backend, device=device)
        rows.append(row)
        if args.verbose:
            print(f"[{i}/{len(cases)}] {case.mode} P={case.cfg.page_size} K={case.cfg.topk} "
                  f"step={case.step}: {'clean' if row.clean else 'UNCLEAN'}", flush=True)
    print(format_table(rows))
    if device == "cpu":
        print("host syncs and CUDA-graph capture: not measured (no CUDA device)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([r.to_json() for r in rows], fh, indent=1)
        print(f"wrote {args.json}")
    return 0 if all(r.clean for r in rows) else 1


def add_parser(subparsers, help: Optional[str] = None) -> argparse.ArgumentParser:
    """Register ``audit`` on the ``fa3-spec`` command's subparsers."""
    audit = subparsers.add_parser("audit", help=help, description=AUDIT_HELP,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    audit.add_argument("--callable", metavar="MODULE:FUNCTION",
                       help="audit this function instead of fa3_spec's builders")
    audit.add_argument("--inputs", metavar="MODULE:FACTORY",
                       help="with --callable: factory() (or factory(device=...)) returning "
                       "(example, variants); each a tuple of positional or dict of keyword args")
    audit.add_argument("--writable", nargs="+", default=[], metavar="ARG",
                       help="with --callable: arguments the function may write (output buffers), "
                       "by the names of its parameters (arg<i> for a positional one past them) "
                       "or the keys of a keyword example")
    audit.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    audit.add_argument("--compile-backend", default="aot_eager",
                       help="torch.compile backend (aot_eager, inductor, eager)")
    audit.add_argument("--device", default="auto", help="cpu, cuda or auto")
    audit.add_argument("--page-sizes", type=at_least(1), nargs="+", default=[1, 2, 16, 64])
    audit.add_argument("--topks", type=at_least(1), nargs="+", default=[1, 8])
    audit.add_argument("--num-steps", type=at_least(2), default=5,
                       help="draft steps S (>= 2: the grid audits draft-decode steps 0 and S-2)")
    audit.add_argument("--modes", nargs="+", choices=list(MODES))
    audit.add_argument("--no-steps", action="store_true",
                       help="skip the whole-step rows (metadata + attention + merge) and the "
                       "EAGLE-iteration rows")
    audit.add_argument("-v", "--verbose", action="store_true")
    return audit


run = _audit
