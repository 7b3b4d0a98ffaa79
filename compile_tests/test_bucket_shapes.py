"""Per-bucket tree shapes in one engine (CPU, torch backend, float64).

Each batch bucket runs its own shape, or a plain decode step; the state is as
wide as the widest shape, so a request keeps its tokens when the batch moves
between buckets. Checked: exact to greedy decoding with joins and finishes
through every bucket, under both draft semantics; a plain bucket's sampled
rows draw exactly what plain sampled decoding draws; the statistics of plain
steps; the state widths; bad shapes refused by name; ``fa3-spec eagle``
choosing and reporting each bucket's shape from a cost and an acceptance
profile.
"""

import dataclasses
import json
import re

import pytest
import torch

import fa3_spec
from fa3_spec.eagle import EagleEngine, LoopConfig, cli, greedy_generate
from fa3_spec.eagle.iteration import StateWidths, eagle_iteration, empty_state, plain_iteration
from fa3_spec.eagle.policy import AcceptanceProfile, CostProfile
from fa3_spec.eagle.sampling import RequestSampling, SamplingParams
from fa3_spec.probes import RecordingBackend
from test_eagle_loop import models_for, workload

MAX_NEW = 24
MAX_PROMPT = 40


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def shaped_engine(shapes, *, p=2, base=(4, 3, 8), max_bs=8, draft_attention="ancestors",
                  models=None, sized_for=None, **kw):
    """An engine over buckets 1, 2, 4, 8 whose pool holds the rows of every
    shape (of ``sized_for``, default ``shapes``' own)."""
    models = models or models_for()
    sized_for = [s for s in shapes.values() if s is not None] if sized_for is None else sized_for
    widest = max([base] + list(sized_for), key=lambda s: s[2])[2]
    spec = fa3_spec.SpecConfig(page_size=p, topk=base[0], num_steps=base[1],
                               num_draft_tokens=base[2], max_bs=max_bs,
                               max_context_len=MAX_PROMPT + MAX_NEW + widest)
    configs = [spec] + [dataclasses.replace(spec, topk=k, num_steps=s, num_draft_tokens=n)
                        for k, s, n in sized_for]
    pages = max(c.pool_pages(2 * max_bs, draft_attention) for c in configs)
    lc = LoopConfig(dataclasses.replace(spec, num_pages=pages), max_new_tokens=MAX_NEW,
                    attention_backend="torch", draft_attention=draft_attention)
    return EagleEngine(lc, models, max_reqs=2 * max_bs, buckets=[1, 2, 4, 8], shapes=shapes,
                       **kw)


def run_recording_buckets(eng, prompts, news, params=None):
    launched = []
    launch = eng.launch
    eng.launch = lambda bucket: (launched.append(bucket), launch(bucket))[1]
    params = params or [{}] * len(prompts)
    rids = [eng.submit(pr, m, **kw) for pr, m, kw in zip(prompts, news, params)]
    out = eng.run()
    return [out[r] for r in rids], launched


MIXED = {1: (4, 3, 8), 2: (1, 4, 5), 4: None, 8: (2, 3, 6)}


@pytest.mark.parametrize("draft_attention", ["ancestors", "branch"])
def test_every_bucket_runs_its_own_shape_and_stays_exact_to_greedy(draft_attention):
    """Eight requests whose later rows finish first, so the batch shrinks
    through buckets 8, 4, 2 and 1, then six more that join freed rows."""
    models = models_for()
    prompts, _ = workload(14, 2, max_new=MAX_NEW)
    news = [24, 16, 8, 8, 4, 4, 4, 4] + [6, 9, 12, 5, 8, 11]
    eng = shaped_engine(MIXED, draft_attention=draft_attention)
    got, launched = run_recording_buckets(eng, prompts[:8], news[:8])
    more, launched_more = run_recording_buckets(eng, prompts[8:], news[8:])
    ref = greedy_generate(models, prompts, news, page_size=2, attention_backend="torch")
    assert got + more == ref
    assert launched[0] == 8 and set(launched) == {1, 2, 4, 8}
    assert sorted(launched) == sorted(launched, reverse=True)[::-1]
    assert eng.stats.admitted == 14 and launched_more[0] == 8
    assert len(eng.shape_runners) == 4 and eng.shapes == MIXED


def test_a_plain_bucket_draws_what_plain_sampled_decoding_draws():
    models = models_for()
    prompts, news = workload(6, 2, max_new=MAX_NEW, min_new=8)
    requests = [RequestSampling.create(0.0, seed=1)] + [
        RequestSampling.create(0.9, top_k=(0, 20)[i % 2], top_p=(1.0, 0.9)[i % 2], seed=40 + i)
        for i in range(5)]
    params = [dict(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, seed=r.seed)
              for r in requests]
    eng = shaped_engine({b: None for b in (1, 2, 4, 8)})
    got, _ = run_recording_buckets(eng, prompts, news, params)
    want = greedy_generate(models, prompts, news, page_size=2, attention_backend="torch",
                           sampling=SamplingParams.stack(requests, "cpu"))
    assert got == want
    assert got[1:] != greedy_generate(models, prompts[1:], news[1:], page_size=2,
                                      attention_backend="torch")
    # Plain steps emit one token each and offer no draft.
    stats = eng.stats
    assert stats.mean_accept_len == 1.0 and int(stats.offered.sum()) == 0


def test_a_request_keeps_its_tokens_when_it_moves_from_plain_steps_to_a_tree():
    """Requests start in a plain bucket (8 rows busy), then the batch shrinks
    into speculating buckets: the draft resumes from stale state and the
    output is still greedy's, with drafts accepted again."""
    models = models_for()
    prompts, _ = workload(8, 2, max_new=MAX_NEW)
    news = [24, 20, 16, 12, 4, 4, 4, 4]
    eng = shaped_engine({1: (4, 3, 8), 2: (4, 3, 8), 4: (4, 3, 8), 8: None})
    got, launched = run_recording_buckets(eng, prompts, news)
    assert got == greedy_generate(models, prompts, news, page_size=2, attention_backend="torch")
    assert launched[:4] == [8] * 4 and launched[4] == 4  # 4 plain steps, then trees
    assert eng.stats.mean_accept_len > 1.5


def test_the_state_is_as_wide_as_the_widest_shape():
    eng = shaped_engine(MIXED)
    assert eng.widths == StateWidths(topk=4, tree=8, depth=4)
    st = eng.state
    assert st["cand_tokens"].shape == (8, 4) and st["parents"].shape == (8, 8)
    assert st["path"].shape == (8, 5)
    assert eng.loop_config(2).spec.topk == 1 and eng.loop_config(8).spec.topk == 2
    assert eng.loop_config(3) is eng.lc  # bucket 4 decodes plainly on the pool of lc
    with pytest.raises(AttributeError, match="runners"):
        eng.runner
    narrow = empty_state(eng.loop_config(1), models_for(), 2, "cpu", widths=StateWidths(2, 8, 4))
    pool = eng.pool
    with pytest.raises(ValueError, match="narrower"):
        eagle_iteration(eng.loop_config(1), models_for(), pool.target_kv, pool.draft_kv,
                        pool.req_to_token, narrow)


def test_a_single_shape_engine_keeps_one_runner():
    eng = shaped_engine({})
    assert eng.runner is eng.runners[1] is eng.runners[8]
    assert eng.widths == StateWidths(4, 8, 3)


def test_the_engine_loads_its_compile_cache_once_before_every_shape_and_saves_once_after(
        tmp_path, monkeypatch):
    # torch's cache file keeps only the last save's artifacts of each kind, so
    # a save per shape would leave the restart with the last shape's alone.
    from fa3_spec.eagle import engine as engine_module

    calls = []
    monkeypatch.setattr(engine_module, "load_compile_cache", lambda p: calls.append(("load", p)))
    monkeypatch.setattr(engine_module, "save_compile_cache", lambda p: calls.append(("save", p)))
    path = str(tmp_path / "cache.bin")
    eng = shaped_engine({1: (4, 3, 8), 2: (1, 2, 3), 4: None, 8: None},
                        compile_backend="inductor", graphs=False, cache_path=path)
    for shape, runner in eng.shape_runners.items():
        assert runner.cache_path is None
        real = runner.capture
        monkeypatch.setattr(runner, "capture", lambda real=real, shape=shape: (
            calls.append(("capture", shape)), real())[1])
    eng.policy = dataclasses.replace(eng.policy, graphs=True)  # as on CUDA: capture compiles
    eng.capture()
    assert calls == [("load", path)] + [("capture", s) for s in eng.shape_runners] + [
        ("save", path)]
    assert len(eng.shape_runners) == 3


def test_without_graphs_the_engine_saves_its_compile_cache_once_after_the_first_run(
        tmp_path, monkeypatch):
    # Each bucket compiles on its first launch, after `capture`: a save there
    # would find nothing to write.
    from fa3_spec.eagle import engine as engine_module

    calls = []
    monkeypatch.setattr(engine_module, "load_compile_cache", lambda p: calls.append("load"))
    monkeypatch.setattr(engine_module, "save_compile_cache", lambda p: calls.append("save"))
    eng = shaped_engine({1: (4, 3, 8), 2: (1, 2, 3)}, compile_backend="inductor",
                        graphs=False, cache_path=str(tmp_path / "cache.bin"))
    for runner in eng.shape_runners.values():
        monkeypatch.setattr(runner, "capture", lambda: {})
        monkeypatch.setattr(runner, "replay", lambda *a: calls.append("replay"))
    monkeypatch.setattr(eng, "step", lambda progress=None: calls.append("step") or False)
    eng.capture()
    assert calls == ["load"]
    eng.run()
    eng.run()
    assert calls == ["load", "step", "save", "step"]


@pytest.mark.parametrize("shapes, error, says", [
    ({3: (4, 3, 8)}, ValueError, r"shapes names \[3\]"),
    ({2: (4, 3)}, ValueError, r"shapes\[2\] must be"),
    ({2: (0, 3, 8)}, ValueError, r"shapes\[2\] must be"),
    ({2: (1, 2, 8)}, ValueError, r"shapes\[2\] = \(1, 2, 8\): .*exceeds the 2 draft candidates"),
    ({2: (600, 2, 8)}, ValueError, "exceeds the draft's vocabulary"),
    ([(4, 3, 8)], TypeError, "shapes must map buckets"),
])
def test_bad_shapes_are_refused_by_name(shapes, error, says):
    with pytest.raises(error, match=says):
        shaped_engine(shapes, sized_for=[])


def test_the_plain_step_compiles_fullgraph_with_no_data_dependent_ops():
    models = models_for()
    prompts, news = workload(3, 2, max_new=MAX_NEW)
    eng = shaped_engine({b: None for b in (1, 2, 4, 8)})
    for i, (prompt, m) in enumerate(zip(prompts, news)):
        eng.submit(prompt, m, **(dict(temperature=1.0, seed=3) if i == 1 else {}))
    eng.step()
    pool, lc = eng.pool, eng.loop_config(4)
    saved = (pool.target_kv.k.clone(), pool.target_kv.v.clone())
    backend = RecordingBackend("aot_eager")

    def step(st):
        return plain_iteration(lc, models, pool.target_kv, pool.req_to_token, st)

    st = {k: v[:4].clone() for k, v in eng.state.items()}
    got = torch.compile(step, fullgraph=True, backend=backend)(st)
    pool.target_kv.k.copy_(saved[0])
    pool.target_kv.v.copy_(saved[1])
    want = step(st)
    assert backend.frame_count == 1 and backend.data_dependent == []
    for key in want:
        assert torch.equal(got[key], want[key]), key


# ------------------------------------------------------------------ the CLI
def _profiles(tmp_path):
    costs = tmp_path / "costs.json"
    CostProfile(plain={1: 10.0, 2: 10.0, 4: 10.0},
                shapes={1: {"4,3,8": 12.0, "1,3,4": 11.0}, 2: {"1,3,4": 11.0, "4,3,8": 30.0},
                        4: {"1,3,4": 50.0, "4,3,8": 50.0}}, device="cpu", model="tiny").save(costs)
    acceptance = tmp_path / "acceptance.json"
    AcceptanceProfile(((0.7, 0.1, 0.05, 0.05), (0.7, 0.1, 0.0, 0.0),
                       (0.7, 0.1, 0.0, 0.0))).save(acceptance)
    return costs, acceptance


def test_cli_runs_the_shape_the_profiles_choose_per_bucket_and_reports_it(tmp_path, capsys):
    costs, acceptance = _profiles(tmp_path)
    out, measured = tmp_path / "eagle.json", tmp_path / "measured.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--batch", "4", "--requests", "7",
            "--buckets", "1", "2", "4", "--max-new-tokens", "16", "--prompt-len", "20",
            "--check-greedy", "--attention-backend", "torch", "--cost-profile", str(costs),
            "--acceptance-profile", str(acceptance), "--acceptance-out", str(measured),
            "--json", str(out)]
    assert cli.main(argv) == 0
    res = json.loads(out.read_text())
    rows = {r["bucket"]: r for r in res["speculation"]}
    assert [rows[b]["shape"] for b in (1, 2, 4)] == ["4,3,8", "1,3,4", "off"]
    assert rows[4]["speedup"] == 1.0 and rows[1]["speedup"] > rows[2]["speedup"] > 1.0
    assert res["exact"] is True and res["config"]["cost_profile"] == str(costs)
    # The flags' shape runs nowhere: the config leaves it out, the banner says so.
    assert [res["config"][k] for k in ("topk", "num_steps", "num_draft_tokens")] == [None] * 3
    captured = capsys.readouterr()
    printed = captured.out
    # What the run never offered is written as 0, and said so by (depth, rank).
    rates = AcceptanceProfile.load(measured).rates
    unseen = [(d + 1, r) for d, row in enumerate(res["acceptance_by_depth_and_rank"])
              for r, v in enumerate(row) if v is None]  # None: never offered
    assert unseen and all(rates[d - 1][r] == 0 for d, r in unseen)
    assert f"no draft node at (depth, rank) {', '.join(map(str, unseen))} was offered" \
        in captured.err
    assert "a shape per bucket (below)" in printed and "topk=" not in printed.splitlines()[0]
    assert "bucket   4: plain decoding" in printed and "topk,steps,N = 4,3,8" in printed
    assert AcceptanceProfile.load(measured).rates  # the run's own profile, for the next one


def test_cli_max_shapes_bounds_the_shapes_it_compiles(tmp_path):
    costs, acceptance = _profiles(tmp_path)
    out = tmp_path / "eagle.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--batch", "4", "--requests", "5",
            "--buckets", "1", "2", "4", "--max-new-tokens", "8", "--prompt-len", "12",
            "--check-greedy", "--attention-backend", "torch", "--cost-profile", str(costs),
            "--acceptance-profile", str(acceptance), "--max-shapes", "2", "--quiet",
            "--json", str(out)]
    assert cli.main(argv) == 0
    res = json.loads(out.read_text())
    shapes = [r["shape"] for r in sorted(res["speculation"], key=lambda r: r["bucket"])]
    # Unbounded: 4,3,8 / 1,3,4 / off. Two shapes: bucket 1 gives up the least.
    assert shapes == ["1,3,4", "1,3,4", "off"]
    assert res["exact"] is True and res["config"]["max_shapes"] == 2


@pytest.mark.parametrize("extra, says", [
    (["--cost-profile", "COSTS"], "go together"),
    (["--cost-profile", "COSTS", "--acceptance-profile", "NOPE"], "--acceptance-profile"),
    (["--cost-profile", "COSTS", "--acceptance-profile", "ACC", "--buckets", "1", "3"],
     r"no measurement for bucket\(s\) \[3\]"),
    (["--max-shapes", "2"], "--max-shapes bounds the shapes"),
    (["--cost-profile", "COSTS", "--acceptance-profile", "ACC", "--max-shapes", "0"],
     "--max-shapes: .*must be >= 1"),
    (["--cost-profile", "WIDE", "--acceptance-profile", "ACC"],
     r"--cost-profile: the shapes chosen for buckets \[1, 2, 4\] draw more children .* "
     r"vocabulary of 512 tokens"),
])
def test_cli_refuses_bad_profiles_as_usage_errors(tmp_path, capsys, extra, says):
    costs, acceptance = _profiles(tmp_path)
    wide = tmp_path / "wide.json"  # the cheapest shape draws more children than the vocabulary
    CostProfile(plain={1: 10.0, 2: 10.0, 4: 10.0},
                shapes={b: {"600,1,2": 1.0} for b in (1, 2, 4)}).save(wide)
    extra = [{"COSTS": str(costs), "ACC": str(acceptance), "WIDE": str(wide)}.get(a, a)
             for a in extra]
    argv = ["--preset", "tiny", "--device", "cpu", "--batch", "3", "--requests", "2",
            "--attention-backend", "torch"] + extra
    if "--buckets" not in extra:
        argv = [a if a != "3" else "4" for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert re.search(says, capsys.readouterr().err)


def test_the_base_shape_is_checked_too_and_buckets_must_be_ints():
    with pytest.raises(ValueError, match=r"lc.spec: topk=600 exceeds the draft's vocabulary"):
        shaped_engine({b: (4, 3, 8) for b in (1, 2, 4, 8)}, base=(600, 2, 8), sized_for=[])
    with pytest.raises(ValueError, match="keyed by int buckets"):
        shaped_engine({True: (4, 3, 8)}, sized_for=[])
    # The state is as wide as what the buckets run, not the base shape.
    eng = shaped_engine({b: (1, 3, 4) for b in (1, 2, 4, 8)}, sized_for=[])
    assert eng.widths == StateWidths(1, 4, 3)


def test_each_shape_compiles_under_its_own_code_object():
    eng = shaped_engine(MIXED)
    names = {r.step.__code__.co_name for r in eng.shape_runners.values()}
    assert names == {"plain_decode_step", "eagle_iteration_4_3_8", "eagle_iteration_1_4_5",
                     "eagle_iteration_2_3_6"}
    codes = {id(r.step.__code__) for r in eng.shape_runners.values()}
    assert len(codes) == 4


def test_cli_writes_no_acceptance_profile_from_a_run_that_never_drafted(tmp_path, capsys):
    costs, acceptance = tmp_path / "costs.json", tmp_path / "acceptance.json"
    CostProfile(plain={1: 1.0, 2: 1.0}, shapes={1: {"4,3,8": 90.0}, 2: {"4,3,8": 90.0}}).save(costs)
    AcceptanceProfile(((0.5, 0.1),)).save(acceptance)
    measured = tmp_path / "measured.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--batch", "2", "--requests", "3",
            "--max-new-tokens", "6", "--prompt-len", "8", "--attention-backend", "torch",
            "--cost-profile", str(costs), "--acceptance-profile", str(acceptance),
            "--acceptance-out", str(measured), "--quiet"]
    assert cli.main(argv) == 0
    assert not measured.exists() and "nothing written" in capsys.readouterr().err


def test_cli_refuses_a_compile_cache_it_could_not_write_before_the_run(tmp_path, capsys):
    argv = ["--preset", "tiny", "--device", "cpu", "--batch", "2", "--requests", "2",
            "--max-new-tokens", "4", "--quiet", "--compile-cache"]
    for path, says in ((tmp_path / "missing" / "cache.bin", "does not exist"),
                       (tmp_path, "is a directory")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv + [str(path)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "--compile-cache" in err and says in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_every_bucket_is_captured_with_its_own_shape_and_no_host_sync():
    """CUDA graphs per bucket (eager kernels captured, so the test compiles
    nothing), the shapes of `MIXED`: the batch moves through every bucket,
    every launch is a replay with no host sync, and the output is greedy's
    up to the near ties of bf16 (`fa3_spec.eagle.greedy_check`)."""
    from fa3_spec.eagle.greedy_check import compare_with_greedy
    from fa3_spec.eagle.models import make_models
    from fa3_spec.eagle.sync_probe import HostSyncProbe

    models = make_models("tiny", draft="derived", device="cuda")
    prompts, _ = workload(8, 2, max_new=MAX_NEW)
    news = [24, 16, 8, 8, 4, 4, 4, 4]
    eng = shaped_engine(MIXED, models=models, device="cuda", graphs=True, compile_backend="none")
    eng.capture()
    assert sum(len(r.buckets) for r in eng.shape_runners.values()) == 4
    with HostSyncProbe(eng) as probe:
        got, launched = run_recording_buckets(eng, prompts, news)
    assert set(launched) == {1, 2, 4, 8} and probe.counts and probe.worst == 0
    logits = []
    ref = greedy_generate(models, prompts, news, page_size=2, attention_backend="torch",
                          device="cuda", logits_out=logits)
    divergences = compare_with_greedy(got, ref, logits)
    assert all(d.near_tie for d in divergences), divergences
