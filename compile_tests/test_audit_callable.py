"""`fa3_spec.audit.audit_callable` on small functions with one known defect each.

Each defect must land in its column at its line (the line marked ``# defect``,
found with `inspect`), and a clean function must come back clean. CPU only:
host syncs and capture are in ``test_gpu_audit_callable.py``.
"""

import dataclasses
import inspect
import json
import logging

import pytest
import torch

from fa3_spec.audit import audit_callable, format_table, pytree_mismatches
from fa3_spec import cli


def defect_line(fn) -> int:
    lines, start = inspect.getsourcelines(fn)
    marked = [start + i for i, text in enumerate(lines) if "# defect" in text]
    assert len(marked) == 1, fn.__name__
    return marked[0]


# ------------------------------------------------------------------ the subjects
def uses_item(lens, out):
    total = lens.sum().item()  # defect
    return out * total


def uses_tolist(lens, out):
    first = lens.tolist()[0]  # defect
    return out + first


def branches_on_a_value(lens, out):
    if lens.max() > 3:  # defect
        return out + 1
    return out - 1


def uses_nonzero(lens, out):
    live = torch.nonzero(lens)  # defect
    return out.sum() + live.sum()


def data_dependent_shape(lens, out):
    kept = out[lens > 0]  # defect
    return kept.sum()


def writes_its_input(lens, out):
    lens.clamp_(min=1)  # defect
    return out * lens


def prints_a_tensor(lens, out):
    print(lens)  # defect
    return out + 1


def guards_on_a_python_int(lens, out, page_size):
    pages = (lens + page_size - 1) // page_size  # defect
    return out * pages


def clean(lens, out):
    pages = (lens + 1) // 2
    return torch.where(lens > 0, out * pages, torch.zeros_like(out)).sum(0)


def fills_a_buffer(lens, buf):
    buf.copy_(lens * 2)


def _example():
    return (torch.tensor([3, 0, 5, 2]), torch.ones(4))


def _variant():
    return (torch.tensor([1, 4, 0, 6]), torch.full((4,), 2.0))


CASES = [
    (uses_item, "data_dependent"),
    (uses_tolist, "data_dependent"),
    (branches_on_a_value, "graph_breaks"),
    (uses_nonzero, "data_dependent"),
    (data_dependent_shape, "data_dependent"),
    (writes_its_input, "mutations"),
    (prints_a_tensor, "graph_breaks"),
]


@pytest.mark.parametrize("fn,column", CASES, ids=[f.__name__ for f, _ in CASES])
def test_defect_reported_in_its_column_at_its_line(fn, column, capsys):
    row = audit_callable(fn, _example(), variants=[_variant()])
    assert not row.clean
    assert getattr(row, column) > 0, row.problems
    here = [f for f in row.findings if f.column == column]
    assert any(f.line == defect_line(fn) and f.file == __file__ for f in here), row.problems
    assert all(f.op for f in here)


def test_value_dependent_guard_is_a_recompile_at_its_line():
    lens, out = _example()
    row = audit_callable(guards_on_a_python_int, (lens, out, 2), variants=[(lens, out, 16)])
    assert row.recompiles == 1 and not row.clean
    (guard,) = [f for f in row.findings if f.column == "recompiles"]
    assert guard.line == defect_line(guards_on_a_python_int) and "page_size" in guard.message
    # Without a variant that changes the value there is nothing to recompile.
    assert audit_callable(guards_on_a_python_int, (lens, out, 2)).clean


def _scaled(x, scale):
    return x * scale


def test_a_changing_python_float_is_a_recompile_not_a_data_dependent_read():
    # Dynamo makes the float dynamic after one recompile, passing it as a tensor
    # and reading it with .item(): that read is the caller's number, not device data.
    x = torch.randn(4)
    row = audit_callable(_scaled, (x, 0.5), variants=[(x + 1, 0.7), (x + 2, 0.9)])
    assert row.data_dependent == 0 and row.recompiles == 1
    assert [f.column for f in row.findings] == ["recompiles"]


def test_clean_function_is_clean_with_keyword_arguments():
    lens, out = _example()
    row = audit_callable(clean, {"lens": lens, "out": out},
                         variants=[dict(zip(("lens", "out"), _variant()))])
    assert row.clean and row.findings == [] and row.problems == []
    assert row.host_syncs is None and row.cuda_graph == "skipped"


def test_declared_output_buffer_may_be_written_and_is_compared():
    lens = torch.tensor([3, 0, 5, 2])
    example = (lens, torch.zeros(4, dtype=torch.int64))
    assert audit_callable(fills_a_buffer, example, writable=["buf"]).clean
    row = audit_callable(fills_a_buffer, example)
    assert row.mutations == 1 and any(f.op == "copy_" for f in row.findings)


def test_pytree_mismatches_exact_for_ints_tolerant_for_floats():
    a = {"x": torch.tensor([1, 2]), "y": [torch.tensor([1.0, 2.0]), 3]}
    b = {"x": torch.tensor([1, 2]), "y": [torch.tensor([1.0, 2.0 + 1e-7]), 3]}
    assert pytree_mismatches(a, b) == []
    assert pytree_mismatches(a, {"x": torch.tensor([1, 3]), "y": b["y"]})
    assert pytree_mismatches(a, {"x": a["x"], "y": [a["y"][0], 4]})
    assert pytree_mismatches(a, {"x": a["x"]})


def test_malformed_arguments_are_named():
    lens, out = _example()
    with pytest.raises(TypeError, match="example"):
        audit_callable(clean, lens)
    with pytest.raises(ValueError, match=r"variants\[0\]"):
        audit_callable(clean, (lens, out), variants=[(lens[:2], out)])


@dataclasses.dataclass
class Buffers:  # a plain dataclass: not a registered pytree
    page_table: torch.Tensor


class Holder:  # a plain object with a tensor attribute
    def __init__(self, page_table):
        self.page_table = page_table


def fill(bufs, seq_lens):
    bufs.page_table.add_(seq_lens)  # defect


@pytest.mark.parametrize("make", [Buffers, Holder], ids=["dataclass", "object"])
def test_a_write_into_a_non_pytree_argument_is_a_mutation_and_the_callers_tensor_stays(make):
    """Found by trying to break it: the row came back clean (mutations 0) while the
    audit's own runs added into the caller's buffer ([0, 3, 6, 9] afterwards)."""
    bufs = make(torch.zeros(4, dtype=torch.int64))
    seq = torch.arange(4)
    row = audit_callable(fill, (bufs, seq), variants=[(make(torch.ones(4, dtype=torch.int64)),
                                                       seq * 2)])
    assert not row.clean and row.mutations == 1, row.problems
    (found,) = [f for f in row.findings if f.column == "mutations"]
    assert found.op == "add_" and found.line == defect_line(fill) and "'bufs'" in found.message
    assert bufs.page_table.tolist() == [0, 0, 0, 0]  # never the caller's tensor
    # Declared writable: compiled and eager fill it alike, and a wrong fill is a parity finding.
    assert audit_callable(fill, (bufs, seq), writable=["bufs"]).clean
    row = audit_callable(fill, (bufs, seq), writable=["bufs"],
                         same=lambda got, want: pytree_mismatches(got, (None, Buffers(seq))))
    assert not row.parity
    with pytest.raises(ValueError, match=r"variants\[0\]"):  # the object's tensor is checked too
        audit_callable(fill, (bufs, seq), variants=[(make(torch.zeros(3, dtype=torch.int64)), seq)])


def or_then_copy(mask, x):
    mask.copy_(mask | x)  # defect


def test_a_copy_into_an_input_is_reported_as_copy_not_as_the_or_it_copies():
    row = audit_callable(or_then_copy, (torch.zeros(4, dtype=torch.bool),
                                        torch.tensor([True, False, True, False])))
    (found,) = [f for f in row.findings if f.column == "mutations"]
    assert found.op == "copy_" and found.line == defect_line(or_then_copy)  # was "or_"


def item_for_the_table(lens, out):
    return out * lens.sum().item()  # defect


def test_a_graph_break_reason_is_whole_in_the_row_and_cut_at_a_word_in_the_table():
    row = audit_callable(item_for_the_table, _example())
    (found,) = [f for f in row.findings if f.column == "graph_breaks"]
    assert len(found.message) > 200 and found.message.endswith(found.message.split()[-1])
    assert json.loads(json.dumps(row.to_json()))["break_reasons"] == [found.message]
    (shown,) = [line for line in format_table([row]).splitlines() if "graph_breaks" in line]
    cut = shown.split(": ", 1)[1].split("   | ")[0]
    assert cut.endswith(" ...") and found.message.startswith(cut[:-4])
    assert found.message[len(cut) - 4] in " ,;:"  # cut at a word, not inside one


def test_torch_warnings_are_held_back_while_auditing():
    """The findings say it; torch's ~14-line `Tensor.item()` warning came before the table."""
    warned = getattr(getattr(torch._dynamo.variables.tensor, "TensorVariable", None),
                     "_warn_capture_scalar_outputs", None)
    if hasattr(warned, "cache_clear"):
        warned.cache_clear()  # torch warns once per process: make it warn here
    seen = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = seen.append
    logger = logging.getLogger("torch._dynamo")  # where torch's own stderr handler sits
    logger.addHandler(handler)
    try:
        assert audit_callable(item_for_the_table, _example()).data_dependent == 1
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in seen] == []


# ------------------------------------------------------------------ the CLI
def inputs_factory(device="cpu"):
    """``--inputs`` factory: (example, variants) on ``device``."""
    def on(call):
        return tuple(t.to(device) for t in call)
    return on(_example()), [on(_variant())]


def test_cli_audits_a_callable(tmp_path, capsys):
    out = tmp_path / "rows.json"
    code = cli.main(["audit", "--callable", f"{__name__}:uses_nonzero",
                     "--inputs", f"{__name__}:inputs_factory", "--json", str(out),
                     "--device", "cpu"])
    assert code == 1
    (row,) = json.loads(out.read_text())
    (finding,) = [f for f in row["findings"] if f["column"] == "data_dependent"]
    assert finding["line"] == defect_line(uses_nonzero) and finding["op"] == "nonzero"
    text = capsys.readouterr().out
    assert "not measured on CPU" in text and "uses_nonzero" in text
    assert cli.main(["audit", "--callable", f"{__name__}:clean",
                     "--inputs", f"{__name__}:inputs_factory", "--device", "cpu"]) == 0


def test_cli_loads_from_the_current_directory_audits_generator_variants_and_exits_2_on_bad_input(
        tmp_path, monkeypatch):
    """Found in review: a generator of variants was used up before the audit (a false
    "clean"), and the installed command could not import modules of the current directory."""
    from fa3_spec import cli

    (tmp_path / "gen_variants_mod.py").write_text(
        "import torch\n"
        "def scaled(x, k):\n"
        "    return x * k\n"
        "def inputs():\n"
        "    x = torch.arange(4.0)\n"
        "    return (x, 2), ((x + 1, k) for k in [3])\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    rc = cli.main(["audit", "--callable", "gen_variants_mod:scaled",
                   "--inputs", "gen_variants_mod:inputs", "--device", "cpu"])
    assert rc == 1  # the int argument is guarded: a recompile on the variant
    with pytest.raises(SystemExit) as exc:
        cli.main(["audit", "--callable", "no_such_module_here:f",
                  "--inputs", "gen_variants_mod:inputs", "--device", "cpu"])
    assert exc.value.code == 2


def variants_of_another_shape():
    lens, out = _example()
    return (lens, out), [(lens[:2], out)]


def raises_on_its_example(lens, out):
    raise KeyError("no such row")


@pytest.mark.parametrize("argv", [
    ["--callable", f"{__name__}:clean", "--inputs", f"{__name__}:variants_of_another_shape"],
    ["--callable", f"{__name__}:raises_on_its_example", "--inputs", f"{__name__}:inputs_factory"],
    ["--callable", f"{__name__}:clean", "--inputs", f"{__name__}:no_such_factory"],
    # --inputs without --callable: a one-row grid, so the old code's full audit is short
    ["--inputs", f"{__name__}:inputs_factory", "--modes", "decode", "--page-sizes", "1",
     "--topks", "1", "--no-steps"],
    ["--num-steps", "1"], ["--page-sizes", "0"],
], ids=["variant-shape", "raises", "no-factory", "inputs-alone", "num-steps-1", "page-size-0"])
def test_cli_invalid_invocations_exit_2_with_one_line_and_no_traceback(argv, capsys):
    """Exit 1 is an unclean row; a variant of another shape printed a traceback and exited 1."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["audit", *argv, "--device", "cpu"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("fa3-spec audit")


def test_cli_audit_help_documents_the_exit_status(capsys):
    with pytest.raises(SystemExit):
        cli.main(["audit", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Exit status: 0 when every row is clean; 1 when a row is unclean; 2 for an" in text
