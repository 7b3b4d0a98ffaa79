"""The ``fa3-spec`` command's front: what each subcommand imports, and its refusals."""

import json
import subprocess
import sys

import pytest

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
    done = subprocess.run([sys.executable, "-c", IMPORTS, *argv], capture_output=True, text=True,
                          check=True)
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_audit_and_the_top_help_import_neither_the_engine_nor_the_sglang_fetcher():
    for argv in (["--help"], ["audit", "--help"]):
        found = _imported(*argv)
        assert "fa3_spec.cli" in found
        assert not {m for m in found if m.startswith("fa3_spec.eagle")}, (argv, found)
        assert "fa3_spec.harness.sglang_upstream" not in found, argv
    assert "fa3_spec.eagle.engine" in _imported("eagle", "--help")


@pytest.mark.parametrize("argv, says", [
    (["audit", "--compile-backend", "aot_eagre"], "--compile-backend must be a torch.compile "
                                                  "backend"),
    (["audit", "--json", "/no/such/dir/rows.json"], "the directory '/no/such/dir' does not exist"),
    (["eagle", "--device", "meta"], "--device must be cpu, cuda, cuda:N or auto, got 'meta'"),
    (["eagle", "--device", "cpu", "--json", "/no/such/dir/out.json"],
     "the directory '/no/such/dir' does not exist"),
    (["eagle", "--device", "cpu", "--json", "."], "is a directory"),
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
