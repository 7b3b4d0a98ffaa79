"""``benchmarks/loop.py compare`` end to end in its CPU smoke mode, and the
FLOP count its compute floor rests on.

The smoke run's timings mean nothing; what it checks is that every variant
runs and that (a) metadata built in the iteration and (b) host-filled
metadata read by the captured phases drive the loop to the same tokens and
the same whole state, and that (b)'s metadata read the same keys as
fa3_spec's builders. (b) runs on sglang 0.5.23's own replay functions when
they load here (``--upstream auto``), and on the project's upstream-style
model (``--upstream model``).
"""

import json
import pathlib
import sys

import pytest

import children
from fa3_spec.harness.sglang_upstream import SGLANG_VERSION

ROOT = pathlib.Path(__file__).resolve().parents[1]
SGLANG = f"sglang-{SGLANG_VERSION} replay functions"
MODEL = "fa3_spec upstream-style model"
#: sglang's kernels run on CPU in Triton's interpreter, fixed before Triton's first import.
INTERPRET = {"TRITON_INTERPRET": "1"}


def _smoke(tmp, *extra):
    """A job's run: the smoke's rows (each child runs side by side with the others: children.py)."""
    out = tmp / "loop.json"
    children.run([sys.executable, str(ROOT / "benchmarks" / "loop.py"), "compare", "--smoke",
                  "--json", str(out), *extra], cwd=ROOT, env_extra=INTERPRET)
    return json.loads(out.read_text())["rows"]


def _check(rows):
    assert len(rows) == 2
    for row in rows:
        assert row["acceptance"] == "scripted:3,4,2,5,3,4"
        assert row["compile"] == "none"  # the CPU default
        assert row["kernels"]["gemm"] == "triton"  # the library's default kernels, recorded
        for field in ("a_ms_per_iteration", "a_tokens_per_s", "c_ms_per_token", "c_tokens_per_s"):
            assert row[field] > 0
        # (b)'s flat fields exist only where (b) ran sglang's own code.
        assert ("b_source" in row) == (row["b_metadata_source"] == SGLANG)
        assert row["a_equals_b"] is True
        assert row["a_state_equals_b"] is True
        assert row["b_metadata_mismatches"] == []
        for variant in ("a_in_graph", "b_host_metadata", "c_greedy"):
            assert row[variant]["tokens"] > 0 and row[variant]["tokens_per_s"] > 0
        assert row["a_in_graph"]["tokens"] == row["b_host_metadata"]["tokens"]
    return rows


def _auto(tmp):
    # In a child: Triton's interpreter mode is fixed at import. Exit 0: sglang's code loads.
    probe = children.run(
        [sys.executable, "-c", "from fa3_spec.harness.sglang_upstream import "
         "load_upstream_or_reason as l; import sys; sys.exit(l(fetch=False)[0] is None)"],
        cwd=ROOT, timeout=300, check=False, env_extra=INTERPRET)
    return probe.returncode == 0, _smoke(tmp)


@pytest.mark.children(job=_auto)
def test_loop_compare_smoke_auto(child):
    """auto: sglang's own functions when they load here, else the model, labelled so."""
    loads, rows = child.result()
    _check(rows)
    want = SGLANG if loads else MODEL
    assert {row["b_metadata_source"] for row in rows} == {want}
    if want == MODEL:
        assert all("unavailable" in row["b_metadata_note"] for row in rows)


@pytest.mark.children(job=lambda tmp: _smoke(tmp, "--upstream", "model"))
def test_loop_compare_smoke_model(child):
    rows = _check(child.result())
    assert {row["b_metadata_source"] for row in rows} == {MODEL}


@pytest.mark.parametrize("p, k, s, n, mode", [(2, 8, 5, 16, "branch"), (16, 1, 5, 6, "ancestors")])
def test_the_flop_count_of_the_compute_floor_is_what_torch_counts(p, k, s, n, mode):
    """`floors.forward_flops`' matmul FLOPs equal `FlopCounterMode`'s ``aten.mm``
    count of one eager (a) iteration and of one (c) decode step (the attention's
    FLOPs are not compared: the reference attention computes over padded keys)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from fa3_spec.eagle import make_models

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import floors
    import workload
    from loop_variants import greedy_segment

    models = make_models("tiny", draft="random")
    batch, context = 3, 40
    lc = workload.loop_config((p, k, s, n), batch=batch, context=context, max_new=64,
                              max_context_len=context + 64 + n, draft_attention=mode,
                              attention_backend="torch")
    eng = workload.engine(lc, models, scripted=True, max_reqs=batch, buckets=[batch],
                          compile_backend="none")
    for _ in range(batch):
        eng.submit(list(range(1, context + 1)), 64)
    eng.admit()
    want = floors.forward_flops(models, lc.spec, batch, context)
    with FlopCounterMode(display=False) as a:
        eng.launch(batch)
    seg, _ = greedy_segment(eng, batch, graphs=False)
    with FlopCounterMode(display=False) as c:
        seg.run()
    mm = torch.ops.aten.mm
    assert a.get_flop_counts()["Global"][mm] == want["a_matmul"]
    assert c.get_flop_counts()["Global"][mm] == want["c_matmul"]
