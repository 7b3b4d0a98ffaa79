"""The GPU tests in batches, each short enough for one run on a GPU machine, and
their results merged into one report.

The GPU tests are the tests marked ``gpu`` (every test that skips without CUDA
carries the marker; test_gpu_suite_script.py checks it). They are split into n
batches by an estimate of each test's time (`SECONDS`): a file stays whole
unless it alone outweighs a batch's share, then its tests are placed one by one,
longest first, each into the lightest batch so far. The split depends only on
the collected node ids and n, so ``--batch i/n`` for i = 1..n runs every GPU
test exactly once::

    python3 compile_tests/gpu_suite.py plan [N]                 # the batches and their estimates
    python3 compile_tests/gpu_suite.py --batch 1/8 --out DIR    # run batch 1 of 8
    python3 compile_tests/gpu_suite.py merge DIR... [--markdown]

A batch writes, into ``--out``, pytest's JUnit XML (captured output included)
and a JSON summary: the commit (``FA3_SPEC_COMMIT`` if set, else ``git rev-parse HEAD``),
device, torch and FA3 versions, every test's outcome and time, per-file counts.
The summary is rewritten after every test, so a run cut short still reports
what ran. ``--budget SECONDS`` starts no test expected to end past that many
seconds; the rest are reported as not run. ``merge`` reads the summaries,
prints per-file counts (``--markdown``: the rows of GPU_RESULTS.md's table)
and flags every test that never ran or ran more than once; it exits 1 if
any did, or any failed.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MARKER = "gpu"
FORMAT = 1
#: A batch's estimated seconds that `plan` aims under (with the FA3 install,
#: imports and collection, a batch then ends within ten minutes).
BATCH_SECONDS = 420
DEFAULT_SECONDS = 10.0
#: Estimated seconds per test on an H100, per file: ``(default, {test function: seconds})``.
#: From the recorded runs (GPU_RESULTS.md); ``merge`` prints measured times per file.
SECONDS = {
    "test_gpu_eagle.py": (60.0, {
        "test_llama3_8b_shapes_compiled_by_default_match_greedy_up_to_near_ties": 240.0,
        "test_inductor_with_a_dynamic_batch_matches_greedy_up_to_near_ties": 120.0,
        "test_inductor_with_an_unbacked_batch_shares_bucket_one_and_matches_greedy": 120.0,
        "test_tiny_compiled_by_default_in_one_static_frame_matches_greedy_up_to_near_ties": 90.0,
        "test_llama3_8b_shapes_match_greedy_up_to_near_ties": 60.0,
        "test_tiny_bf16_matches_greedy_up_to_near_ties": 25.0,
        "test_eager_iteration_has_zero_host_syncs": 20.0,
    }),
    "test_gpu_runner.py": (15.0, {
        "test_inductor_draft_iteration_capture": 90.0,
        "test_one_compile_serves_all_buckets_above_one": 60.0,
    }),
    "test_gpu_memcheck.py": (90.0, {}),   # under compute-sanitizer
    "test_gpu_limits.py": (30.0, {}),
    "test_eagle_sampling.py": (120.0, {}),
    "test_bucket_shapes.py": (30.0, {}),
    "test_gpu_audit_callable.py": (10.0, {}),
    "test_gpu_rope_kv.py": (10.0, {}),
    "test_vocab.py": (15.0, {}),
    "test_gpu_gemm.py": (3.0, {}),
    "test_gpu_kv_store.py": (5.0, {}),
    "test_gpu_expand_attention.py": (10.0, {}),
    "test_swa.py": (2.0, {}),
    "test_gpu_attention.py": (1.5, {}),
    "test_gpu_attention_args.py": (1.5, {}),
}
OUTCOMES = ("passed", "failed", "skipped", "errors")
#: Set in the collecting pytest process: where `pytest_collection_finish` writes the items.
_ITEMS_ENV = "FA3_SPEC_GPU_SUITE_ITEMS"


# ---------------------------------------------------------------- collection
def pytest_collection_finish(session):
    """Hook of the collecting pytest (``-p gpu_suite``): every selected item, its
    ``gpu`` marker and the reasons of its skip / true skipif markers."""
    path = os.environ.get(_ITEMS_ENV)
    if not path:
        return
    items = []
    for item in session.items:
        skips = [m.kwargs.get("reason", "") for m in item.iter_markers("skip")]
        for m in item.iter_markers("skipif"):
            condition = m.args[0] if m.args else m.kwargs.get("condition")
            if condition is True:
                skips.append(m.kwargs.get("reason", ""))
        items.append(dict(nodeid=item.nodeid, gpu=item.get_closest_marker(MARKER) is not None,
                          skips=skips))
    pathlib.Path(path).write_text(json.dumps(items))


def collect(select: str | None = MARKER) -> list:
    """Items of ``compile_tests`` (``-m select``; None: all) as dicts
    ``{nodeid, gpu, skips}``, in collection order; pytest runs in a child process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "items.json"
        env = dict(os.environ, **{_ITEMS_ENV: str(out)})
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "compile_tests")] + [p for p in [env.get("PYTHONPATH")] if p])
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
               "-p", "gpu_suite", *(["-m", select] if select else []), "compile_tests"]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"collecting the tests failed ({done.returncode}):\n"
                               f"{done.stdout[-4000:]}{done.stderr[-4000:]}")
        return json.loads(out.read_text())


# ------------------------------------------------------------------ batching
def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def estimate(nodeid: str) -> float:
    """Estimated seconds of one test (`SECONDS`)."""
    default, per_test = SECONDS.get(file_of(nodeid), (DEFAULT_SECONDS, {}))
    return per_test.get(nodeid.split("::")[-1].split("[", 1)[0], default)


def split(nodeids: list, n: int) -> list:
    """``n`` lists of node ids, each in the given order, that together hold every
    id once. A file is one unit unless its estimate exceeds the total's n-th
    share; then each of its tests is one. Units go, longest first (ties by
    name), into the batch with the least estimated time (ties: the first); so
    the split does not depend on the order of the ids."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if len(set(nodeids)) != len(nodeids):
        raise ValueError("node ids repeat")
    by_file: dict = {}
    for nodeid in nodeids:
        by_file.setdefault(nodeid.split("::", 1)[0], []).append(nodeid)
    share = math.fsum(map(estimate, nodeids)) / n
    units = []
    for path, ids in by_file.items():
        weight = math.fsum(map(estimate, ids))
        units += [(weight, path, ids)] if weight <= share else [(estimate(i), i, [i]) for i in ids]
    load, chosen = [0.0] * n, [set() for _ in range(n)]
    for weight, _, ids in sorted(units, key=lambda u: (-u[0], u[1])):
        b = min(range(n), key=lambda j: (load[j], j))
        load[b] += weight
        chosen[b].update(ids)
    return [[i for i in nodeids if i in c] for c in chosen]


def parse_batch(text: str) -> tuple:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch takes I/N, e.g. 1/8, not {text!r}")
    if not 1 <= i <= n:
        raise argparse.ArgumentTypeError(f"--batch {text}: I must be in 1..N")
    return i, n


def smallest_n(nodeids: list, seconds: float = BATCH_SECONDS) -> int:
    """The fewest batches whose estimates all stay within ``seconds`` (or one per unit)."""
    for n in range(1, len(nodeids) + 1):
        if max(sum(map(estimate, b)) for b in split(nodeids, n)) <= seconds:
            return n
    return max(1, len(nodeids))


def digest(nodeids: list) -> str:
    return hashlib.sha256("\n".join(sorted(nodeids)).encode()).hexdigest()[:16]


# ------------------------------------------------------------------ one batch
def _commit() -> tuple:
    """``(commit, dirty)``: ``FA3_SPEC_COMMIT`` if set (dirty unknown: None), else git's
    HEAD and whether tracked files differ from it, else ``("unknown", None)``."""
    if os.environ.get("FA3_SPEC_COMMIT"):
        return os.environ["FA3_SPEC_COMMIT"], None
    try:
        def git(*args):
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout.strip()
        return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return "unknown", None


_ENVIRONMENT = r"""
import json, platform, torch
from fa3_spec.attention import provider_version
cuda = torch.cuda.is_available()
print(json.dumps(dict(device=torch.cuda.get_device_name() if cuda else "cpu",
                      capability=list(torch.cuda.get_device_capability()) if cuda else None,
                      torch=torch.__version__, cuda=torch.version.cuda,
                      fa3=provider_version() if cuda else "none", python=platform.python_version())))
"""


def environment() -> dict:
    """Device, torch, CUDA, FA3 provider and Python versions, read in a child process
    (this one runs the tests, which set Triton's mode before its first import)."""
    done = subprocess.run([sys.executable, "-c", _ENVIRONMENT], cwd=ROOT, capture_output=True,
                          text=True)
    if done.returncode != 0:
        return dict(error=done.stderr.strip().splitlines()[-1:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def file_counts(planned: list, tests: dict) -> dict:
    """``{file: {passed, failed, skipped, errors, not_run}}`` over ``planned``."""
    out: dict = {}
    for nodeid in planned:
        row = out.setdefault(nodeid.split("::", 1)[0], dict.fromkeys(OUTCOMES + ("not_run",), 0))
        outcome = tests.get(nodeid, {}).get("outcome")
        row[outcome if outcome in OUTCOMES else "not_run"] += 1
    return out


class Recorder:
    """A pytest plugin: each test's outcome and time into ``summary["tests"]``,
    the summary rewritten after every test; stops the session before a test
    expected to end past ``budget`` seconds from ``begin``."""

    def __init__(self, summary: dict, path: pathlib.Path, begin: float, budget: float | None):
        self.summary, self.path, self.begin, self.budget = summary, path, begin, budget

    def write(self):
        s = self.summary
        s["duration_s"] = round(time.perf_counter() - self.begin, 1)
        s["files"] = file_counts(s["planned"], s["tests"])
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(s, indent=1))
        tmp.replace(self.path)

    def pytest_runtest_logreport(self, report):
        row = self.summary["tests"].setdefault(report.nodeid, dict(outcome=None, duration=0.0))
        row["duration"] = round(row["duration"] + report.duration, 3)
        if report.failed:
            if row["outcome"] != "failed":  # a failed call stays failed whatever teardown does
                row["outcome"] = "failed" if report.when == "call" else "errors"
            row.setdefault("message", report.longreprtext[-2000:])
        elif report.skipped and row["outcome"] is None:
            row["outcome"] = "skipped"
            longrepr = report.longrepr
            row["message"] = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)[-500:]
        elif report.when == "call" and report.passed and row["outcome"] is None:
            row["outcome"] = "passed"

    def pytest_runtest_logfinish(self, nodeid, location):
        self.write()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        yield
        if self.budget is not None and nextitem is not None:
            ends = time.perf_counter() - self.begin + estimate(nextitem.nodeid)
            if ends > self.budget:
                self.summary["stopped"] = (f"--budget {self.budget:g}: {nextitem.nodeid} would end "
                                           f"at about {ends:.0f} s")
                item.session.shouldstop = self.summary["stopped"]
                self.write()


def run_batch(i: int, n: int, out: pathlib.Path, budget: float | None = None,
              pytest_args=()) -> int:
    begin = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    everything = [it["nodeid"] for it in collect()]
    planned = split(everything, n)[i - 1]
    stem = out / f"batch-{i}-of-{n}"
    commit, dirty = _commit()
    summary = dict(format=FORMAT, batch=[i, n], commit=commit, dirty=dirty,
                   started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   **environment(), marker=MARKER, selection=dict(count=len(everything),
                                                                  digest=digest(everything)),
                   estimate_s=round(sum(map(estimate, planned)), 1), finished=False, stopped=None,
                   exit_code=None, pytest_args=list(pytest_args), all_tests=everything, planned=planned, tests={})
    recorder = Recorder(summary, stem.with_suffix(".json"), begin, budget)
    recorder.write()
    print(f"gpu_suite: batch {i}/{n}: {len(planned)} of {len(everything)} GPU tests, "
          f"about {summary['estimate_s']:.0f} s estimated, on {summary.get('device')}", flush=True)
    if not planned:
        summary["finished"], summary["exit_code"] = True, 0
        recorder.write()
        return 0
    os.chdir(ROOT)
    code = pytest.main(["-p", "no:cacheprovider", f"--junitxml={stem.with_suffix('.xml')}",
                        "-o", "junit_logging=system-out", *pytest_args, *planned],
                       plugins=[recorder])
    summary["finished"], summary["exit_code"] = True, int(code)
    recorder.write()
    print(f"gpu_suite: wrote {stem}.json and {stem}.xml", flush=True)
    return int(code)


# --------------------------------------------------------------------- merge
def read_summaries(paths) -> list:
    """The summaries named, or found as ``batch-*.json`` in the folders named."""
    files = []
    for p in map(pathlib.Path, paths):
        files += sorted(pathlib.Path(f) for f in glob.glob(str(p / "batch-*.json"))) if p.is_dir() else [p]
    out = []
    for f in files:
        s = json.loads(f.read_text())
        s["_path"] = str(f)
        out.append(s)
    return out


def merge(summaries: list) -> dict:
    """Per-file counts over every summary, and what went wrong with the coverage:
    tests never run, tests run more than once, batches missing or repeated,
    summaries collected from different test sets, runs not finished."""
    if not summaries:
        raise ValueError("no summaries")
    expected = list(dict.fromkeys(t for s in summaries for t in s["all_tests"]))
    runs: dict = {}
    for s in summaries:
        for nodeid, row in s["tests"].items():
            if row.get("outcome") is not None:
                runs.setdefault(nodeid, []).append((s, row))
    seen_batches: dict = {}
    for s in summaries:
        seen_batches.setdefault(tuple(s["batch"]), []).append(s["_path"] if "_path" in s else "?")
    sizes = sorted({n for _, n in seen_batches})
    missing = [f"{i}/{n}" for n in sizes for i in range(1, n + 1) if (i, n) not in seen_batches]
    files: dict = {}
    for nodeid in expected + sorted(set(runs) - set(expected)):
        name = nodeid.split("::", 1)[0]
        row = files.setdefault(name, dict.fromkeys(OUTCOMES + ("not_run",), 0)
                               | dict(seconds=0.0, commits=[], devices=[], failing=[]))
        done = runs.get(nodeid, [])
        if not done:
            row["not_run"] += 1
        for s, r in done:
            row[r["outcome"] if r["outcome"] in OUTCOMES else "errors"] += 1
            row["seconds"] = round(row["seconds"] + r.get("duration", 0.0), 1)
            for key, value in (("commits", s.get("commit", "unknown")),
                               ("devices", s.get("device", "?"))):
                if value not in row[key]:
                    row[key].append(value)
            if r["outcome"] in ("failed", "errors"):
                row["failing"].append(nodeid)
    in_missing = set()
    for n in sizes:
        for i, batch in enumerate(split(expected, n), 1):
            if (i, n) not in seen_batches:
                in_missing.update(batch)
    never_run = [t for t in expected if t not in runs]
    return dict(
        files=files,
        never_run=never_run,
        never_run_in_missing_batches=[t for t in never_run if t in in_missing],
        never_run_in_batches_run=[t for t in never_run if t not in in_missing],
        ran_twice=sorted(t for t, done in runs.items() if len(done) > 1),
        unexpected=sorted(set(runs) - set(expected)),
        missing_batches=missing,
        repeated_batches=[f"{i}/{n}" for (i, n), p in sorted(seen_batches.items()) if len(p) > 1],
        batch_sizes=sizes,
        selections=sorted({s["selection"]["digest"] for s in summaries}),
        unfinished=[s.get("_path", "?") for s in summaries if not s.get("finished")],
        stopped=[f"{s['batch'][0]}/{s['batch'][1]}: {s['stopped']}" for s in summaries
                 if s.get("stopped")],
        summaries=summaries,
    )


def _result(row: dict) -> str:
    ran = row["passed"] + row["failed"] + row["skipped"] + row["errors"]
    parts = [f"{row[k]} {k}" for k in ("failed", "errors", "skipped") if row[k]]
    head = (f"{row['passed']} passed" if not row["not_run"]
            else f"{row['passed']} of {ran + row['not_run']} passed")
    tail = [f"{row['not_run']} not run"] if row["not_run"] else []
    return ", ".join([head] + parts + tail) if ran or tail else "not run"


def _short_device(name: str) -> str:
    for card in ("H200", "H100", "A100", "L40S", "B200"):
        if card in name:
            return card
    return name


def _shown_file(path: str, all_gpu: bool) -> str:
    name = path.rsplit("/", 1)[-1]
    return f"`{name}`" if all_gpu else f"`{name} -m {MARKER}`"


def report(merged: dict, markdown: bool = False) -> str:
    lines = []
    for s in sorted(merged["summaries"], key=lambda s: tuple(s["batch"])):
        lines.append(f"batch {s['batch'][0]}/{s['batch'][1]}: {s.get('commit', 'unknown')[:12]} on "
                     f"{s.get('device', '?')}, torch {s.get('torch', '?')}, FA3 {s.get('fa3', '?')}, "
                     f"{s.get('duration_s', 0):.0f} s (estimate {s.get('estimate_s', 0):.0f} s)"
                     + ("" if s.get("finished") else ", NOT FINISHED"))
    lines.append("")
    files = merged["files"]
    if markdown:
        lines += ["| file | last result | commit | notes |", "|---|---|---|---|"]
        for path, row in files.items():
            commit = ", ".join(f"`{c[:7]}`" for c in row["commits"]) or "—"
            devices = ", ".join(_short_device(d) for d in row["devices"])
            notes = "; ".join(f"`{t.split('::', 1)[1]}` failed" for t in row["failing"][:3])
            if len(row["failing"]) > 3:
                notes += f"; {len(row['failing']) - 3} more failed"
            all_gpu = path.rsplit("/", 1)[-1].startswith("test_gpu_")
            lines.append(f"| {_shown_file(path, all_gpu)} | {_result(row)} | {commit}"
                         f"{f' ({devices})' if devices else ''} | {notes} |")
    else:
        width = max(map(len, files), default=4)
        lines.append(f"{'file':<{width}}  passed failed skipped errors not_run  seconds")
        for path, row in files.items():
            lines.append(f"{path:<{width}}  {row['passed']:>6} {row['failed']:>6} {row['skipped']:>7} "
                         f"{row['errors']:>6} {row['not_run']:>7}  {row['seconds']:>7.1f}")
        total = {k: sum(r[k] for r in files.values()) for k in OUTCOMES + ("not_run",)}
        lines.append(f"{'total':<{width}}  {total['passed']:>6} {total['failed']:>6} "
                     f"{total['skipped']:>7} {total['errors']:>6} {total['not_run']:>7}")
    lines.append("")
    missing = merged["never_run_in_missing_batches"]
    if missing:
        lines.append(f"never run, in the batches missing: {len(missing)} tests")
    for key, title in (("never_run_in_batches_run", "never run, in batches that ran"),
                       ("ran_twice", "ran more than once"),
                       ("unexpected", "ran but not in the collected GPU tests"),
                       ("missing_batches", "batches missing"),
                       ("repeated_batches", "batches given twice"),
                       ("unfinished", "summaries of runs that did not finish"),
                       ("stopped", "batches stopped by --budget")):
        if merged[key] and key.endswith("_batches"):
            lines.append(f"{title}: {', '.join(merged[key])}")
        elif merged[key]:
            lines.append(f"{title} ({len(merged[key])}):")
            lines += [f"  {x}" for x in merged[key]]
    if len(merged["batch_sizes"]) > 1:
        lines.append(f"batches of different splits: n = {merged['batch_sizes']}")
    if len(merged["selections"]) > 1:
        lines.append(f"the batches collected different GPU tests (code changed between them): "
                     f"{merged['selections']}")
    failing = [t for r in files.values() for t in r["failing"]]
    if failing:
        lines.append(f"failed ({len(failing)}):")
        lines += [f"  {t}" for t in failing]
    return "\n".join(lines).rstrip() + "\n"


def clean(merged: dict) -> bool:
    """Every collected GPU test ran exactly once, from one test set, and none failed."""
    return not (merged["never_run"] or merged["ran_twice"] or merged["unexpected"]
                or len(merged["selections"]) > 1
                or any(r["failed"] or r["errors"] for r in merged["files"].values()))


# ----------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("plan", "list", "merge", "run"):
        argv.insert(0, "run")
    ap = argparse.ArgumentParser(prog="gpu_suite.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run one batch (the default command)")
    p_run.add_argument("--batch", type=parse_batch, required=True, metavar="I/N")
    p_run.add_argument("--out", type=pathlib.Path, required=True, metavar="DIR")
    p_run.add_argument("--budget", type=float, metavar="SECONDS",
                       help="start no test expected to end past this many seconds")
    p_run.add_argument("pytest_args", nargs="*", help="more pytest arguments, after --")
    p_plan = sub.add_parser("plan", help="print the batches and their estimated seconds")
    p_plan.add_argument("n", type=int, nargs="?",
                        help=f"batches (default: the fewest within {BATCH_SECONDS} s each)")
    p_list = sub.add_parser("list", help="print the GPU tests' node ids")
    p_list.add_argument("--batch", type=parse_batch, metavar="I/N")
    p_merge = sub.add_parser("merge", help="merge the batches' summaries")
    p_merge.add_argument("paths", nargs="+", metavar="DIR_OR_JSON")
    p_merge.add_argument("--markdown", action="store_true", help="rows for GPU_RESULTS.md")
    args = ap.parse_args(argv)

    if args.command == "merge":
        merged = merge(read_summaries(args.paths))
        print(report(merged, markdown=args.markdown), end="")
        return 0 if clean(merged) else 1
    if args.command == "run":
        i, n = args.batch
        return run_batch(i, n, args.out, args.budget, args.pytest_args)
    nodeids = [it["nodeid"] for it in collect()]
    if args.command == "list":
        print("\n".join(split(nodeids, args.batch[1])[args.batch[0] - 1] if args.batch else nodeids))
        return 0
    n = args.n or smallest_n(nodeids)
    for i, batch in enumerate(split(nodeids, n), 1):
        per_file: dict = {}
        for t in batch:
            per_file[file_of(t)] = per_file.get(file_of(t), 0) + 1
        print(f"batch {i}/{n}: {len(batch)} tests, about {sum(map(estimate, batch)):.0f} s: "
              + ", ".join(f"{f} ({c})" for f, c in per_file.items()))
    print(f"{len(nodeids)} GPU tests, about {sum(map(estimate, nodeids)):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
