"""compile_tests/gpu_suite.py, on CPU: its batches hold every GPU test exactly
once for any n, every test that skips without CUDA is marked ``gpu`` (so the
batches find it), a batch writes its summary and JUnit XML, and merge counts
per file and flags what never ran or ran twice."""

import json
import sys
import threading
import xml.etree.ElementTree as ET

import pytest
import torch

import children
import gpu_suite

_lock, _cache = threading.Lock(), {}


def _collected(tmp):
    """Every item of the suite with its ``gpu`` marker and skip reasons (one
    collection, shared by the tests that read it)."""
    with _lock:
        if "items" not in _cache:
            _cache["items"] = gpu_suite.collect(select=None)
        return _cache["items"]


@pytest.mark.children(job=_collected)
def test_the_batches_hold_every_gpu_test_exactly_once_for_every_n(child):
    gpu = [it["nodeid"] for it in child.result() if it["gpu"]]
    assert len(gpu) > 100 and any("test_gpu_eagle.py" in t for t in gpu)
    for n in (1, 2, 3, 4, 5, 8, 13, len(gpu), len(gpu) + 3):
        batches = gpu_suite.split(gpu, n)
        assert len(batches) == n
        flat = [t for b in batches for t in b]
        assert sorted(flat) == sorted(gpu) and len(flat) == len(set(flat)), n
        for b in batches:  # collection order kept within a batch
            assert b == sorted(b, key=gpu.index)
        assert gpu_suite.split(list(gpu), n) == batches  # deterministic
        assert gpu_suite.split(list(reversed(gpu)), n) == [b[::-1] for b in batches]
    # The default count keeps every batch within its estimate.
    n = gpu_suite.smallest_n(gpu)
    assert max(sum(map(gpu_suite.estimate, b)) for b in gpu_suite.split(gpu, n)) \
        <= gpu_suite.BATCH_SECONDS


@pytest.mark.children(job=_collected)
def test_every_test_that_skips_without_cuda_is_marked_gpu(child):
    if torch.cuda.is_available():
        pytest.skip("reads the skip markers that hold on a machine without CUDA")
    items = child.result()
    unmarked = [it["nodeid"] for it in items
                if not it["gpu"] and any("CUDA" in reason for reason in it["skips"])]
    assert not unmarked, unmarked
    # ... and every file the suite runs has its own estimate.
    assert {gpu_suite.file_of(it["nodeid"]) for it in items if it["gpu"]} <= set(gpu_suite.SECONDS)


#: ``gpu_suite.py ARGV...`` with the collection above instead of its own (the same
#: pytest collection, already tested by the tests above): argv[1] holds the items.
RUN_WITH_ITEMS = """
import json, pathlib, sys
import gpu_suite
items = json.loads(pathlib.Path(sys.argv[1]).read_text())
gpu_suite.collect = lambda select=gpu_suite.MARKER: [it for it in items if it["gpu"]]
sys.exit(gpu_suite.main(sys.argv[2:]))
"""


def _run_smallest_batch(tmp):
    items = _collected(tmp)
    gpu = [it["nodeid"] for it in items if it["gpu"]]  # what `-m gpu` collects
    n = 8
    i = 1 + min(range(n), key=lambda j: (len(gpu_suite.split(gpu, n)[j]), j))
    (tmp / "items.json").write_text(json.dumps(items))
    done = children.run([sys.executable, "-c", RUN_WITH_ITEMS, str(tmp / "items.json"),
                         "--batch", f"{i}/{n}", "--out", str(tmp / "out")], cwd=gpu_suite.ROOT,
                        env_extra={"PYTHONPATH": str(gpu_suite.ROOT / "compile_tests")})
    stem = tmp / "out" / f"batch-{i}-of-{n}"
    return dict(i=i, n=n, stdout=done.stdout, summary=json.loads(stem.with_suffix(".json").read_text()),
                cases=[c.get("name") for c in ET.parse(stem.with_suffix(".xml")).iter("testcase")])


@pytest.mark.children(job=_run_smallest_batch, heavy=True)
def test_a_batch_writes_its_summary_and_junit_xml(child):
    doc = child.result()
    s = doc["summary"]
    assert s["batch"] == [doc["i"], doc["n"]] and s["finished"] and s["exit_code"] == 0
    assert s["planned"] and set(s["planned"]) <= set(s["all_tests"])
    assert s["selection"]["count"] == len(s["all_tests"])
    assert len(doc["cases"]) == len(s["planned"]) == len(s["tests"])
    assert s["torch"] == torch.__version__ and s["commit"] and s["device"]
    expected = "skipped" if not torch.cuda.is_available() else None
    if expected:
        assert {r["outcome"] for r in s["tests"].values()} == {expected}
        assert sum(f["skipped"] for f in s["files"].values()) == len(s["planned"])


SAMPLE = """
import pytest

def test_passes():
    pass

def test_fails():
    assert False

@pytest.mark.skip(reason="not here")
def test_skips():
    pass

@pytest.fixture
def broken():
    raise RuntimeError("setup")

def test_errors(broken):
    pass

def test_after_the_budget():
    pass
"""

RECORD = """
import json, pathlib, sys, time
import pytest
import gpu_suite

tmp = pathlib.Path(sys.argv[1])
ids = [f"test_sample.py::{name}" for name in
       ("test_passes", "test_fails", "test_skips", "test_errors", "test_after_the_budget")]
summary = dict(planned=ids, tests={}, stopped=None)
gpu_suite.estimate = lambda nodeid: 1000.0 if nodeid.endswith("budget") else 0.0
recorder = gpu_suite.Recorder(summary, tmp / "summary.json", time.perf_counter(), budget=100)
pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(tmp), *ids], plugins=[recorder])
"""


def _record_sample(tmp):
    (tmp / "test_sample.py").write_text(SAMPLE)
    children.run([sys.executable, "-c", RECORD, str(tmp)], cwd=tmp,
                 env_extra={"PYTHONPATH": str(gpu_suite.ROOT / "compile_tests")}, check=False)
    return json.loads((tmp / "summary.json").read_text())


@pytest.mark.children(job=_record_sample)
def test_the_summary_records_each_outcome_and_stops_at_the_budget(child):
    s = child.result()
    outcome = {t.split("::")[1]: r["outcome"] for t, r in s["tests"].items()}
    assert outcome == dict(test_passes="passed", test_fails="failed", test_skips="skipped",
                           test_errors="errors")
    assert "assert False" in s["tests"]["test_sample.py::test_fails"]["message"]
    assert s["tests"]["test_sample.py::test_skips"]["message"] == "Skipped: not here"
    assert s["files"] == {"test_sample.py": dict(passed=1, failed=1, skipped=1, errors=1,
                                                 not_run=1)}
    assert "test_after_the_budget would end" in s["stopped"]


# ------------------------------------------------------------------- synthetic
IDS = [f"compile_tests/test_gpu_a.py::test_{k}" for k in range(5)] + \
      [f"compile_tests/test_b.py::test_gpu_{k}[{p}]" for k in range(2) for p in (1, 2)]


def _summary(i, n, outcomes, *, commit="abc1234def", device="NVIDIA H100 80GB HBM3",
             finished=True, ids=IDS):
    planned = gpu_suite.split(ids, n)[i - 1]
    tests = {t: dict(outcome=outcomes.get(t, "passed"), duration=1.5) for t in planned
             if outcomes.get(t, "passed") is not None}
    return dict(format=gpu_suite.FORMAT, batch=[i, n], commit=commit, device=device,
                torch="2.11.0+cu130", fa3="flash_attn_interface (tokenspeed-fa3 3.0)",
                selection=dict(count=len(ids), digest=gpu_suite.digest(ids)), all_tests=ids,
                planned=planned, tests=tests, files=gpu_suite.file_counts(planned, tests),
                finished=finished, stopped=None, duration_s=3.0, estimate_s=30.0)


def test_split_balances_files_and_splits_only_a_file_too_long_for_one_batch(monkeypatch):
    monkeypatch.setitem(gpu_suite.SECONDS, "test_gpu_a.py", (100.0, {}))
    monkeypatch.setitem(gpu_suite.SECONDS, "test_b.py", (10.0, {}))
    batches = gpu_suite.split(IDS, 3)
    loads = [sum(map(gpu_suite.estimate, b)) for b in batches]
    assert max(loads) - min(loads) <= 100.0  # within the longest unit
    b_batches = {i for i, b in enumerate(batches) for t in b if "test_b.py" in t}
    assert len(b_batches) == 1  # a short file stays whole
    assert gpu_suite.split(IDS, 1) == [IDS]
    with pytest.raises(ValueError):
        gpu_suite.split(IDS + IDS[:1], 2)


def test_merge_of_every_batch_counts_per_file_and_is_clean():
    merged = gpu_suite.merge([_summary(1, 2, {}), _summary(2, 2, {})])
    assert gpu_suite.clean(merged)
    assert merged["files"]["compile_tests/test_gpu_a.py"]["passed"] == 5
    assert merged["files"]["compile_tests/test_b.py"]["passed"] == 4
    assert not (merged["never_run"] or merged["ran_twice"] or merged["missing_batches"])
    md = gpu_suite.report(merged, markdown=True)
    assert "| `test_gpu_a.py` | 5 passed | `abc1234` (H100) |  |" in md
    assert "| `test_b.py -m gpu` | 4 passed | `abc1234` (H100) |  |" in md


def test_merge_flags_tests_never_run_run_twice_failed_and_batches_missing():
    cut = gpu_suite.split(IDS, 3)[0][-1]  # the last test of batch 1: the run was cut short
    failed = gpu_suite.split(IDS, 3)[1][0]
    one = _summary(1, 3, {cut: None}, finished=False)
    two = _summary(2, 3, {failed: "failed"})
    merged = gpu_suite.merge([one, two, two])  # batch 3 missing, batch 2 given twice
    assert not gpu_suite.clean(merged)
    assert merged["never_run_in_batches_run"] == [cut]
    assert set(merged["never_run_in_missing_batches"]) == set(gpu_suite.split(IDS, 3)[2])
    assert merged["ran_twice"] == sorted(gpu_suite.split(IDS, 3)[1])
    assert merged["missing_batches"] == ["3/3"] and merged["repeated_batches"] == ["2/3"]
    file = failed.split("::")[0]
    assert merged["files"][file]["failed"] == 2 and merged["files"][file]["failing"] == [failed] * 2
    text = gpu_suite.report(merged)
    for words in ("never run, in batches that ran (1):", cut, "ran more than once",
                  "batches missing: 3/3", "NOT FINISHED", "failed (2):"):
        assert words in text, words
    md = gpu_suite.report(merged, markdown=True)
    assert "not run" in md and f"`{failed.split('::', 1)[1]}` failed" in md


def test_merge_flags_batches_of_different_test_sets(tmp_path):
    other = IDS + ["compile_tests/test_gpu_a.py::test_new"]
    merged = gpu_suite.merge([_summary(1, 2, {}), _summary(2, 2, {}, ids=other)])
    assert len(merged["selections"]) == 2 and not gpu_suite.clean(merged)
    # merge reads summaries from folders, as the command does.
    for k, s in enumerate([_summary(1, 2, {}), _summary(2, 2, {})], 1):
        (tmp_path / f"batch-{k}-of-2.json").write_text(json.dumps(s))
    assert gpu_suite.main(["merge", str(tmp_path)]) == 0


def test_batch_argument_is_i_of_n():
    assert gpu_suite.parse_batch("3/8") == (3, 8)
    for bad in ("0/8", "9/8", "3", "a/b"):
        with pytest.raises(Exception, match="--batch"):
            gpu_suite.parse_batch(bad)
