"""The engine at its edges (CPU): the RoPE table bounds the context, tiny
temperatures decode greedily, a request that cannot be admitted does not
hold up the others, served requests can be collected, and the statistics are
bounded aggregates that count what the loop did."""

import dataclasses

import pytest
import torch

import fa3_spec
from fa3_spec.eagle import EagleEngine, LoopConfig, greedy_generate, make_models
from fa3_spec.eagle.models import EagleModels, RopeTable
from fa3_spec.eagle.sampling import SamplingParams, filtered_probs, min_temperature, sample_tokens
from fa3_spec.eagle.stats import EngineStats, sibling_ranks


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


_MODELS = {}


def tiny(dtype=torch.float64):
    if dtype not in _MODELS:
        _MODELS[dtype] = make_models("tiny", draft="derived", seed=0, dtype=dtype)
    return _MODELS[dtype]


def with_rope_positions(models, positions):
    """The same models with a RoPE table of only ``positions`` rows."""
    rope = RopeTable(models.target.rope.cos[:positions], models.target.rope.sin[:positions])
    return EagleModels(dataclasses.replace(models.target, rope=rope),
                       dataclasses.replace(models.draft, rope=rope))


def engine(models, *, p=2, k=4, s=3, n=6, max_bs=4, max_context_len=80, max_new=24,
           sampling=False, **kw):
    spec = fa3_spec.SpecConfig(page_size=p, topk=k, num_steps=s, num_draft_tokens=n,
                               max_bs=max_bs, max_context_len=max_context_len)
    spec = dataclasses.replace(spec, num_pages=spec.pool_pages(2 * max_bs, "ancestors"))
    lc = LoopConfig(spec, max_new_tokens=max_new, attention_backend="torch", sampling=sampling)
    return EagleEngine(lc, models, **kw)


PROMPTS = [[5, 9, 2], [3, 1, 4, 1, 5], [7], [2, 7, 1, 8, 2, 8]]


# ------------------------------------------------------------------ RoPE table
def test_the_engine_refuses_a_context_longer_than_its_rope_table():
    short = with_rope_positions(tiny(), 64)
    with pytest.raises(ValueError, match="max_context_len=80 exceeds the model's RoPE table of 64"):
        engine(short, max_context_len=80)
    eng = engine(short, max_context_len=64)  # the table's length is allowed
    with pytest.raises(ValueError, match="max_context_len"):  # submit: the same bound
        eng.submit(list(range(40)), 24)


def test_greedy_generate_refuses_a_context_longer_than_the_rope_table():
    short = with_rope_positions(tiny(), 16)
    with pytest.raises(ValueError, match="reaches 17 positions, beyond the model's RoPE table of 16"):
        greedy_generate(short, [[1, 2, 3, 4, 5]], [12], attention_backend="torch")
    out = greedy_generate(short, [[1, 2, 3, 4]], [12], attention_backend="torch")
    assert out == greedy_generate(tiny(), [[1, 2, 3, 4]], [12], attention_backend="torch")


# -------------------------------------------------------------- tiny temperatures
@pytest.mark.parametrize("temperature", [1e-30, 1e-37, 2e-38, 1e-39, 1e-45])
def test_a_tiny_temperature_is_the_greedy_limit_in_float32(temperature):
    logits = torch.randn(3, 512, generator=torch.Generator().manual_seed(0)) * 8
    t = torch.full((3,), temperature)
    probs = filtered_probs(logits, t, torch.zeros(3, dtype=torch.int64), torch.ones(3))
    assert torch.isfinite(probs).all()
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.max(-1).values, torch.ones(3))
    params = SamplingParams.full(3, temperature=temperature, seed=1)
    assert torch.equal(sample_tokens(logits, params, torch.zeros(3, dtype=torch.int64)),
                       logits.argmax(-1))


def test_the_threshold_is_the_smallest_normal_number_of_the_computation():
    assert min_temperature(torch.float32) == torch.finfo(torch.float32).tiny
    assert min_temperature(torch.float64) == torch.finfo(torch.float64).tiny
    # An ordinary temperature is untouched by the shift: softmax(logits / t).
    logits = torch.randn(2, 64, dtype=torch.float64)
    probs = filtered_probs(logits, torch.full((2,), 0.7, dtype=torch.float64),
                           torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(probs, torch.softmax(logits / 0.7, -1), rtol=1e-12, atol=1e-15)


def test_an_engine_sampling_at_a_tiny_temperature_decodes_greedily():
    models = tiny(torch.float32)
    eng = engine(models, sampling=True)
    rids = [eng.submit(prompt, 12, temperature=2e-38, seed=i) for i, prompt in enumerate(PROMPTS)]
    out = eng.run()
    ref = greedy_generate(models, PROMPTS, [12] * len(PROMPTS), attention_backend="torch")
    assert [out[r] for r in rids] == ref


# ----------------------------------------------------------------- max_reqs
@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_max_reqs_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_reqs must be an int >= 1"):
        engine(tiny(), max_reqs=bad)


# ---------------------------------------------------------------- admission
class _FailingTarget:
    """The models, whose target forward raises while ``fail(tokens)`` says so."""

    def __init__(self, models, fail):
        self._models, self._fail = models, fail

    def __getattr__(self, name):
        return getattr(self._models, name)

    def target_forward(self, tokens, *args, **kwargs):
        if self._fail(tokens):
            raise RuntimeError("prefill failed")
        return self._models.target_forward(tokens, *args, **kwargs)


def test_a_request_that_cannot_be_admitted_does_not_hold_up_the_others():
    models = tiny()
    bad_token = 511  # only the bad request's prompt holds it
    failing = _FailingTarget(models, lambda tokens: bool((tokens == bad_token).any()))
    eng = engine(failing)
    prompts = PROMPTS[:2] + [[4, bad_token, 4]] + PROMPTS[2:]
    rids = [eng.submit(prompt, 12) for prompt in prompts]
    pages, rows = eng.pool.free_pages, eng.pool.free_rows
    out = eng.run()
    bad = rids[2]
    assert eng.failures() == {bad: "RuntimeError: prefill failed"}
    assert bad not in out and eng.stats.failed == 1
    good = [r for r in rids if r != bad]
    ref = greedy_generate(models, PROMPTS, [12] * len(PROMPTS), attention_backend="torch")
    assert [out[r] for r in good] == ref
    assert (eng.pool.free_pages, eng.pool.free_rows) == (pages, rows)  # everything freed
    collected = eng.pop_results()
    assert collected[bad].tokens is None and collected[bad].error == "RuntimeError: prefill failed"
    assert eng.failures() == {}


def test_a_transient_admission_failure_is_retried_request_by_request():
    models = tiny()
    failures = [RuntimeError("prefill failed")]
    eng = engine(_FailingTarget(models, lambda tokens: bool(failures) and bool(failures.pop())))
    rids = [eng.submit(prompt, 12) for prompt in PROMPTS]
    out = eng.run()
    assert eng.failures() == {}
    ref = greedy_generate(models, PROMPTS, [12] * len(PROMPTS), attention_backend="torch")
    assert [out[r] for r in rids] == ref


def test_an_interrupted_admission_leaves_the_engine_as_it_was():
    models = tiny()
    interrupts = [KeyboardInterrupt()]

    class Interrupted(_FailingTarget):
        def target_forward(self, tokens, *args, **kwargs):
            if interrupts:
                raise interrupts.pop()
            return models.target_forward(tokens, *args, **kwargs)

    eng = engine(Interrupted(models, None))
    rids = [eng.submit(prompt, 12) for prompt in PROMPTS]
    pages, rows = eng.pool.free_pages, eng.pool.free_rows
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    assert (eng.pool.free_pages, eng.pool.free_rows) == (pages, rows)
    assert eng.active == 0 and eng.stats.admitted == 0 and not eng.state["seq_lens"].any()
    out = eng.run()  # still queued, in order
    ref = greedy_generate(models, PROMPTS, [12] * len(PROMPTS), attention_backend="torch")
    assert [out[r] for r in rids] == ref


# ------------------------------------------------------------- collecting results
def test_collected_requests_leave_the_engine():
    eng = engine(tiny())
    for _ in range(3):  # three waves through one engine
        rids = [eng.submit(prompt, 10, seed=7) for prompt in PROMPTS]
        eng.run()
        assert eng.seed_of(rids[0]) == 7
        got = eng.pop_results()
        assert sorted(got) == rids
        assert all(len(r.tokens) == 10 and r.error is None and r.seed == 7 for r in got.values())
        assert all(sum(r.accept_lens) >= 9 for r in got.values())  # + the prefill's token
        assert eng.results() == {} and eng.request_stats() == {} and eng._done == {}
        with pytest.raises(KeyError, match="already collected"):
            eng.seed_of(rids[0])
    assert eng.stats.finished == 12 and eng.stats.accept_hist.shape == (eng.lc.max_depth + 2,)


# --------------------------------------------------------------------- stats
def test_sibling_ranks_count_earlier_children_of_the_same_parent():
    parents = torch.tensor([[-1, 0, 0, 1, 0, 1, 3]])
    assert sibling_ranks(parents).tolist() == [[0, 0, 1, 0, 2, 1, 0]]


def test_stats_count_offered_and_taken_nodes_per_depth_and_rank():
    stats = EngineStats(max_depth=3, topk=3)
    parents = torch.tensor([[-1, 0, 0, 1, 0, 1, 3],     # accepted 0 -> 2 (rank 1), then stop
                            [-1, 0, 0, 1, 0, 1, 3],     # accepted 0 -> 1 -> 3 -> 6
                            [-1, 0, 0, 1, 0, 1, 3]])    # a padding row
    path = torch.tensor([[0, 2, 2, 2], [0, 1, 3, 6], [0, 0, 0, 0]])
    accept_len = torch.tensor([2, 4, 0])
    stats.record(accept_len, parents, path, emitted=6)
    assert (stats.row_iterations, stats.accepted, stats.tokens) == (2, 6, 6)
    assert stats.accept_hist.tolist() == [0, 0, 1, 0, 1]
    # depth 1: both live rows offered nodes 1, 2, 4 (ranks 0, 1, 2); one took rank 0, one rank 1
    assert stats.offered[1].tolist() == [2, 2, 2] and stats.taken[1].tolist() == [1, 1, 0]
    # depth 2: only row 1 reached node 1, whose children 3, 5 are ranks 0, 1; it took 3
    assert stats.offered[2].tolist() == [1, 1, 0] and stats.taken[2].tolist() == [1, 0, 0]
    # depth 3: row 1 at node 3: child 6 (rank 0), taken
    assert stats.offered[3].tolist() == [1, 0, 0] and stats.taken[3].tolist() == [1, 0, 0]
    rates = stats.acceptance_rates()
    assert rates[1].tolist() == [0.5, 0.5, 0.0] and rates[3, 0] == 1.0
    assert torch.isnan(rates[0]).all() and torch.isnan(rates[3, 1])
    # An EOS cut of the emitted tokens does not change how far the path went.
    cut = EngineStats(max_depth=3, topk=3)
    cut.record(accept_len, parents, path, emitted=3)
    assert torch.equal(cut.taken, stats.taken) and (cut.accepted, cut.tokens) == (6, 3)


def test_the_stats_add_up_to_what_the_engine_emitted_and_stay_bounded():
    eng = engine(tiny())
    rids = [eng.submit(prompt, 20) for prompt in PROMPTS * 2]
    out = eng.run()
    st = eng.stats
    per_request = eng.request_stats()
    assert st.tokens == sum(len(out[r]) - 1 for r in rids)  # all but each prefill's token
    assert st.row_iterations == sum(len(per_request[r]["accept_lens"]) for r in rids)
    assert st.accepted == sum(sum(per_request[r]["accept_lens"]) for r in rids) >= st.tokens
    assert int(st.accept_hist.sum()) == st.row_iterations
    assert sum(a * c for a, c in enumerate(st.accept_hist.tolist())) == st.accepted
    # Every accepted draft is a taken node, and every request iteration was
    # offered the root's best child.
    assert int(st.taken.sum()) == st.accepted - st.row_iterations
    assert int(st.offered[1, 0]) == st.row_iterations
    sizes = (st.accept_hist.numel(), st.offered.numel(), st.taken.numel())
    for prompt in PROMPTS:
        eng.submit(prompt, 20)
    eng.run()
    assert (st.accept_hist.numel(), st.offered.numel(), st.taken.numel()) == sizes
    assert st.as_dict()["mean_accept_len"] == round(st.accepted / st.row_iterations, 4)
