"""The EAGLE loop on CPU (float64, torch backend): exact to greedy decoding.

Speculative output must equal plain greedy decoding of the target token for
token, with no tolerance, for batches with joins and finishes mid-run. The
full grid runs in ``test_eagle_sweep.py`` (opt-in: FA3_SPEC_EAGLE_SWEEP=1).
Tiny ops on a shared 2-core machine run far faster on one thread, so these
tests pin torch to one thread while they run.
"""

import dataclasses
import json

import pytest
import torch

import fa3_spec
from fa3_spec.probes import RecordingBackend
from fa3_spec.eagle import (
    EagleEngine, LoopConfig, eagle_iteration, empty_state, greedy_generate, make_models,
)
from fa3_spec.eagle import cli
from fa3_spec.eagle.models import KVCache
from fa3_spec.tree import tree_mask_from_parents


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


_MODELS = {}


def models_for(draft="derived"):
    if draft not in _MODELS:
        _MODELS[draft] = make_models("tiny", draft=draft, seed=0)
    return _MODELS[draft]


def make_engine(models, p, k, s, n, *, max_bs=4, max_new=40, max_prompt=40,
                draft_attention="branch", **kw):
    spec = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=s, num_draft_tokens=n,
                               max_bs=max_bs, max_context_len=max_prompt + max_new + n)
    spec = dataclasses.replace(spec, num_pages=spec.pool_pages(2 * max_bs, draft_attention))
    lc = LoopConfig(spec, max_new_tokens=max_new, attention_backend="torch",
                    draft_attention=draft_attention)
    return EagleEngine(lc, models, max_reqs=2 * max_bs, **kw)


def workload(n, p, max_new=40, seed=0, min_new=32):
    """Prompts of 1..40 tokens (page boundaries included), 32..40 new tokens each."""
    return cli.workload(n, page_size=p, max_prompt=40, max_new=max_new, vocab=512, seed=seed,
                        min_new=min(min_new, max_new))


def submit_all(eng, prompts, news, **kw):
    """Submit every request of a workload; their ids, in order."""
    return [eng.submit(prompt, m, **kw) for prompt, m in zip(prompts, news)]


def run_both(p, k, s, n, draft="derived", requests=14, max_bs=8, eos=-1,
             draft_attention="branch"):
    """Speculative and plain greedy outputs of the same workload, and the engine."""
    models = models_for(draft)
    prompts, news = workload(requests, p)
    eng = make_engine(models, p, k, s, n, max_bs=max_bs, draft_attention=draft_attention)
    submit_all(eng, prompts, news, eos_id=eos)
    out = eng.run()
    ref = greedy_generate(models, prompts, news, eos_ids=[eos] * requests, page_size=p,
                          attention_backend="torch")
    assert eng.stats.admitted == requests > max_bs  # rows were freed and reused (joins)
    return [out[i] for i in range(requests)], ref, eng


def check_exact(p, k, s, n, **kw):
    got, ref, eng = run_both(p, k, s, n, **kw)
    assert got == ref
    return eng.stats.mean_accept_len, eng


# (P, topk, num_steps, N): chain, tree, P = 1, P = 16, S = 2, page-crossing drafts.
CASES = [(2, 4, 5, 8), (16, 1, 5, 4), (1, 8, 2, 8), (16, 8, 5, 8), (2, 1, 2, 3)]


@pytest.mark.parametrize("p, k, s, n", CASES, ids=[f"P{p}K{k}S{s}N{n}" for p, k, s, n in CASES])
def test_speculative_equals_greedy_with_joins_and_finishes(p, k, s, n):
    mean, _ = check_exact(p, k, s, n)
    print(f"P={p} topk={k} steps={s} N={n}: mean accept length {mean:.2f}")
    assert mean >= 2.0  # the derived draft is accepted often (>= 2.5 where N, S allow 4+)


# Drafts on true ancestors: a tree on plain slots (P = 2, the tail-copy case of
# branch semantics) and a chain on any slots (topk = 1).
ANCESTOR_CASES = [(2, 8, 5, 8), (16, 1, 5, 4)]


@pytest.mark.parametrize("p, k, s, n", ANCESTOR_CASES,
                         ids=[f"P{p}K{k}S{s}N{n}" for p, k, s, n in ANCESTOR_CASES])
def test_drafts_on_true_ancestors_equal_greedy_with_joins_and_finishes(p, k, s, n):
    mean, _ = check_exact(p, k, s, n, requests=10, max_bs=4, draft_attention="ancestors")
    assert mean >= 2.5


def test_each_ancestor_step_reads_the_leafs_parent_path_and_its_own_slot():
    """The loop's wiring: leaf t's expand row at step i is its parent's row at
    step i-1 plus the slot it writes. Parents are recovered from the features
    (a leaf's input feature is its parent's output, bit for bit)."""
    models = models_for()
    calls = []

    def draft_forward(tokens, hidden, positions, slots, md, kv, **kw):
        out = models.draft_forward(tokens, hidden, positions, slots, md, kv, **kw)
        if isinstance(md, fa3_spec.CascadeMetadata):  # a draft-decode step
            calls.append((hidden, slots, md, out))
        return out

    k = 4
    eng = make_engine(_Models(models, draft_forward=draft_forward), 2, k, 5, 8, max_bs=2,
                      draft_attention="ancestors")
    prompts, news = workload(2, 2)
    submit_all(eng, prompts, news)
    eng.step()
    assert len(calls) == 4
    moved = 0
    for i, (hidden, slots, md, _) in enumerate(calls):
        rows = md.expand.page_table.long()
        assert md.expand.page_size == 1 and rows.shape[1] == i + 1
        assert md.prefix.draft_attention == "ancestors"
        assert torch.equal(rows[:, -1], slots)
        if i == 0:
            continue
        prev_rows, prev_out = calls[i - 1][2].expand.page_table.long(), calls[i - 1][3]
        for b in range(2):
            for t in range(k):
                n = b * k + t
                parents = [u for u in range(k) if torch.equal(hidden[n], prev_out[b * k + u])]
                assert parents, (i, b, t)
                assert torch.equal(rows[n, :i], prev_rows[b * k + parents[0]])
                moved += parents[0] != t
    assert moved > 0  # leaves descended from other branches: the case that matters


def test_random_draft_is_mostly_rejected_and_still_exact():
    mean, _ = check_exact(2, 4, 5, 8, draft="random", requests=6, max_bs=4)
    assert mean < 1.3


def test_high_acceptance_draft_reaches_long_runs():
    mean, eng = check_exact(2, 4, 5, 8, requests=8, max_bs=4)
    assert mean >= 2.5 and eng.stats.max_accept_len >= 5


def test_eos_stops_requests_early():
    models = models_for()
    prompts, news = workload(6, 2)
    ref = greedy_generate(models, prompts, news, page_size=2, attention_backend="torch")
    eos = ref[0][5]  # a token request 0 emits: it (and maybe others) stop there
    mean, eng = check_exact(2, 4, 5, 8, requests=6, max_bs=4, eos=eos)
    assert len(eng.results()[0]) == ref[0].index(eos) + 1


def test_several_eos_ids_stop_at_the_first_of_any():
    models = models_for()
    prompts, news = workload(4, 2)
    free = greedy_generate(models, prompts, news, page_size=2, attention_backend="torch")
    eos = [free[0][9], free[1][4], free[2][6]]  # Llama 3.1 has three
    eng = make_engine(models, 2, 4, 5, 8, max_bs=2)
    ids = submit_all(eng, prompts, news, eos_id=eos)
    out = eng.run()
    got = [out[i] for i in ids]
    assert got == greedy_generate(models, prompts, news, eos_ids=[eos] * 4, page_size=2,
                                  attention_backend="torch")
    for row, g in zip(free, got):  # each stops at the first of any of the ids, if any
        stops = [j for j, t in enumerate(row) if t in eos]
        assert g == (row[: stops[0] + 1] if stops else row)
    assert len(got[1]) <= 5
    with pytest.raises(ValueError, match="max_eos=4"):
        eng.submit(prompts[0], 4, eos_id=[1, 2, 3, 4, 5])


def test_a_request_that_joins_gives_the_same_tokens_as_alone():
    models = models_for()
    prompts, news = workload(7, 16)
    eng = make_engine(models, 16, 4, 5, 8, max_bs=3)
    submit_all(eng, prompts, news)
    together = eng.run()
    alone = make_engine(models, 16, 4, 5, 8, max_bs=1)
    rid = alone.submit(prompts[6], news[6])  # request 6 joined once others had finished
    assert alone.run()[rid] == together[6]


def test_device_output_buffer_matches_host_readback():
    models = models_for()
    prompts, news = workload(4, 2)
    eng = make_engine(models, 2, 4, 5, 8, max_bs=4)
    submit_all(eng, prompts, news)
    for _ in range(4):
        eng.step()
    device = eng.device_outputs()
    ref = greedy_generate(models, prompts, news, page_size=2, attention_backend="torch")
    assert device and all(ref[rid][: len(toks)] == toks for rid, toks in device.items())


def test_tree_and_path_are_consistent():
    models = models_for()
    prompts, news = workload(4, 2)
    eng = make_engine(models, 2, 8, 5, 8, max_bs=4)
    submit_all(eng, prompts, news)
    eng.step()
    eng.step()
    st = eng.state
    live = st["accept_len"] > 0
    parents, path = st["parents"][live], st["path"][live]
    n = parents.shape[1]
    assert (parents[:, 0] == -1).all()
    assert (parents[:, 1:] < torch.arange(1, n)).all() and (parents[:, 1:] >= 0).all()
    accepted = st["accept_len"][live] - 1
    for b in range(path.shape[0]):  # each accepted node's parent is the previous one
        for i in range(1, int(accepted[b]) + 1):
            assert parents[b, path[b, i]] == path[b, i - 1]
    mask = tree_mask_from_parents(st["parents"])
    assert mask[:, torch.arange(n), torch.arange(n)].all()
    # topk = 8 drafts real trees: some node is not its predecessor's child.
    assert (parents[:, 1:] != torch.arange(n - 1)).any()


def test_a_broken_commit_is_caught(monkeypatch):
    """Negative control: skip the commit of accepted K/V and exactness must fail."""
    monkeypatch.setattr(KVCache, "copy_slots", lambda self, src, dst: None)
    got, ref, _ = run_both(2, 4, 5, 8, requests=6, max_bs=4)
    assert got != ref


def test_scripted_acceptance_follows_the_sequence():
    """A random draft accepts almost nothing; the hook forces the script instead, and a
    sampled request is refused (nothing would be sampled)."""
    from fa3_spec.eagle.acceptance import scripted_acceptance

    models = models_for("random")
    prompts, news = workload(4, 2, max_new=30)
    eng = make_engine(models, 2, 4, 5, 8, max_new=30,
                      acceptance=scripted_acceptance((3, 4, 2, 5, 3, 4)))
    submit_all(eng, prompts, news)
    eng.run()
    hist = eng.stats.accept_hist.tolist()
    assert {a for a, c in enumerate(hist) if c} <= {2, 3, 4, 5}
    assert abs(eng.stats.mean_accept_len - 3.5) < 0.4
    with pytest.raises(ValueError, match="acceptance hook decides every accepted path"):
        eng.submit([1, 2, 3], 4, temperature=0.5)
    for bad in ((), (2, 0), "3,4", (2.5,)):
        with pytest.raises(ValueError, match="emitted must be a non-empty sequence of ints"):
            scripted_acceptance(bad)


def test_iteration_compiles_fullgraph_with_no_data_dependent_ops():
    models = models_for()
    prompts, news = workload(3, 2)
    eng = make_engine(models, 2, 4, 2, 4, max_bs=4)
    for i, (prompt, m) in enumerate(zip(prompts, news)):  # request 1 samples, in the same graph
        eng.submit(prompt, m, **(dict(temperature=1.0, top_p=0.9, seed=3) if i == 1 else {}))
    eng.step()  # admitted and one iteration in: a mid-run state with a padding row
    pool = eng.pool
    saved = (pool.target_kv.k.clone(), pool.target_kv.v.clone(), pool.draft_kv.k.clone(),
             pool.draft_kv.v.clone())
    backend = RecordingBackend("aot_eager")

    def it(st):
        return eagle_iteration(eng.lc, models, pool.target_kv, pool.draft_kv, pool.req_to_token, st)

    compiled = torch.compile(it, fullgraph=True, backend=backend)
    st = {k: v.clone() for k, v in eng.state.items()}
    got = compiled(st)
    kv_compiled = (pool.target_kv.k.clone(), pool.draft_kv.k.clone())
    for t, s in zip((pool.target_kv.k, pool.target_kv.v, pool.draft_kv.k, pool.draft_kv.v), saved):
        t.copy_(s)
    want = it(st)
    assert backend.frame_count == 1 and backend.data_dependent == []
    for key in ("seq_lens", "out_tokens", "out_len", "tree_tokens", "parents", "path",
                "cand_tokens", "root"):
        assert torch.equal(got[key], want[key]), key
    torch.testing.assert_close(got["draft_hidden"], want["draft_hidden"])
    torch.testing.assert_close(kv_compiled[0], pool.target_kv.k)
    torch.testing.assert_close(kv_compiled[1], pool.draft_kv.k)


def test_empty_state_is_all_padding_and_an_iteration_on_it_writes_only_page_zero():
    models = models_for()
    eng = make_engine(models, 2, 4, 5, 8, max_bs=4)
    pool = eng.pool
    pool.target_kv.k.normal_()
    pool.draft_kv.k.normal_()
    before = (pool.target_kv.k.clone(), pool.draft_kv.k.clone())
    st = empty_state(eng.lc, models, 4, "cpu")
    new = eagle_iteration(eng.lc, models, pool.target_kv, pool.draft_kv, pool.req_to_token, st)
    assert (new["seq_lens"] == 0).all() and (new["out_len"] == 0).all()
    assert (new["cand_tokens"] == 0).all() and (new["cand_scores"] == 0).all()
    assert (new["draft_hidden"] == 0).all()
    assert torch.equal(pool.target_kv.k[:, 1:], before[0][:, 1:])
    assert torch.equal(pool.draft_kv.k[:, 1:], before[1][:, 1:])


@pytest.mark.parametrize("final_norm", [True, False])
def test_the_draft_head_scores_given_rows_as_it_scores_those_rows(final_norm, monkeypatch):
    """``draft_topk(h, k, rows=)`` (what the draft extend calls) gives the
    numbers of ``draft_topk(h[rows], k)``, with and without a final norm
    (EAGLE-1/2 heads have none), repeated rows included; the norm runs over
    every row of ``h`` and the rows are gathered after it (the order that
    inductor compiles under size-oblivious sizes); a row out of range is
    clamped, not read."""
    models = models_for()
    if not final_norm:
        models = dataclasses.replace(models, draft=dataclasses.replace(models.draft, norm=None))
    torch.manual_seed(1)
    h = torch.randn(6, models.hidden_size, dtype=models.dtype) * 3
    rows = torch.tensor([5, 0, 5, 2])
    normed = []
    real_norm = fa3_spec.eagle.models.rms_norm
    monkeypatch.setattr(fa3_spec.eagle.models, "rms_norm",
                        lambda x, *a: normed.append(x.shape[0]) or real_norm(x, *a))
    got = models.draft_topk(h, 4, rows=rows)
    assert normed == ([6] if final_norm else [])
    want = models.draft_topk(h[rows], 4)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    full = models.draft_topk(h, 4)
    assert torch.equal(full[1][rows], got[1])
    clamped = models.draft_topk(h, 4, rows=torch.tensor([-3, 9]))
    assert torch.equal(clamped[1], full[1][[0, 5]])


def test_loop_config_rejects_impossible_trees():
    spec = fa3_spec.SpecConfig(page_size=2, topk=1, num_steps=2, num_draft_tokens=4, max_bs=2,
                               max_context_len=64, num_pages=100)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        LoopConfig(spec, max_new_tokens=8)


class _Models:
    """A `SpecModel` that delegates to another, with attributes replaced."""

    def __init__(self, models, **replaced):
        self._models = models
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(self._models, name)


def test_topk_above_the_draft_vocabulary_is_refused_at_construction():
    """Found by trying to break it: the first admission raised a raw `selected index
    k out of range` and left the request half-admitted (dequeued, row and slot taken)."""
    models = models_for()
    with pytest.raises(ValueError, match=r"topk=513 exceeds the draft's vocabulary of 512"):
        make_engine(models, 2, 513, 2, 4)
    small_head = _Models(models, draft_vocab_size=6)  # a reduced-vocabulary draft head
    with pytest.raises(ValueError, match=r"topk=8 exceeds the draft's vocabulary of 6"):
        make_engine(small_head, 2, 8, 2, 4)
    make_engine(small_head, 2, 6, 2, 4)  # within it: accepted


@pytest.mark.parametrize("buckets, error, says", [
    ([], ValueError, "buckets must hold at least one batch size"),
    ([0, 4], ValueError, r"buckets must be batch sizes >= 1, got \[0, 4\]"),
    ([1, 2], ValueError, "the largest bucket must be max_bs=4"),  # rows 3-4 fit no bucket
    ([2, 8], ValueError, r"must not exceed max_bs=4 .*got \[2, 8\]"),  # beyond the state's rows
    ([2.5, 4], TypeError, "buckets must be a sequence of ints"),
    ([True, 4], TypeError, "buckets must be a sequence of ints"),
    ([torch.tensor(True), 4], TypeError, "buckets must be a sequence of ints"),
    ("4", TypeError, "buckets must be a sequence of ints"),
    ({4: 1}, TypeError, "buckets must be a sequence of ints"),
    (4, TypeError, "buckets must be a sequence of ints"),
], ids=repr)
def test_bad_buckets_are_refused_at_construction_naming_them(buckets, error, says):
    with pytest.raises(error, match=says):
        make_engine(models_for(), 2, 2, 2, 3, buckets=buckets)


def test_buckets_are_sorted_deduplicated_and_take_integer_likes_and_iterators():
    eng = make_engine(models_for(), 2, 2, 2, 3, buckets=[4, torch.tensor(2), 2, 4])
    assert eng.buckets == [2, 4] and all(type(b) is int for b in eng.buckets)
    assert eng.runner.buckets == [2, 4]
    assert make_engine(models_for(), 2, 2, 2, 3, buckets=(b for b in (4, 1))).buckets == [1, 4]


def test_the_auto_attention_backend_is_resolved_when_the_engine_is_built():
    """Found on the H200: an engine given ``attention_backend="auto"`` whose first FA3 lookup
    happened while dynamo traced the compiled iteration failed to compile (the
    lookup imports). The engine resolves it eagerly; its ``lc`` says which."""
    eng = make_engine(models_for(), 2, 4, 2, 4)
    lc = dataclasses.replace(eng.lc, attention_backend="auto")
    auto = EagleEngine(lc, models_for(), max_reqs=8)
    assert lc.attention_backend == "auto" and auto.lc.attention_backend == "torch"
    assert auto.lc == dataclasses.replace(lc, attention_backend="torch")


def test_out_of_vocabulary_prompt_tokens_are_refused_not_clamped():
    models = models_for()
    eng = make_engine(models, 2, 4, 5, 8)
    for bad in (512, -1):
        with pytest.raises(ValueError, match=rf"token {bad} at position 1 .*vocab_size=512"):
            eng.submit([3, bad, 4], 4)
        with pytest.raises(ValueError, match=rf"prompts\[1\]: token {bad} at position 1"):
            greedy_generate(models, [[1], [3, bad]], [4, 4], attention_backend="torch")
    assert not eng.has_work
    with pytest.raises(ValueError, match="one count >= 1 per prompt"):
        greedy_generate(models, [[1], [2]], [4], attention_backend="torch")


def test_cli_check_greedy_json_and_exit_status(tmp_path, monkeypatch):
    out = tmp_path / "eagle.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--batch", "3", "--requests", "5",
            "--page-size", "16", "--topk", "4", "--num-steps", "3", "--num-draft-tokens", "6",
            "--max-new-tokens", "12", "--prompt-len", "20", "--check-greedy", "--attention-backend",
            "torch", "--json", str(out), "--quiet"]
    assert cli.main(argv) == 0
    res = json.loads(out.read_text())
    for key in ("exact", "mismatches", "tokens", "iterations", "mean_accept_len",
                "host_syncs_per_iteration", "tokens_per_s", "config"):
        assert key in res
    assert res["exact"] is True and res["mismatches"] == 0
    assert res["host_syncs_per_iteration"] is None  # not measured on CPU
    assert res["tokens"] == sum(len(o) for o in res["outputs"])

    # A reference that disagrees must make the command fail.
    real = cli.greedy_generate
    monkeypatch.setattr(cli, "greedy_generate",
                        lambda *a, **k: [[t + 1 for t in o] for o in real(*a, **k)])
    assert cli.main(argv) == 1


@pytest.mark.parametrize("flag", ["--requests", "--batch", "--page-size", "--topk", "--num-steps",
                                  "--num-draft-tokens", "--max-new-tokens", "--prompt-len"])
def test_cli_refuses_non_positive_sizes_as_a_usage_error(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([flag, "0", "--device", "cpu"])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


_SMALL = ["--device", "cpu", "--batch", "2", "--requests", "3", "--page-size", "16", "--topk",
          "2", "--num-steps", "2", "--num-draft-tokens", "3", "--max-new-tokens", "6",
          "--prompt-len", "8", "--attention-backend", "torch"]


@pytest.mark.parametrize("argv", [
    ["--num-layers", "0"], ["--num-layers", "-1"],  # were IndexError, exit 1
    ["--num-draft-tokens", "1"], ["--topk", "1", "--num-steps", "2", "--num-draft-tokens", "8"],
    ["--topk", "600"], ["--check-greedy", "--scripted"], ["--scripted", "3,x"], ["--graphs"],
    ["--draft-attention", "tree"], ["--compile-regions"],  # regions need a compile backend
    ["--batch", "4", "--buckets", "1", "2"], ["--batch", "4", "--buckets", "2", "8"],
    ["--buckets", "0", "8"],
], ids=lambda a: " ".join(a))
def test_cli_invalid_invocations_exit_2_with_one_line_and_no_traceback(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv + ["--device", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("fa3-spec eagle")
    if "--buckets" in argv:  # the message names the option
        assert "--buckets" in err


def test_cli_prints_its_configuration_first_and_progress_in_both_phases(monkeypatch, capsys):
    monkeypatch.setattr(cli, "PROGRESS_SECONDS", -1.0)  # a progress line at every chance
    assert cli.main(_SMALL + ["--check-greedy"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("fa3-spec eagle: preset tiny") and "topk=2" in lines[0]
    loop = [i for i, line in enumerate(lines) if line.startswith("  iteration ")]
    greedy = [i for i, line in enumerate(lines) if line.startswith("  greedy step ")]
    check = [i for i, line in enumerate(lines) if "greedy check: EXACT" in line]
    assert loop and greedy and check and max(loop) < min(greedy) and max(greedy) < check[0]


def test_cli_drafts_on_true_ancestors_and_says_so(tmp_path):
    out = tmp_path / "eagle.json"
    assert cli.main(_SMALL + ["--topk", "3", "--num-steps", "3", "--draft-attention", "ancestors",
                              "--check-greedy", "--json", str(out), "--quiet"]) == 0
    res = json.loads(out.read_text())
    assert res["exact"] is True and res["config"]["draft_attention"] == "ancestors"


def test_cli_buckets_without_1_pad_a_single_request_and_stay_exact(tmp_path):
    out = tmp_path / "eagle.json"
    assert cli.main(_SMALL + ["--requests", "1", "--buckets", "2", "--check-greedy", "--json",
                              str(out), "--quiet"]) == 0
    res = json.loads(out.read_text())
    assert res["exact"] is True and res["config"]["buckets"] == [2]


def test_cli_help_documents_the_exit_status(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.replace("`", "").split())
    assert "Exit status: 0" in text and "1 when --check-greedy found a mismatch" in text
    assert "2 for an invalid invocation" in text


def test_request_at_names_the_request_of_a_batch_row_until_the_host_reads_its_finish():
    eng = make_engine(models_for(), 2, 4, 3, 6, max_bs=2, max_new=6)
    assert eng.request_at(0) is None and eng.request_at(1) is None
    first, second = eng.submit([5, 6, 7], 4), eng.submit([8, 9], 6)
    seen = []
    eng.run(lambda e, host: seen.append((e.request_at(0), e.request_at(1))))
    assert seen[0] == (first, second)
    assert (eng.request_at(0), eng.request_at(1)) == (None, None)
    for row in (-1, 2):
        with pytest.raises(ValueError, match="row"):
            eng.request_at(row)


def test_the_host_sync_probe_wraps_an_engine_from_outside_and_lets_go():
    """On CPU there is nothing to count: the probe watches no launch, and the engine's
    own replay is what runs, before, inside and after it (the GPU tests count)."""
    from fa3_spec.eagle.sync_probe import HostSyncProbe

    models = models_for()
    prompts, news = workload(2, 2, max_new=6, min_new=6)
    eng = make_engine(models, 2, 4, 3, 6, max_new=6)
    submit_all(eng, prompts, news)
    with HostSyncProbe(eng) as probe:
        assert "replay" not in vars(eng.runner)
        eng.run()
    assert probe.counts == [] and probe.worst is None and "replay" not in vars(eng.runner)
    assert eng.stats.iterations > 0


@pytest.mark.parametrize("call, error, says", [
    (lambda e: e.submit("2024", 4), TypeError, "prompt must be a sequence of int token ids"),
    (lambda e: e.submit([1.7, 2.2], 4), TypeError, "token at position 0 must be an int, got 1.7"),
    (lambda e: e.submit([float("inf")], 4), TypeError, "token at position 0 must be an int"),
    (lambda e: e.submit([True, 2], 4), TypeError, "token at position 0 must be an int"),
    (lambda e: e.submit([1, 2], 2.5), ValueError, "max_new_tokens must be an int >= 1, got 2.5"),
    (lambda e: e.submit([1, 2], float("nan")), ValueError, "max_new_tokens must be an int >= 1"),
    (lambda e: e.submit([1, 2], 3.0), ValueError, "max_new_tokens must be an int >= 1, got 3.0"),
    (lambda e: e.submit([1, 2], 4, top_k=2 ** 63), ValueError, r"top_k must be an int in \[0, 2\*\*63\)"),
    (lambda e: e.submit([1, 2], 4, eos_id=2 ** 63), ValueError, "outside the vocabulary"),
    (lambda e: e.submit([1, 2], 4, eos_id=[3, 1.5]), ValueError, "eos_id must be an int or ints"),
])
def test_a_bad_request_is_refused_at_submit_and_the_others_are_served(call, error, says):
    """A value that once passed submit and then failed every admission (or every step),
    jamming the requests queued with it, is refused at submit, naming it; the good
    requests before and after it are served, exactly."""
    models = models_for()
    eng = make_engine(models, 2, 4, 3, 6, max_new=8)
    first = eng.submit([5, 9, 2], 4)
    with pytest.raises(error, match=says):
        call(eng)
    last = eng.submit([3, 1, 4, 1], 4)
    got = eng.run()
    want = greedy_generate(models, [[5, 9, 2], [3, 1, 4, 1]], [4, 4], page_size=2,
                           attention_backend="torch")
    assert [got[first], got[last]] == want


def test_greedy_generate_refuses_what_submit_refuses():
    models = models_for()
    with pytest.raises(TypeError, match=r"prompts\[0\]: token at position 1 must be an int"):
        greedy_generate(models, [[1, 2.0]], [3])
    with pytest.raises(ValueError, match=r"max_new_tokens\[0\] must be an int >= 1, got True"):
        greedy_generate(models, [[1, 2]], [True])
