"""benchmarks/fa3_decode_calls.py refuses bad input and a machine without CUDA (exit 2)."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv, says", [([], "needs CUDA"), (["--splits", "0"], "must be >= 1"),
                                        (["--batches", "-1"], "must be >= 1")])
def test_the_script_exits_2_without_cuda_or_with_a_bad_count(argv, says):
    if not argv and __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fa3_decode_calls.py"), *argv],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr
