"""The README's API tour and every docstring example in fa3_spec run as written."""

import doctest
import importlib
import pathlib
import re

import pytest
import torch

import fa3_spec

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fa3_spec"


def _modules_with_examples():
    """Dotted names of the fa3_spec modules whose source holds a ``>>>`` example."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if ">>>" in path.read_text():
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = _modules_with_examples()


def test_readme_api_tour_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    tour = [b for b in blocks if "fa3_spec.draft_positions(cfg, seq_lens)" in b]
    assert tour, "README lost its API tour"
    assert "make_world" not in tour[0], "the tour starts from engine-owned tensors, not the harness"
    exec(compile(tour[0], "README.md", "exec"), {})


def test_examples_are_found_in_the_modules_that_have_them():
    assert {"fa3_spec", "fa3_spec.config", "fa3_spec.batch", "fa3_spec.expand",
            "fa3_spec.builders.decode", "fa3_spec.builders.prefill"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, extraglobs={"torch": torch, "fa3_spec": fa3_spec,
                                                  "SpecConfig": fa3_spec.SpecConfig})
    assert result.attempted > 0, f"{name}: every example is skipped"
    assert result.failed == 0
