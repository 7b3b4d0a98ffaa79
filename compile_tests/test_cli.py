"""The ``fa3-spec`` command's front: what each subcommand imports, and its refusals."""

import json
import sys

import pytest

import children
from fa3_spec import cli

IMPORTS = r"""
import json, sys
from fa3_spec.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m.startswith("fa3_spec"))))
"""


def _imported(*argv) -> set:
    done = children.run([sys.executable, "-c", IMPORTS, *argv], fresh=True)
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def _imports_per_command(tmp):
    return {" ".join(argv): sorted(_imported(*argv))
            for argv in (["--help"], ["audit", "--help"], ["eagle", "--help"])}


@pytest.mark.children(job=_imports_per_command)
def test_audit_and_the_top_help_import_neither_the_engine_nor_the_sglang_fetcher(child):
    found = {k: set(v) for k, v in child.result().items()}
    for argv in ("--help", "audit --help"):
        assert "fa3_spec.cli" in found[argv]
        assert not {m for m in found[argv] if m.startswith("fa3_spec.eagle")}, (argv, found[argv])
        assert "fa3_spec.harness.sglang_upstream" not in found[argv], argv
    assert "fa3_spec.eagle.engine" in found["eagle --help"]


@pytest.mark.parametrize("argv, says", [
    (["audit", "--compile-backend", "aot_eagre"], "--compile-backend must be a torch.compile "
                                                  "backend"),
    (["audit", "--json", "/no/such/dir/rows.json"], "the directory '/no/such/dir' does not exist"),
    (["eagle", "--device", "meta"], "--device must be cpu, cuda, cuda:N or auto, got 'meta'"),
    (["eagle", "--device", "cpu", "--json", "/no/such/dir/out.json"],
     "the directory '/no/such/dir' does not exist"),
    (["eagle", "--device", "cpu", "--json", "."], "is a directory"),
    (["eagle", "--kernels", "bogus=1"], "--kernels: expected NAME=VALUE with NAME one of gemm"),
    (["eagle", "--kernels", "gemm=cublas", "gemm=triton"], "--kernels: gemm given twice"),
    (["eagle", "--kernels", "expand_attention=cuda"], "--kernels: expand_attention must be one of"),
])
def test_bad_flags_exit_2_naming_them_before_any_work(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_an_unknown_subcommand_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve"])
    assert exit_.value.code == 2


def test_the_eagle_command_runs_with_the_kernels_it_is_given_and_puts_them_back(tmp_path):
    from fa3_spec.attention import expand_kernel, select_expand_kernel
    from fa3_spec.eagle.kernels import Kernels, selected_kernels

    out = tmp_path / "run.json"
    assert cli.main(["eagle", "--kernels", "expand_attention=fa3", "pdl=off", "--quiet",
                     "--batch", "1", "--requests", "1", "--max-new-tokens", "3",
                     "--json", str(out)]) == 0
    recorded = json.loads(out.read_text())["config"]["kernels"]
    assert recorded["expand_attention"] == "fa3" and recorded["pdl"] is False
    assert selected_kernels() == Kernels() and expand_kernel() == "triton"
    # Without --kernels the process's own choice stands, and is recorded.
    previous = select_expand_kernel("fa3")
    try:
        assert cli.main(["eagle", "--quiet", "--batch", "1", "--requests", "1",
                         "--max-new-tokens", "3", "--json", str(out)]) == 0
        assert expand_kernel() == "fa3"
        assert json.loads(out.read_text())["config"]["kernels"]["expand_attention"] == "fa3"
    finally:
        select_expand_kernel(previous)
