"""The README's API tour and the docstring examples run as written."""

import doctest
import pathlib
import re

import pytest

import fa3_spec
import fa3_spec.builders.decode
import fa3_spec.config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_api_tour_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    tour = [b for b in blocks if "fa3_spec.draft_positions(cfg, seq_lens)" in b]
    assert tour, "README lost its API tour"
    assert "make_world" not in tour[0], "the tour starts from engine-owned tensors, not the harness"
    exec(compile(tour[0], "README.md", "exec"), {})


@pytest.mark.parametrize("module", [fa3_spec, fa3_spec.config, fa3_spec.builders.decode])
def test_docstring_examples(module):
    result = doctest.testmod(module, extraglobs={"torch": __import__("torch"),
                                                  "SpecConfig": fa3_spec.SpecConfig})
    assert result.failed == 0
