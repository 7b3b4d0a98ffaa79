"""benchmarks/eagle_bench.py runs end to end in its CPU smoke mode.

The smoke run's timings mean nothing; what it checks is that every variant
runs and that (a) metadata built in the iteration and (b) the upstream-style
host-built metadata copied into static buffers drive the loop to the same
tokens.
"""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_eagle_bench_smoke(tmp_path):
    out = tmp_path / "eagle.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "eagle_bench.py"), "--smoke",
                    "--json", str(out)], check=True, cwd=ROOT, capture_output=True, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2
    for row in rows:
        assert row["acceptance"].startswith("SCRIPTED")
        assert row["a_equals_b"] is True
        for variant in ("a_in_graph", "b_host_metadata", "c_greedy"):
            assert row[variant]["tokens"] > 0 and row[variant]["tokens_per_s"] > 0
        assert row["a_in_graph"]["tokens"] == row["b_host_metadata"]["tokens"]
