"""benchmarks/kernel_bench.py: each kernel benchmark refuses bad input and a
machine without CUDA (exit 2), before it touches the device."""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import kernel_bench  # noqa: E402


@pytest.mark.parametrize("argv, says", [
    (["fa3-decode"], "needs CUDA"),
    (["fa3-decode", "--splits", "0"], "must be >= 1"),
    (["fa3-decode", "--batches", "-1"], "must be >= 1"),
    (["kv-store"], "needs CUDA and Triton"),
    (["kv-store", "--tokens", "0"], "--tokens must be >= 1"),
    (["kv-store", "--num-pages", "2"], "holds fewer slots"),
    (["expand"], "needs CUDA and an FA3 provider"),
    (["expand", "--layers", "0"], "must be >= 1"),
    (["expand", "--draft-tokens", "129"], "at most 128"),
    (["gemm"], "needs a CUDA GPU"),
    (["gemm", "--m", "17"], "must lie in [1, 16]"),
    (["no-such"], "unknown subcommand"),
])
def test_a_kernel_benchmark_exits_2_without_cuda_or_with_a_bad_count(argv, says, monkeypatch,
                                                                       capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kernel_bench.main(argv) == 2
    assert says in capsys.readouterr().err
