"""The benchmarks' layout, and their entry points end to end in CPU smoke modes.

Layout: a fixed set of entry points (``benchmarks/NAME.py``, the only files
with a ``__main__`` block), each a table of subcommand modules; every other
file a helper; no import cycle among them; each entry point named in
``benchmarks/README.md``.

Smoke runs exercise every code path at tiny sizes; their timings mean nothing.
Each runs as a script in a child process, side by side with the others
(children.py).
"""

import ast
import json
import pathlib
import re
import sys

import pytest

from fa3_spec.eagle.policy import CostProfile

import children
from helpers import MAKING_WORDS

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
ENTRY_POINTS = {"loop.py", "compile.py", "kernel_bench.py", "metadata.py", "audit_upstream.py",
                "load_checkpoint.py", "smollm2_checkpoint.py", "draft_heads.py"}


def _has_main_block(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
               for node in tree.body)


def _local_imports(tree: ast.Module) -> set:
    names = {p.stem for p in BENCH.glob("*.py")}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found & names


TREES = {p.name: ast.parse(p.read_text()) for p in sorted(BENCH.glob("*.py"))}


def test_only_the_entry_points_run_as_scripts():
    assert {name for name, tree in TREES.items() if _has_main_block(tree)} == ENTRY_POINTS


def test_every_subcommand_module_has_its_prog_help_and_main():
    sys.path.insert(0, str(BENCH))
    try:
        import compile as compile_entry
        import kernel_bench
        import loop
        import metadata
    finally:
        sys.path.remove(str(BENCH))
    for entry in (loop, compile_entry, kernel_bench, metadata):
        name = pathlib.Path(entry.__file__).name
        for sub, module in entry.COMMANDS.items():
            assert module.PROG == f"{name} {sub}", (name, sub)
            assert module.HELP and callable(module.main)


def test_the_benchmarks_import_each_other_without_a_cycle():
    edges = {name[:-3]: _local_imports(tree) for name, tree in TREES.items()}
    state = {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(edges[module]):
            assert state.get(target) != "open", "import cycle: " + " -> ".join(path + [target])
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    entries = {e[:-3] for e in ENTRY_POINTS}
    assert not any(edges[m] & entries for m in edges), "a module imports an entry point"


def test_the_readme_names_every_entry_point_and_subcommand():
    text = (BENCH / "README.md").read_text()
    assert all(f"benchmarks/{name}" in text for name in ENTRY_POINTS)
    sys.path.insert(0, str(BENCH))
    try:
        import compile as compile_entry
        import kernel_bench
        import loop
        import metadata
    finally:
        sys.path.remove(str(BENCH))
    for entry in (loop, compile_entry, kernel_bench, metadata):
        for sub in entry.COMMANDS:
            assert f"{pathlib.Path(entry.__file__).name} {sub}" in text, sub


RESULTS = BENCH / "results"
REPORTS = [BENCH / "RESULTS.md", BENCH / "README.md", ROOT / "compile_tests" / "GPU_RESULTS.md"]


def _keys(doc) -> set:
    if isinstance(doc, dict):
        return set(doc) | {k for v in doc.values() for k in _keys(v)}
    if isinstance(doc, list):
        return {k for v in doc for k in _keys(v)}
    return set()


def test_every_result_file_is_cited_holds_no_prose_and_names_its_commit():
    import re

    cited = "\n".join(p.read_text() for p in REPORTS)
    files = sorted(p.name for p in RESULTS.iterdir())
    assert [f for f in files if f not in cited] == []
    named = set(re.findall(r"`(\w+_(?:h200|cpu)\w*\.json)`", cited))
    assert named - set(files) == set()
    for f in files:
        doc = json.loads((RESULTS / f).read_text())
        assert not {k for k in _keys(doc) if k in ("note", "notes") or k.endswith("_note")}, f
        assert "commit" in _keys(doc), f
    for page in REPORTS:
        text = page.read_text()
        assert not [m.group(0) for p in MAKING_WORDS for m in re.finditer(p, text, re.I)], page.name


def smoke(script, *extra, out="rows.json", env=None):
    """A job: ``benchmarks/SCRIPT EXTRA... --smoke --json TMP/OUT``; the JSON it
    wrote, or None when the script exits 2 (a dependency it names is missing).
    ``{tmp}`` in EXTRA is the job's directory."""
    def job(tmp):
        path = tmp / out
        done = children.run([sys.executable, str(BENCH / script),
                             *(a.format(tmp=tmp) for a in extra), "--smoke", "--json", str(path)],
                            cwd=ROOT, check=False, env_extra=env)
        if done.returncode == 2:
            return None
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(path.read_text())
    return job


@pytest.mark.children(job=smoke("metadata.py", "scenarios"))
def test_metadata_scenarios_smoke(child):
    rows = child.result()["rows"]
    assert {r["kind"] for r in rows} == {"metadata", "draft_loop", "verify"}
    assert all(r["upstream_host_us"] > 0 for r in rows if r["kind"] == "metadata")
    assert all(r["upstream_baseline"] in ("sglang-0.5.23", "model") for r in rows)
    assert all("upstream_baseline_why" in r for r in rows
               if r["kind"] == "draft_loop" and r["upstream_baseline"] == "model")


@pytest.mark.children(job=smoke("metadata.py", "perf", out="perf.json"))
def test_metadata_perf_smoke(child):
    doc = child.result()
    assert doc["cold_capture_s"] > 0 and doc["warm_capture_s"] > 0
    keys = {"scenario", "batch", "page_size", "topk", "runner_staging_us", "metadata_device_us",
            "metadata_kernels_per_step", "loop_over_floor_device_pct", "upstream_baseline"}
    assert doc["rows"] and all(keys <= set(r) for r in doc["rows"])
    assert all(r["upstream_baseline"] in ("sglang-0.5.23", "model") for r in doc["rows"])
    # The capture rows are `compile.py runner --smoke` in a child: every step mode.
    rows = doc["compile_rows"]
    assert len(rows) == 4 and all(r["replay_rel_err"] < 1e-4 for r in rows)


@pytest.mark.children(job=smoke("metadata.py", "staging"))
def test_metadata_staging_smoke(child):
    rows = child.result()["rows"]
    assert [r["batch"] for r in rows] == [1, 8, 64] and all(r["call_host_us"] > 0 for r in rows)


@pytest.mark.children(job=smoke("metadata.py", "adapter", env={"TRITON_INTERPRET": "1"}))
def test_metadata_adapter_smoke(child):
    doc = child.result()
    if doc is None:
        pytest.skip("sglang's code is unavailable here")
    assert [r["bs"] for r in doc["rows"]] == [1, 3] and all(r["parity"] for r in doc["rows"])


@pytest.mark.children(job=smoke("compile.py", "regions"))
def test_compile_regions_smoke(child):
    rows = child.result()["rows"]
    assert [(r["layers"], r["mode"], r["region_programs"]) for r in rows] == [
        (2, "regions", 2)]  # layer 0, and the rest
    assert rows[0]["max_abs_diff_vs_eager"] == 0  # eager backend: the same ops


@pytest.mark.children(job=smoke("load_checkpoint.py", "--dir", "{tmp}/ckpt", out="load.json"))
def test_load_checkpoint_smoke(child):
    pytest.importorskip("transformers")
    doc = child.result()
    assert doc["read"]["bytes"] > 0 and doc["load"]["load_s"] > 0
    assert [r["models"] for r in doc["loop"]] == ["preset random", "loaded + random draft",
                                                  "loaded + EAGLE-3 head"]
    assert all(r["tokens"] > 0 and r["acceptance"].startswith("scripted") for r in doc["loop"])


@pytest.mark.children(job=smoke("loop.py", "ancestors", out="ancestors.json"))
def test_loop_ancestors_smoke(child):
    doc = child.result()
    [row] = doc["acceptance_rows"]
    assert row["same_tokens"] is True and row["branch"] >= 1 and row["ancestors"] >= 1
    assert [r["draft_attention"] for r in doc["cost_rows"]] == ["branch", "ancestors"]
    assert all(r["ms_per_iteration"] > 0 and r["acceptance"].startswith("scripted")
               for r in doc["cost_rows"])


@pytest.mark.children(job=smoke("loop.py", "sampling", out="sampling.json"))
def test_loop_sampling_smoke(child):
    rows = child.result()["rows"]
    assert [r["variant"] for r in rows] == ["greedy", "greedy_rows", "sampled"]
    assert all(r["ms_per_iteration"] > 0 and r["mean_accept_len"] >= 1 for r in rows)
    assert rows[0]["mean_accept_len"] == rows[1]["mean_accept_len"]  # temperature 0 is greedy


@pytest.mark.children(job=smoke("loop.py", "costs", out="costs.json"))
def test_loop_costs_smoke(child):
    doc = child.result()
    # One engine per shape over both buckets.
    assert [(r["batch"], r["shape"]) for r in doc["rows"]] == [
        (b, s) for s in ("plain", "1,2,3", "4,3,8") for b in (1, 2)]
    assert sorted(doc["capture_s"]) == ["1,2,3", "4,3,8", "plain"]
    assert all(r["ms_per_iteration"] > 0 for r in doc["rows"])
    costs = CostProfile(plain={int(b): v for b, v in doc["cost_profile"]["plain"].items()},
                        shapes={int(b): r for b, r in doc["cost_profile"]["shapes"].items()})
    assert sorted(costs.shapes[2]) == ["1,2,3", "4,3,8"]


@pytest.mark.children(job=smoke("loop.py", "policy", out="policy.json"))
def test_loop_policy_smoke(child):
    doc = child.result()
    assert [(r["profile"], r["batch"]) for r in doc["rows"]] == [("high", 1), ("high", 2)]
    assert all(r["shape"] in ("off", "1,2,3", "4,3,8") and r["plain_tokens_per_s"] > 0
               and r["loop_tokens_per_s"] > 0 for r in doc["rows"])
    assert sorted(doc["cost_profile"]["shapes"]["1"]) == ["1,2,3", "4,3,8"]
    # Every (shape, bucket) timed once per profile, the fixed config among them.
    assert sorted({(m["page_size"], m["shape"]) for m in doc["measured"]}) == [
        (2, "1,2,3"), (2, "4,3,8"), (2, "plain")]
    assert all(m["accept_length"] >= 1 for m in doc["measured"])
    assert [(r["config"], r["batch"]) for r in doc["fixed"]] == [("2,4,3,8", 1), ("2,4,3,8", 2)]
    assert [r["batch"] for r in doc["plain"]] == [1, 2]
    assert doc["commit"] and doc["rows"][0]["largest_shape"] == "4,3,8"


def test_loop_policy_resumes_only_a_run_of_the_same_settings(tmp_path):
    sys.path.insert(0, str(BENCH))
    import loop_policy

    settings = dict(preset="tiny", context=32, page_size=2, draft_attention="ancestors",
                    profiles={"high": [[0.7]]}, batches=[1, 2], iters=3, warmup=1, seed=0,
                    device="cpu", draft_logit_std=None, kernels={"expand_attention": "triton"})
    row = dict(page_size=2, shape="4,3,8", batch=1, profile="high", ms_per_iteration=1.5,
               tokens_per_s=2.0, accept_length=3.0)
    done = tmp_path / "done.json"
    done.write_text(json.dumps(dict(settings, measured=[row], capture_s={"P 2 4,3,8": 0.5})))
    doc = dict(settings, measured=[], capture_s={})
    assert loop_policy.resumed(done, doc) == {(2, (4, 3, 8)): {(1, "high"): (1.5, 2.0, 3.0)}}
    assert doc["measured"] == [row] and doc["capture_s"] == {"P 2 4,3,8": 0.5}
    with pytest.raises(ValueError, match="differs in batches, seed"):
        loop_policy.resumed(done, dict(settings, seed=1, batches=[1]))
    with pytest.raises(ValueError, match="differs in kernels"):  # another kernel's timings
        loop_policy.resumed(done, dict(settings, kernels={"expand_attention": "fa3"}))
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ValueError, match="bad.json is not a loop.py policy result"):
        loop_policy.resumed(tmp_path / "bad.json", dict(settings))


@pytest.mark.parametrize("value", ["0", "-3"])
def test_loop_policy_refuses_a_max_shapes_below_one_before_measuring(value, capsys):
    sys.path.insert(0, str(BENCH))
    import loop

    assert loop.main(["policy", "--smoke", "--max-shapes", value]) == 2
    assert f"--max-shapes must be >= 1, got {value}" in capsys.readouterr().err


@pytest.mark.parametrize("extra, says", [
    (["--shapes", "1,2,3", "1,1,5"], r"--shapes: shape \(1, 1, 5\): 1 steps of topk 1 draft 1"),
    (["--shapes", "1, 2, 3"], "--shapes: a shape key is 'topk,steps,N'"),
    (["--out", "/nonexistent/costs.json"], "--out: cannot write '/nonexistent/costs.json'"),
    (["--out", "OUTDIR"], "--out: cannot write"),
])
def test_loop_costs_refuses_bad_shapes_and_outputs_before_measuring(extra, says, tmp_path,
                                                                    capsys, monkeypatch):
    sys.path.insert(0, str(BENCH))
    import loop
    import loop_costs

    def measured(*_a, **_k):
        raise AssertionError("measured before its arguments were checked")

    monkeypatch.setattr(loop_costs, "ShapeEngine", measured)
    monkeypatch.setattr(loop_costs, "random_models", measured)
    extra = [str(tmp_path) if a == "OUTDIR" else a for a in extra]
    if "--out" not in extra:
        extra += ["--out", str(tmp_path / "costs.json")]
    assert loop.main(["costs", "--device", "cpu", "--batches", "1", *extra]) == 2
    assert re.search(says, capsys.readouterr().err)


def test_loop_policy_refuses_a_cost_profile_missing_a_batch_before_measuring(tmp_path, capsys,
                                                                          monkeypatch):
    sys.path.insert(0, str(BENCH))
    import loop
    import loop_costs

    def measured(*_a, **_k):
        raise AssertionError("measured before its arguments were checked")

    monkeypatch.setattr(loop_costs, "random_models", measured)
    costs = tmp_path / "c1.json"  # bucket 1 only; --smoke times batches 1 and 2
    CostProfile(plain={1: 10.0}, shapes={1: {"1,2,3": 11.0}}).save(costs)
    argv = ["policy", "--smoke", "--cost-profile", str(costs)]
    assert loop.main(argv) == 2
    assert "--cost-profile" in (err := capsys.readouterr().err) and "--batches [2]" in err
