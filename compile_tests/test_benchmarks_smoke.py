"""The benchmark entry points run end to end in their CPU smoke modes.

Smoke runs exercise every code path at tiny sizes; their timings mean nothing.
Each runs as a script in a child process, side by side with the others
(children.py).
"""

import json
import pathlib
import sys

import pytest

import children

ROOT = pathlib.Path(__file__).resolve().parents[1]


def smoke(script, *extra, out="rows.json"):
    """A job: ``benchmarks/SCRIPT --smoke --json TMP/OUT EXTRA...``; the JSON it wrote.
    ``{tmp}`` in EXTRA is the job's directory."""
    def job(tmp):
        path = tmp / out
        children.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--json",
                      str(path), *(a.format(tmp=tmp) for a in extra)], cwd=ROOT)
        return json.loads(path.read_text())
    return job


@pytest.mark.children(job=smoke("bench.py"))
def test_bench_smoke(child):
    rows = child.result()["rows"]
    assert {r["kind"] for r in rows} == {"metadata", "draft_loop", "verify"}
    assert all(r["upstream_host_us"] > 0 for r in rows if r["kind"] == "metadata")
    assert all(r["upstream_baseline"] in ("sglang-0.5.23", "model") for r in rows)
    assert all("upstream_baseline_why" in r for r in rows
               if r["kind"] == "draft_loop" and r["upstream_baseline"] == "model")


@pytest.mark.children(job=smoke("perf.py", out="perf.json"))
def test_perf_smoke_writes_the_issue_schema(child):
    doc = child.result()
    assert doc["cold_capture_s"] > 0 and doc["warm_capture_s"] > 0
    keys = {"scenario", "batch", "page_size", "topk", "runner_staging_us", "metadata_device_us",
            "metadata_kernels_per_step", "loop_over_floor_device_pct", "upstream_baseline"}
    assert doc["rows"] and all(keys <= set(r) for r in doc["rows"])
    assert all(r["upstream_baseline"] in ("sglang-0.5.23", "model") for r in doc["rows"])
    # perf.py's cold/warm capture is compile_capture.py --smoke in a child: its rows.
    rows = doc["compile_rows"]
    assert len(rows) == 4 and all(r["replay_rel_err"] < 1e-4 for r in rows)


@pytest.mark.children(job=smoke("region_compile.py"))
def test_region_compile_smoke(child):
    rows = child.result()["rows"]
    assert [(r["layers"], r["mode"], r["region_programs"]) for r in rows] == [
        (2, "regions", 2)]  # layer 0, and the rest
    assert rows[0]["max_abs_diff_vs_eager"] == 0  # eager backend: the same ops


@pytest.mark.children(job=smoke("runner_staging.py"))
def test_runner_staging_smoke(child):
    rows = child.result()["rows"]
    assert [r["batch"] for r in rows] == [1, 8, 64] and all(r["call_host_us"] > 0 for r in rows)


@pytest.mark.children(job=smoke("load_checkpoint.py", "--dir", "{tmp}/ckpt",
                                 out="load.json"))
def test_load_checkpoint_smoke(child):
    pytest.importorskip("transformers")
    doc = child.result()
    assert doc["read"]["bytes"] > 0 and doc["load"]["load_s"] > 0
    assert [r["models"] for r in doc["loop"]] == ["preset random", "loaded + random draft",
                                                  "loaded + EAGLE-3 head"]
    assert all(r["tokens"] > 0 and r["acceptance"].startswith("SCRIPTED") for r in doc["loop"])


@pytest.mark.children(job=smoke("ancestors_bench.py", out="ancestors.json"))
def test_ancestors_bench_smoke(child):
    doc = child.result()
    [row] = doc["acceptance_rows"]
    assert row["same_tokens"] is True and row["branch"] >= 1 and row["ancestors"] >= 1
    assert [r["draft_attention"] for r in doc["cost_rows"]] == ["branch", "ancestors"]
    assert all(r["ms_per_iteration"] > 0 and r["acceptance"].startswith("scripted")
               for r in doc["cost_rows"])
