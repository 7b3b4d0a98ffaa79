"""The ``fa3-spec`` command at its edges: values outside their domain, prompt
files that say nothing or say it wrong, names the function does not have,
modules that do not import, and what ``--check-greedy`` accepts."""

import json
import sys

import pytest
import torch

from fa3_spec.cli import main as fa3_spec_main
from fa3_spec.eagle import PRESETS, EagleEngine
from fa3_spec.eagle import cli
from fa3_spec.eagle.greedy_check import NEAR_TIE, compare_with_greedy

#: A small CPU run of the tiny preset (float64 by default on CPU).
SMALL = ["--device", "cpu", "--batch", "2", "--requests", "3", "--page-size", "16", "--topk",
         "2", "--num-steps", "2", "--num-draft-tokens", "3", "--max-new-tokens", "6",
         "--prompt-len", "8", "--attention-backend", "torch"]


def _refused(main, argv, capsys, *, one_line=True) -> str:
    """``main(argv)`` exits 2 with no traceback: the error line. ``one_line``: it
    is all of stderr (argparse's own refusals print their usage first)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    if one_line:
        assert len(lines) == 1, err
    return lines[-1]


# ----------------------------------------------------------------- --alpha, --noise
@pytest.mark.parametrize("flag, value", [
    ("--alpha", "nan"), ("--alpha", "inf"), ("--alpha", "-0.1"), ("--alpha", "1.5"),
    ("--noise", "nan"), ("--noise", "inf"), ("--noise", "-1"),
])
def test_alpha_and_noise_outside_their_domain_exit_2_naming_the_flag(flag, value, capsys):
    line = _refused(cli.main, SMALL + ["--check-greedy", "--quiet", flag, value], capsys,
                    one_line=False)
    assert line.startswith("fa3-spec eagle: error: ") and flag in line and value in line


def test_alpha_at_its_ends_and_a_positive_noise_run_and_match_greedy(tmp_path):
    for alpha in ("0", "1"):
        out = tmp_path / f"alpha{alpha}.json"
        assert cli.main(SMALL + ["--alpha", alpha, "--noise", "0.5", "--check-greedy",
                                 "--quiet", "--json", str(out)]) == 0
        res = json.loads(out.read_text())
        assert res["config"]["alpha"] == float(alpha) and res["config"]["noise"] == 0.5
        assert res["exact"] is True


# ----------------------------------------------------------------- --prompts FILE
def _prompts_argv(tmp_path, text: str) -> tuple:
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    # The file is read before the checkpoint: a bad file is refused without loading one.
    return str(path), SMALL[:2] + ["--model", str(tmp_path / "model"), "--prompts", str(path)]


@pytest.mark.parametrize("value", ["Infinity", "NaN", "0", "-3", "2.9", "2.0", "true",
                                   '"5"', "[4]"])
def test_a_max_new_tokens_that_is_not_a_positive_int_exits_2_naming_file_line_and_field(
        tmp_path, value, capsys):
    path, argv = _prompts_argv(
        tmp_path, '"w1 w2"\n\n{"prompt": "w3", "max_new_tokens": %s}\n"w4"\n' % value)
    line = _refused(cli.main, argv, capsys)
    assert f"{path}:3" in line and "max_new_tokens" in line and value in line, line


@pytest.mark.parametrize("text", ["", "\n", "  \n\n\t\n"], ids=["empty", "newline", "blank"])
def test_a_prompts_file_with_no_prompt_exits_2_naming_it(tmp_path, text, capsys):
    path, argv = _prompts_argv(tmp_path, text)
    line = _refused(cli.main, argv, capsys)
    assert "--prompts" in line and path in line and "no prompt" in line, line


# ----------------------------------------------------------------- fa3-spec audit
def doubles_into(x, out):
    out.copy_(2 * x)


def doubles_into_inputs():
    x = torch.arange(4.0)
    return (x, torch.zeros(4)), [(x + 1, torch.zeros(4))]


def doubles_into_keyword_inputs():
    x = torch.arange(4.0)
    return {"x": x, "out": torch.zeros(4)}, [{"x": x + 1, "out": torch.zeros(4)}]


@pytest.mark.parametrize("factory", ["doubles_into_inputs", "doubles_into_keyword_inputs"])
def test_audit_writable_names_an_argument_the_function_does_not_have_exits_2_listing_them(
        factory, capsys):
    line = _refused(fa3_spec_main, ["audit", "--callable", f"{__name__}:doubles_into",
                                    "--inputs", f"{__name__}:{factory}", "--writable", "out",
                                    "outt", "--device", "cpu"], capsys)
    assert "--writable" in line and "'outt'" in line and "out, x" in line, line


def test_audit_writable_names_of_the_functions_arguments_are_accepted(capsys):
    assert fa3_spec_main(["audit", "--callable", f"{__name__}:doubles_into",
                          "--inputs", f"{__name__}:doubles_into_inputs", "--writable", "out",
                          "--device", "cpu"]) == 0


MODULES = {
    "edges_syntax_error": ("def f(:\n", "SyntaxError"),
    "edges_raises_at_import": ("raise RuntimeError('not configured')\n", "RuntimeError"),
    "edges_imports_a_missing_module": ("import edges_no_such_dependency\n",
                                       "ModuleNotFoundError"),
    "edges_imports_an_error": ("raise ImportError('needs a GPU build')\n", "ImportError"),
}


@pytest.mark.parametrize("spec, says", [
    *[(f"{m}:f", exc) for m, (_, exc) in MODULES.items()],
    ("edges_no_such_module:f", "ModuleNotFoundError"),
    ("edges_importable:missing", "AttributeError"),
], ids=lambda x: x if ":" in x else None)
def test_audit_callable_whose_module_or_attribute_does_not_load_exits_2_naming_it(
        tmp_path, monkeypatch, spec, says, capsys):
    for name, (source, _) in MODULES.items():
        (tmp_path / f"{name}.py").write_text(source)
    (tmp_path / "edges_importable.py").write_text("def f(x):\n    return x\n")
    monkeypatch.chdir(tmp_path)  # the command imports modules of the current directory
    monkeypatch.setattr(sys, "path", list(sys.path))
    line = _refused(fa3_spec_main, ["audit", "--callable", spec, "--inputs",
                                    f"{__name__}:doubles_into_inputs", "--device", "cpu"], capsys)
    name = spec.partition(":")[0]
    assert "--callable" in line and f"'{name}'" in line and f"{says}:" in line, line


# ----------------------------------------------------------------- --check-greedy
def test_a_divergence_passes_only_where_the_two_tokens_logits_are_within_the_near_tie_bound():
    logits = [torch.tensor([[5.0, 4.95, 0.0, 1.0],     # 0 vs 1: gap 0.05 <= 0.1
                            [1.0, 0.0, 3.0, 2.0],      # 0 vs 2: gap 2.0 > 0.06
                            [5.0, 4.99, -10.0, 0.0],   # top-2 close, but 2 is far below
                            [0.3, 0.29, 0.27, 0.0],    # |top-1| < 1: the bound is 0.02
                            [0.3, 0.29, 0.27, 0.0],
                            [1.0, 0.0, 0.0, 0.0],
                            [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)]
    want = [[0], [2], [0], [0], [0], [0], [0]]
    got = [[1], [0], [2], [1], [2], [0], [0, 3]]
    found = compare_with_greedy(got, want, logits)
    assert [d.request for d in found] == [0, 1, 2, 3, 4, 6]
    assert [d.near_tie for d in found] == [True, False, False, True, False, False]
    assert [d.position for d in found] == [0, 0, 0, 0, 0, 1]
    assert found[0].gap == pytest.approx(0.05) and found[0].bound == pytest.approx(NEAR_TIE * 5)
    assert found[0].tokens == (1, 0) and found[2].gap == pytest.approx(15.0)
    assert found[3].bound == pytest.approx(NEAR_TIE) and found[4].gap == pytest.approx(0.03)
    assert found[5].tokens is None and found[5].gap is None  # one output ends, the other goes on
    assert compare_with_greedy([[7, 8]], [[7, 8]], [logits[0][:1]] * 2) == []
    (outside,) = compare_with_greedy([[4]], [[0]], [logits[0][:1]])  # no such token
    assert outside.gap is None and not outside.near_tie


def _plant(monkeypatch, change):
    """The command's engine, with ``change(tokens)`` applied to request 0's output."""
    class Planted(EagleEngine):
        def run(self, *args, **kwargs):
            out = super().run(*args, **kwargs)
            out[0] = change(list(out[0]))
            return out

    monkeypatch.setattr(cli, "EagleEngine", Planted)


def test_check_greedy_exits_1_on_a_divergence_that_is_not_a_near_tie(tmp_path, monkeypatch,
                                                                     capsys):
    vocab = PRESETS["tiny"].vocab_size
    _plant(monkeypatch, lambda t: [(t[0] + vocab // 2) % vocab] + t[1:])
    out = tmp_path / "eagle.json"
    assert cli.main(SMALL + ["--check-greedy", "--json", str(out)]) == 1
    res = json.loads(out.read_text())
    assert res["greedy_check"] == "mismatch" and res["exact"] is False
    assert res["mismatches"] == 1 and res["near_tie_divergences"] == 0
    (d,) = res["divergences"]
    assert d["request"] == 0 and d["first_divergence"] == 0 and d["near_tie"] is False
    assert d["gap"] > d["bound"] and res["worst_gap"] == d["gap"]
    assert "greedy check: MISMATCH" in capsys.readouterr().out


def test_check_greedy_exits_0_when_every_divergence_starts_at_a_near_tie_and_strict_exits_1(
        tmp_path, monkeypatch, capsys):
    vocab = PRESETS["tiny"].vocab_size
    _plant(monkeypatch, lambda t: [(t[0] + 1) % vocab] + t[1:])
    real = cli.greedy_generate

    def reference(*args, logits_out=None, **kwargs):  # make engine's token 0 a near tie
        ref = real(*args, logits_out=logits_out, **kwargs)
        row, want = logits_out[0][0], ref[0][0]
        row[(want + 1) % vocab] = row[want] - 0.5 * NEAR_TIE * max(1.0, abs(float(row[want])))
        return ref

    monkeypatch.setattr(cli, "greedy_generate", reference)
    out = tmp_path / "eagle.json"
    assert cli.main(SMALL + ["--check-greedy", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["greedy_check"] == "near ties" and res["exact"] is False
    assert res["mismatches"] == 1 and res["near_tie_divergences"] == 1
    (d,) = res["divergences"]
    assert d["near_tie"] is True and d["gap"] == pytest.approx(0.5 * d["bound"], rel=1e-5)
    assert res["worst_gap"] == d["gap"]
    printed = capsys.readouterr().out
    assert "1 of 3 requests differ" in printed and "near tie" in printed
    assert f"worst gap {d['gap']:.3g}" in printed

    assert cli.main(SMALL + ["--check-greedy", "--strict", "--json", str(out)]) == 1
    res = json.loads(out.read_text())
    assert res["greedy_check"] == "mismatch" and res["near_tie_divergences"] == 1


def test_float64_is_the_cpu_default_and_its_runs_are_bitwise_identical_to_greedy(tmp_path):
    out = tmp_path / "eagle.json"
    assert cli.main(SMALL + ["--check-greedy", "--strict", "--quiet", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["config"]["dtype"] == "float64"
    assert res["greedy_check"] == "exact" and res["exact"] is True and res["mismatches"] == 0
    assert res["worst_gap"] is None and res["divergences"] == []


def test_strict_without_check_greedy_exits_2(capsys):
    line = _refused(cli.main, SMALL + ["--strict"], capsys)
    assert "--strict" in line and "--check-greedy" in line


def test_check_greedy_help_says_how_near_ties_are_judged(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "near tie" in text and f"{NEAR_TIE} * max(1, |top-1 logit|)" in text
    assert "--strict" in text
