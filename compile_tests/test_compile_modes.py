"""benchmarks/compile_engine.py (``compile.py engine``): the timing of a batch in two buckets."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import compile_engine  # noqa: E402
import pytest  # noqa: E402


class _ClockedEngine:
    """Stands in for an engine whose every replay takes 1 ms more than the last
    (the context grows), in any bucket: an order-fair timing gives equal figures."""

    def __init__(self, monkeypatch):
        self.now = 0.0
        self.step = 0
        self.launched = []
        monkeypatch.setattr(compile_engine.time, "perf_counter", lambda: self.now)
        monkeypatch.setattr(compile_engine.torch.cuda, "synchronize", lambda: None)

    def launch(self, bucket):
        self.step += 1
        self.now += 1e-3 * self.step
        self.launched.append(bucket)


def test_two_buckets_are_timed_in_blocks_that_cancel_a_drift(monkeypatch):
    eng = _ClockedEngine(monkeypatch)
    a, b = compile_engine.ms_per_iteration(eng, [1, 2], warmup=3, iters=20)
    assert a == b  # a linear drift weighs both buckets alike in A, B, B, A
    timed = eng.launched[6:]
    assert eng.launched[:6] == [1] * 3 + [2] * 3 and timed == [1] * 10 + [2] * 20 + [1] * 10
    one = _ClockedEngine(monkeypatch)  # one bucket: replays 4-23 timed, 4..23 ms each
    assert compile_engine.ms_per_iteration(one, [4], warmup=3, iters=20) == [13.5]


def test_the_engine_run_refuses_a_timed_batch_no_bucket_holds(capsys):
    assert compile_engine.main(["--buckets", "1", "2", "--time-batches", "4"]) == 2
    assert "must fit a bucket" in capsys.readouterr().err


def test_bucket_shapes_parse_and_must_cover_the_buckets():
    assert compile_engine.parse_bucket_shapes(["1=8,5,16", "64=off"]) == {1: (8, 5, 16), 64: None}
    with pytest.raises(ValueError, match="BUCKET=TOPK,STEPS,N or BUCKET=off, got '2=8,5'"):
        compile_engine.parse_bucket_shapes(["2=8,5"])
    assert compile_engine.main(["--buckets", "1", "2", "--shapes", "1=off", "2=x"]) == 2
    assert compile_engine.main(["--buckets", "1", "2", "--shapes", "1=off"]) == 2


def test_both_children_get_the_breakdown_and_the_file_names_its_commit(monkeypatch, tmp_path):
    """The parent passes ``--breakdown`` (and the batch mode) on to both fresh
    processes, and the JSON holds the commit beside their rows."""
    seen = []

    def fake_row(cmd, cache_dir, phase):
        seen.append(cmd)
        return dict(seconds=1.0)

    monkeypatch.setattr(compile_engine.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(compile_engine.runs, "fresh_process_row", fake_row)
    monkeypatch.setattr(compile_engine.runs, "device_name", lambda device: "GPU")
    monkeypatch.setenv("FA3_SPEC_COMMIT", "abc1234")
    out = tmp_path / "engine.json"
    assert compile_engine.main(["--buckets", "1", "2", "--time-batches", "1", "--breakdown",
                                "--batch", "unbacked", "--json", str(out)]) == 0
    assert len(seen) == 2 and all("--breakdown" in c and "unbacked" in c for c in seen)
    doc = json.loads(out.read_text())
    assert doc["commit"] == "abc1234" and [r["phase"] for r in doc["runs"]] == ["cold", "restart"]
