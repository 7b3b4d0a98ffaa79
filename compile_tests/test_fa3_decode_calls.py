"""benchmarks/fa3_decode_calls.py refuses bad input and a machine without CUDA (exit 2)."""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import fa3_decode_calls  # noqa: E402


@pytest.mark.parametrize("argv, says", [([], "needs CUDA"), (["--splits", "0"], "must be >= 1"),
                                        (["--batches", "-1"], "must be >= 1")])
def test_the_script_exits_2_without_cuda_or_with_a_bad_count(argv, says, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fa3_decode_calls.main(argv) == 2
    assert says in capsys.readouterr().err
