import json
import sys

import pytest

import children
import fa3_spec.harness.selfaudit as selfaudit
from fa3_spec import MODES
from fa3_spec.harness.selfaudit import ALL_STEPS, AuditCase, audit_case, default_grid


def test_default_grid_covers_modes_page_sizes_and_topk():
    cases = default_grid()
    seen = {(c.mode, c.cfg.page_size > 1, c.cfg.topk > 1) for c in cases}
    assert seen == {(m, p, k) for m in MODES for p in (False, True) for k in (False, True)}
    assert {c.step for c in cases if c.mode == "draft_decode"} == {0, 3, ALL_STEPS}
    assert any(c.cfg.page_size == 2 and c.cfg.topk == 8 for c in cases)  # the seed


def _cli_audit(tmp):
    """``fa3-spec audit`` on one configuration, as a command (in a child: children.py)."""
    out = tmp / "audit.json"
    # eager backend: the CLI and its rows are what is tested here; the same
    # steps and loop compile with aot_eager in test_iteration.py and test_eagle_loop.py.
    done = children.run([sys.executable, "-m", "fa3_spec.cli", "audit",
                         "--page-sizes", "2", "--topks", "8", "--json", str(out),
                         "--device", "cpu", "--compile-backend", "eager"], check=False)
    return done.returncode, done.stdout, json.loads(out.read_text()) if out.exists() else None


@pytest.mark.children(job=_cli_audit, heavy=True)
def test_audit_cli_writes_json_rows(child):
    code, stdout, rows = child.result()
    assert code == 0, stdout[-2000:]
    assert {r["mode"] for r in rows} == set(MODES) | {selfaudit.LOOP}
    loops = [r for r in rows if r["mode"] == selfaudit.LOOP]
    assert [(r["scope"], r["config"]["draft_attention"]) for r in loops] == [
        ("loop", "branch"), ("loop", "ancestors")]
    assert {r["step"] for r in rows if r["mode"] == "draft_decode" and r["scope"] == "builder"} == {
        0, 3, ALL_STEPS}
    for r in rows:
        assert {"mode", "config", "graph_breaks", "recompiles", "host_syncs",
                "cuda_graph", "parity"} <= set(r)
        assert r["config"]["page_size"] == 2 and r["config"]["topk"] == 8
        assert r["graph_breaks"] == 0 and r["recompiles"] == 0 and r["parity"] is True
        assert r["host_syncs"] is None and r["cuda_graph"] == "skipped"
    assert "fa3-spec audit: 12 cases" in stdout  # the filtered grid, not all 61 rows
    assert "wrote " in stdout


def test_audit_flags_a_leaky_builder(monkeypatch):
    """A builder with a host sync and a value-dependent shape is reported unclean."""
    real_build = selfaudit.build_metadata

    def leaky(mode, cfg, *, step=0, **kwargs):
        md = real_build(mode, cfg, step=step, **kwargs)
        if int(md.cache_seqlens.sum().item()) > 10**9:  # value-dependent branch
            return md
        return md

    monkeypatch.setattr(selfaudit, "build_metadata", leaky)
    case = [c for c in default_grid(page_sizes=(2,), topks=(8,)) if c.mode == "decode"][0]
    row = audit_case(case, device="cpu")
    assert not row.clean
    assert row.graph_breaks > 0 or row.data_dependent > 0


def test_audit_flags_a_parity_bug(monkeypatch):
    import dataclasses

    real_build = selfaudit.build_metadata

    def off_by_one(mode, cfg, *, step=0, **kwargs):
        md = real_build(mode, cfg, step=step, **kwargs)
        return dataclasses.replace(md, cache_seqlens=md.cache_seqlens + 1)

    monkeypatch.setattr(selfaudit, "build_metadata", off_by_one)
    case = AuditCase("decode", default_grid(page_sizes=(16,), topks=(1,))[0].cfg)
    row = audit_case(case, device="cpu")
    assert not row.parity and not row.clean


def test_audit_checks_the_iteration_builder_against_the_per_step_reference(monkeypatch):
    import dataclasses

    real = selfaudit.build_draft_iteration_metadata

    def last_step_off(cfg, **kwargs):
        steps = list(real(cfg, **kwargs))
        casc = steps[-1]
        expand = dataclasses.replace(casc.expand, cache_seqlens=casc.expand.cache_seqlens + 1)
        steps[-1] = dataclasses.replace(casc, expand=expand)
        return tuple(steps)

    case = [c for c in default_grid(page_sizes=(2,), topks=(8,)) if c.step == ALL_STEPS][0]
    assert audit_case(case, device="cpu").clean
    monkeypatch.setattr(selfaudit, "build_draft_iteration_metadata", last_step_off)
    row = audit_case(case, device="cpu")
    assert not row.parity and any("step 3" in p for p in row.problems)


def test_self_audit_rows_are_callable_audits_with_findings_at_their_lines(monkeypatch):
    """One audit engine: a self-audit row carries `audit_callable`'s findings, each in
    its column at the user's line, and its own labels (mode, scope, config, step)."""
    import inspect

    real_build = selfaudit.build_metadata

    def leaky(mode, cfg, *, step=0, **kwargs):
        md = real_build(mode, cfg, step=step, **kwargs)
        md.cache_seqlens.sum().item()  # the leak: a host sync
        return md

    monkeypatch.setattr(selfaudit, "build_metadata", leaky)
    case = AuditCase("decode", default_grid(page_sizes=(16,), topks=(1,))[0].cfg)
    row = audit_case(case, device="cpu")
    line = inspect.getsourcelines(leaky)[1] + 2
    assert row.scope == "builder" and row.mode == "decode" and row.config["page_size"] == 16
    assert any(f.file == __file__ and f.line == line for f in row.findings
               if f.column in ("graph_breaks", "data_dependent")), row.problems
    assert row.problems == [str(f) for f in row.findings]


def test_ancestor_rows_are_checked_against_the_key_set_oracle(monkeypatch):
    import dataclasses

    case = [c for c in default_grid(page_sizes=(2,), topks=(8,))
            if c.draft_attention == "ancestors"][0]
    assert case.mode == "draft_decode" and case.step == 3
    row = audit_case(case, device="cpu", compile_backend="eager")
    assert row.clean and row.config["draft_attention"] == "ancestors"
    real_build = selfaudit.build_metadata

    def one_key_short(mode, cfg, *, step=0, **kwargs):
        md = real_build(mode, cfg, step=step, **kwargs)
        expand = dataclasses.replace(md.expand, cache_seqlens=(md.expand.cache_seqlens - 1).clamp(min=0))
        return dataclasses.replace(md, expand=expand)

    monkeypatch.setattr(selfaudit, "build_metadata", one_key_short)
    row = audit_case(case, device="cpu", compile_backend="eager")
    assert not row.parity and any("key-set oracle" in p for p in row.problems)
