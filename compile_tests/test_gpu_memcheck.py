"""compute-sanitizer memcheck over the captured draft loop (its expand calls on FA3
and on the expand kernel), and over the pre-#27360 switch.

Skipped without CUDA sm90 + FA3 or without ``compute-sanitizer`` on PATH (or
in /usr/local/cuda/bin). Each case runs `memcheck_probe.py` in a subprocess.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from fa3_spec.attention import fa3_available

HERE = pathlib.Path(__file__).resolve().parent
SANITIZER = shutil.which("compute-sanitizer") or next(
    (str(p) for p in pathlib.Path("/usr/local").glob("cuda*/bin/compute-sanitizer")), None)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not fa3_available(), reason="needs CUDA sm90 and an FA3 provider"),
    pytest.mark.skipif(SANITIZER is None, reason="compute-sanitizer not found"),
]


def _memcheck(variant, **env):
    cmd = [SANITIZER, "--tool", "memcheck", "--print-limit", "20", sys.executable,
           str(HERE / "memcheck_probe.py"), variant]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=500,
                          env={**os.environ, **env}, cwd=HERE.parent)
    text = done.stdout + done.stderr
    summary = re.search(r"ERROR SUMMARY: (\d+) error", text)
    log = os.environ.get("FA3_SPEC_MEMCHECK_LOG")
    if log:  # the raw output, for the committed summary
        with open(f"{log}.{variant}.txt", "w") as fh:
            fh.write(" ".join(cmd) + "\n" + text)
    return (int(summary.group(1)) if summary else None), text, done.returncode


@pytest.mark.parametrize("variant", ["fixed", "fixed-expand-kernel"])
def test_fixed_path_captured_draft_loop_is_clean(variant):
    errors, text, rc = _memcheck(variant, TORCHINDUCTOR_COMPILE_THREADS="1")
    assert f"PROBE {variant} done" in text, text[-3000:]
    assert errors == 0 and rc == 0, text[-3000:]


def test_pre_fix_switch_unchecked_write_is_caught():
    errors, text, _ = _memcheck("prefix-unchecked", PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    assert errors and errors > 0, text[-3000:]
    assert "Invalid __global__ write" in text, text[-3000:]


def test_pre_fix_switch_eager_trips_the_bounds_check():
    errors, text, rc = _memcheck("prefix-eager", PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    assert "PROBE prefix-eager done" not in text  # it never completes
    assert rc != 0 and ("out of bounds" in text or "device-side assert" in text), text[-3000:]
