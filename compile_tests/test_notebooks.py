"""Every notebook runs top to bottom on CPU and is committed without outputs."""

import pathlib
import sys

import pytest

import children

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
#: Running a notebook that compiles with inductor is `slow` (the marker's one meaning).
RUNS = [pytest.param(p, marks=[pytest.mark.slow] if "inductor" in p.read_text() else [])
        for p in NOTEBOOKS]

#: Executes argv[1] in a fresh kernel (nbclient), writes the executed notebook to argv[2].
_EXECUTE = """
import pathlib, sys
import nbclient, nbformat
path = pathlib.Path(sys.argv[1])
nb = nbformat.read(path, as_version=4)
nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                        resources={"metadata": {"path": str(path.parent)}}).execute()
nbformat.write(nb, sys.argv[2])
"""


def _execute(tmp, path):
    """A job: the notebook, run in a child (side by side with the others: children.py)."""
    out = tmp / path.name
    children.run([sys.executable, "-c", _EXECUTE, str(path), str(out)], cwd=path.parent)
    return nbformat.read(out, as_version=4)


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 2


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, path.name


@pytest.mark.children(job=_execute)
@pytest.mark.parametrize("path", RUNS, ids=lambda p: p.stem)
def test_notebook_runs(path, child):
    nb = child.result()
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
