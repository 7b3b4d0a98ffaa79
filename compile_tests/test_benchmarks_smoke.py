"""The benchmark entry points run end to end in their CPU smoke modes.

Smoke runs exercise every code path at tiny sizes; their timings mean nothing.
"""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(script, tmp_path):
    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--json", str(out)],
                   check=True, cwd=ROOT, capture_output=True, timeout=600)
    return json.loads(out.read_text())["rows"]


def test_bench_smoke(tmp_path):
    rows = _run("bench.py", tmp_path)
    assert {r["kind"] for r in rows} == {"metadata", "draft_loop", "verify"}
    assert all(r["upstream_host_us"] > 0 for r in rows if r["kind"] == "metadata")
    assert all(r["upstream_baseline"] in ("sglang-0.5.23", "model") for r in rows)
    assert all("upstream_baseline_why" in r for r in rows
               if r["kind"] == "draft_loop" and r["upstream_baseline"] == "model")


def test_perf_smoke_writes_the_issue_schema(tmp_path):
    out = tmp_path / "perf.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "perf.py"), "--smoke", "--json",
                    str(out)], check=True, cwd=ROOT, capture_output=True, timeout=600)
    doc = json.loads(out.read_text())
    assert doc["cold_capture_s"] > 0 and doc["warm_capture_s"] > 0
    keys = {"scenario", "batch", "page_size", "topk", "runner_staging_us", "metadata_device_us",
            "metadata_kernels_per_step", "loop_over_floor_device_pct", "upstream_baseline"}
    assert doc["rows"] and all(keys <= set(r) for r in doc["rows"])
    assert all(r["upstream_baseline"] in ("sglang-0.5.23", "model") for r in doc["rows"])
    # perf.py's cold/warm capture is compile_capture.py --smoke in a child: its rows.
    rows = doc["compile_rows"]
    assert len(rows) == 4 and all(r["replay_rel_err"] < 1e-4 for r in rows)


def test_runner_staging_smoke(tmp_path):
    rows = _run("runner_staging.py", tmp_path)
    assert [r["batch"] for r in rows] == [1, 8, 64] and all(r["call_host_us"] > 0 for r in rows)


def test_load_checkpoint_smoke(tmp_path):
    import pytest

    pytest.importorskip("transformers")
    out = tmp_path / "load.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "load_checkpoint.py"), "--smoke",
                    "--dir", str(tmp_path / "ckpt"), "--json", str(out)], check=True, cwd=ROOT,
                   capture_output=True, timeout=600)
    doc = json.loads(out.read_text())
    assert doc["read"]["bytes"] > 0 and doc["load"]["load_s"] > 0
    assert [r["models"] for r in doc["loop"]] == ["preset random", "loaded + random draft",
                                                  "loaded + EAGLE-3 head"]
    assert all(r["tokens"] > 0 and r["acceptance"].startswith("SCRIPTED") for r in doc["loop"])
