"""The speculation policy's model (`fa3_spec.eagle.policy`): expected accepted
length of a tree shape under an acceptance profile, against hand counts and
against the engine's own measured acceptance; the cost model's choice per
bucket; refusals that name the argument."""

import dataclasses
import itertools
import json
import math
import random

import pytest
import torch

import fa3_spec
from fa3_spec.eagle import EagleEngine, LoopConfig, make_models
from fa3_spec.eagle.cli import workload
from fa3_spec.eagle.policy import (AcceptanceProfile, CostProfile, choose_shapes,
                                   drafted_tree, expected_accept_length)


def test_a_chain_accepts_the_sum_of_its_path_products():
    prof = AcceptanceProfile(((0.8,), (0.5,), (0.5,)))
    assert expected_accept_length((1, 3, 4), prof) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    # A fourth step past the table counts nothing; N caps the nodes verified.
    assert expected_accept_length((1, 4, 5), prof) == pytest.approx(2.4)
    assert expected_accept_length((1, 3, 3), prof) == pytest.approx(2.2)


def test_a_tree_verifies_its_best_nodes_as_the_engine_drafts_them():
    prof = AcceptanceProfile(((0.6, 0.3), (0.5, 0.2)))
    # topk 2, 2 steps: depth 1 {0.6, 0.3}; each beam grows 2 children:
    # 0.30, 0.12 (under 0.6) and 0.15, 0.06 (under 0.3). N - 1 = 4 best.
    nodes = drafted_tree((2, 2, 5), prof)
    assert [round(c, 4) for _, _, c in nodes] == [0.6, 0.3, 0.3, 0.15]
    assert expected_accept_length((2, 2, 5), prof) == pytest.approx(2.35)
    # Wider trees never expect less; a shape cannot ask for more nodes than it drafts.
    assert expected_accept_length((2, 2, 7), prof) >= expected_accept_length((2, 2, 5), prof)
    with pytest.raises(ValueError, match="fewer than num_draft_tokens"):
        expected_accept_length((2, 2, 8), prof)


@pytest.mark.parametrize("shape", [(4, 3, 8), (1, 4, 5)])
def test_the_model_predicts_what_the_engine_measured_with_that_profile(shape):
    # A real run (tiny target, derived draft, CPU): the profile it measured
    # predicts its own mean accepted length. For a chain that is an identity of
    # the counts (reaching depth d has chance the product of the rates to d);
    # a tree's composition varies by iteration, which the model averages.
    k, s, n = shape
    models = make_models("tiny", draft="derived", seed=0)
    spec = fa3_spec.SpecConfig(page_size=2, topk=k, num_steps=s, num_draft_tokens=n, max_bs=4,
                               max_context_len=40 + 24 + n)
    spec = dataclasses.replace(spec, num_pages=spec.pool_pages(8, LoopConfig.draft_attention))
    eng = EagleEngine(LoopConfig(spec, max_new_tokens=24, attention_backend="torch"), models,
                      max_reqs=8, buckets=[4], graphs=False, compile_backend="none")
    prompts, news = workload(8, page_size=2, max_prompt=40, max_new=24,
                             vocab=models.vocab_size, seed=3)
    for p, m in zip(prompts, news):
        eng.submit(p, m)
    eng.run()
    prof = AcceptanceProfile.from_stats(eng.stats)
    measured = eng.stats.mean_accept_len
    assert measured > 1.2  # drafts were accepted: the comparison means something
    assert expected_accept_length(shape, prof) == pytest.approx(
        measured, rel=1e-12 if k == 1 else 0.15)


def test_each_bucket_runs_the_shape_with_the_most_tokens_per_second():
    prof = AcceptanceProfile(((0.8, 0.1), (0.7, 0.1), (0.6, 0.1)))
    costs = CostProfile(plain={1: 5.0, 64: 20.0},
                        shapes={1: {"1,3,4": 7.0, "2,3,6": 8.0},
                                64: {"1,3,4": 60.0, "2,3,6": 70.0}})
    chosen = choose_shapes(costs, prof)
    e_chain = expected_accept_length((1, 3, 4), prof)
    e_tree = expected_accept_length((2, 3, 6), prof)
    one = max([(e_chain / 7.0, (1, 3, 4)), (e_tree / 8.0, (2, 3, 6)), (1 / 5.0, None)])
    assert chosen[1].shape == one[1] and chosen[1].tokens_per_s == pytest.approx(1e3 * one[0])
    # At 64 rows an iteration costs more than its accepted tokens buy: plain decoding.
    assert e_chain / 60.0 < 1 / 20.0 and e_tree / 70.0 < 1 / 20.0
    assert chosen[64].shape is None and chosen[64].speedup == 1.0
    assert chosen[1].speedup > 1


def _brute_force_best_score(costs, profile, max_shapes):
    """The largest sum of log(speedup) over every assignment of one option per
    bucket (plain decoding or a shape measured there) with at most
    ``max_shapes`` distinct options: the oracle for `choose_shapes`."""
    rows = []
    for b in sorted(costs.plain):
        plain = 1e3 / costs.plain[b]
        opts = [(None, 0.0)]
        for key, ms in costs.shapes.get(b, {}).items():
            shape = tuple(int(x) for x in key.split(","))
            rate = 1e3 * expected_accept_length(shape, profile) / ms
            opts.append((shape, math.log(rate / plain)))
        rows.append(opts)
    return max(sum(score for _, score in pick) for pick in itertools.product(*rows)
               if len({shape for shape, _ in pick}) <= max_shapes)


@pytest.mark.parametrize("seed", range(6))
def test_max_shapes_keeps_the_best_assignment_with_that_many_shapes(seed):
    rng = random.Random(seed)
    prof = AcceptanceProfile(tuple((rng.uniform(0.3, 0.7), rng.uniform(0.0, 0.25))
                                   for _ in range(5)))
    keys = ["1,2,3", "1,3,4", "1,5,6", "2,3,6", "2,5,8"]
    plain = {b: 5.0 + 0.1 * b for b in (1, 2, 4, 8, 16, 32, 64)}
    # Costs that grow with the batch and the tree, shuffled enough that the
    # unbounded choice uses several shapes; one shape unmeasured at one bucket.
    shapes = {b: {k: plain[b] * (1.0 + rng.uniform(0.05, 0.5) * int(k.split(",")[2]) *
                                 (0.3 + b / 64)) for k in keys} for b in plain}
    del shapes[64]["2,5,8"]
    costs = CostProfile(plain=plain, shapes=shapes)
    unbounded = choose_shapes(costs, prof)
    used = {c.shape for c in unbounded.values()}
    for k in range(1, 5):
        chosen = choose_shapes(costs, prof, max_shapes=k)
        assert len({c.shape for c in chosen.values()}) <= k
        score = math.fsum(math.log(c.speedup) for c in chosen.values())
        assert score == pytest.approx(_brute_force_best_score(costs, prof, k), abs=1e-12)
        # Each bucket still reports its own option's figures.
        for b, c in chosen.items():
            assert c.bucket == b and c.plain_tokens_per_s == pytest.approx(1e3 / plain[b])
        if k >= len(used):
            assert chosen == unbounded


def test_max_shapes_counts_plain_decoding_as_a_shape():
    prof = AcceptanceProfile(((0.8,), (0.7,), (0.6,)))
    # The chain wins at 1 and loses at 64, where plain decoding wins.
    costs = CostProfile(plain={1: 5.0, 64: 20.0},
                        shapes={1: {"1,3,4": 6.0}, 64: {"1,3,4": 60.0}})
    assert {b: c.shape for b, c in choose_shapes(costs, prof).items()} == {1: (1, 3, 4), 64: None}
    one = choose_shapes(costs, prof, max_shapes=1)
    # One step for both buckets: the chain (2.2x at 1, 0.9x at 64) beats plain (1x, 1x).
    assert {c.shape for c in one.values()} == {(1, 3, 4)}
    assert one[64].speedup < 1


def test_max_shapes_keeps_fewer_shapes_on_a_tie_even_when_the_unbounded_choice_fits():
    prof = AcceptanceProfile(((0.5,), (0.5,), (0.5,)))
    e4, e3 = expected_accept_length((1, 3, 4), prof), expected_accept_length((1, 2, 3), prof)
    # Bucket 1: the two chains tie exactly, and the smaller one wins there unbounded;
    # bucket 2 measures only the longer chain.
    costs = CostProfile(plain={1: 10.0, 2: 10.0},
                        shapes={1: {"1,3,4": e4 * 4, "1,2,3": e3 * 4}, 2: {"1,3,4": 5.0}})
    assert {c.shape for c in choose_shapes(costs, prof).values()} == {(1, 2, 3), (1, 3, 4)}
    for k in (1, 2, 3):
        chosen = choose_shapes(costs, prof, max_shapes=k)
        assert {c.shape for c in chosen.values()} == {(1, 3, 4)}, k


def test_max_shapes_refuses_a_search_too_large_to_weigh():
    prof = AcceptanceProfile(((0.7,), (0.7,), (0.7,)))
    # 60 chains over 60 buckets, the cheapest a different one at each bucket.
    shapes = {b: {f"1,{s},{s + 1}": 10.0 - 0.001 * ((s + b) % 60) for s in range(1, 61)}
              for b in range(1, 61)}
    costs = CostProfile(plain={b: 10.0 for b in range(1, 61)}, shapes=shapes)
    assert len({c.shape for c in choose_shapes(costs, prof).values()}) > 4
    with pytest.raises(ValueError, match=r"max_shapes=4 leaves \d+ sets of the 61 candidates"):
        choose_shapes(costs, prof, max_shapes=4)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_max_shapes_must_be_a_positive_int(bad):
    costs = CostProfile(plain={1: 1.0}, shapes={1: {"1,2,3": 1.0}})
    with pytest.raises(ValueError, match=f"max_shapes must be an int >= 1 or None, got {bad!r}"):
        choose_shapes(costs, AcceptanceProfile(((0.5,),)), max_shapes=bad)


def test_profiles_round_trip_through_json(tmp_path):
    prof = AcceptanceProfile(((0.5, 0.25),))
    prof.save(tmp_path / "a.json")
    assert AcceptanceProfile.load(tmp_path / "a.json") == prof
    costs = CostProfile(plain={1: 2.0}, shapes={1: {"4,5,8": 3.5}}, device="cpu", model="tiny")
    costs.save(tmp_path / "c.json")
    assert CostProfile.load(tmp_path / "c.json") == costs


@pytest.mark.parametrize("rates, match", [
    ((), "non-empty"),
    (((0.5,), (0.5, 0.1)), r"rates\[1\] has 2 ranks"),
    (((1.5,),), r"rates\[0\]\[0\] must be a number in \[0, 1\]"),
    (((float("nan"),),), r"rates\[0\]\[0\]"),
    (((None,),), r"rates\[0\]\[0\]"),
    (((0.5, 0.1), (0.7, 0.5)), r"rates\[1\] sums to 1.2 > 1"),
])
def test_bad_acceptance_profiles_are_refused_by_name(rates, match):
    with pytest.raises(ValueError, match=match):
        AcceptanceProfile(rates)


def test_a_measured_row_above_one_caps_its_lower_ranks():
    # Ranks are offered on different iterations, so taken / offered per rank
    # can sum above 1; siblings are exclusive, so the profile keeps at most 1,
    # taking it off the lower ranks: rank 0 keeps what the engine measured.
    from fa3_spec.eagle.stats import EngineStats

    stats = EngineStats(max_depth=2, topk=2)
    stats.offered[1] = torch.tensor([10, 2])
    stats.taken[1] = torch.tensor([8, 1])
    stats.offered[2] = torch.tensor([8, 0])
    stats.taken[2] = torch.tensor([4, 0])
    prof = AcceptanceProfile.from_stats(stats)
    assert prof.rates[0] == pytest.approx((0.8, 0.2))
    assert prof.rates[1] == (0.5, 0.0)
    # A chain's prediction is then exactly the measured rank-0 rates'.
    assert expected_accept_length((1, 2, 3), prof) == pytest.approx(1 + 0.8 + 0.8 * 0.5)
    # An unseen rank's default is capped the same way.
    stats.offered[1], stats.taken[1] = torch.tensor([10, 0]), torch.tensor([8, 0])
    assert AcceptanceProfile.from_stats(stats, default=0.5).rates[0] == pytest.approx((0.8, 0.2))


def test_a_row_rising_with_rank_never_verifies_a_sibling_before_a_better_scored_one():
    # Rank is the draft's own order of siblings: the engine never verifies a
    # rank-1 child without its rank-0 sibling, whatever the measured rates say.
    prof = AcceptanceProfile(((0.05, 0.9),))
    assert expected_accept_length((2, 1, 2), prof) == pytest.approx(1.05)
    assert [(d, r) for d, r, _ in drafted_tree((2, 1, 2), prof)] == [(1, 0)]
    # With room for both, each counts with its own rate.
    assert expected_accept_length((2, 1, 3), prof) == pytest.approx(1.95)
    # Deeper: the capped score keeps rank 1's subtree from being verified ahead
    # of its rank-0 sibling (uncapped: (1, 1), then its children).
    deep = AcceptanceProfile(((0.1, 0.8), (0.5, 0.0), (0.5, 0.4)))
    assert [(d, r) for d, r, _ in drafted_tree((2, 3, 4), deep)] == [(1, 0), (1, 1), (2, 0)]


@pytest.mark.parametrize("call, match", [
    (lambda p: p.rate(0, 0), "depth must be an int >= 1"),
    (lambda p: p.rate(1, -1), "rank an int >= 0"),
    (lambda p: p.rate(-1, 0), "got depth=-1"),
])
def test_a_rate_outside_the_table_s_indices_is_refused_not_wrapped(call, match):
    prof = AcceptanceProfile(((0.5,), (0.4,)))
    assert prof.rate(1, 0) == 0.5 and prof.rate(3, 0) == 0.0 and prof.rate(1, 5) == 0.0
    with pytest.raises(ValueError, match=match):
        call(prof)


def test_profiles_of_the_wrong_type_are_refused_by_name():
    prof = AcceptanceProfile(((0.5,),))
    costs = CostProfile(plain={1: 1.0}, shapes={1: {"1,2,3": 1.0}})
    with pytest.raises(TypeError, match="profile must be an AcceptanceProfile, got list"):
        expected_accept_length((1, 1, 2), [[0.7]])
    with pytest.raises(TypeError, match="costs must be a CostProfile, got dict"):
        choose_shapes({1: 1.0}, prof)
    with pytest.raises(TypeError, match="profile must be an AcceptanceProfile, got dict"):
        choose_shapes(costs, {"rates": [[0.5]]})


def test_no_buckets_choose_nothing_with_or_without_max_shapes():
    costs = CostProfile(plain={1: 1.0}, shapes={1: {"1,2,3": 1.0}})
    prof = AcceptanceProfile(((0.5,),))
    assert choose_shapes(costs, prof, []) == {} == choose_shapes(costs, prof, [], max_shapes=1)


def test_max_shapes_that_the_unbounded_choice_fits_weighs_only_the_best_options():
    # 30 candidate chains over 5 buckets, each accepting alike (only depth 1
    # counts) and each bucket's cheapest a different one: max_shapes at or
    # above those 5 gives the unbounded choice, without weighing every set of
    # the 31 candidates (206,367 of at most 5).
    prof = AcceptanceProfile(((0.7,),))
    shapes = {b: {f"1,{s},{s + 1}": 10.0 - 0.001 * ((s * b) % 31) for s in range(1, 31)}
              for b in range(1, 6)}
    costs = CostProfile(plain={b: 10.0 for b in range(1, 6)}, shapes=shapes)
    unbounded = choose_shapes(costs, prof)
    assert len({c.shape for c in unbounded.values()}) == 5
    for k in (5, 10, 100):
        assert choose_shapes(costs, prof, max_shapes=k) == unbounded, k


@pytest.mark.parametrize("plain, shapes, match", [
    ({}, {1: {}}, "plain must be a non-empty dict"),
    ({1: 0.0}, {1: {"1,2,3": 1.0}}, r"plain\[1\]"),
    ({1: 1.0}, {2: {"1,2,3": 1.0}}, r"shapes\[2\]: no plain\[2\]"),
    ({1: 1.0}, {1: {"1,2": 1.0}}, "topk,steps,N"),
    ({1: 1.0}, {1: {"1,2,3": math.inf}}, r"shapes\[1\]\['1,2,3'\]"),
    ({True: 1.0}, {1: {"1,2,3": 1.0}}, "bucket True"),
    ({1: 1.0}, {1: {"1,2,3": 1.0, "1, 2, 3": 2.0}}, r"shapes\[1\]: a shape key .* got '1, 2, 3'"),
    ({1: 1.0}, {1: {"01,2,3": 1.0}}, r"shapes\[1\]: a shape key .* got '01,2,3'"),
    ({1: 1.0}, {1: {"1_0,2,3": 1.0}}, r"got '1_0,2,3'"),
    ({1: 1.0}, {1: {"+1,2,3": 1.0}}, r"got '\+1,2,3'"),
    ({1: 1.0}, {1: {"\uff11,2,3": 1.0}}, r"a shape key"),
])
def test_bad_cost_profiles_are_refused_by_name(plain, shapes, match):
    with pytest.raises(ValueError, match=match):
        CostProfile(plain=plain, shapes=shapes)


@pytest.mark.parametrize("fields, match", [
    (dict(shapes={1: [("1,2,3", 1.0)]}), r"shapes\[1\] must be a dict"),
    (dict(shapes={1: {(1, 2, 3): 1.0}}), r"shapes\[1\]: shape key \(1, 2, 3\) must be a str"),
    (dict(shapes={1: {"1,2,3": 1.0}}, device=None), "device must be a str"),
])
def test_cost_profile_fields_of_the_wrong_type_are_refused_by_name(fields, match):
    with pytest.raises(TypeError, match=match):
        CostProfile(**{"plain": {1: 1.0}, **fields})


@pytest.mark.parametrize("key", ["01", " 1", "1_0", "1.0", "-1"])
def test_a_cost_profile_file_s_bucket_keys_are_decimal_ints(tmp_path, key):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"plain": {"1": 5.0, key: 9.0}, "shapes": {"1": {"1,2,3": 7.0}}}))
    with pytest.raises(ValueError, match=f"costs.json: .*bucket key {key!r}"):
        CostProfile.load(path)


def test_choose_shapes_refuses_a_bucket_that_is_not_an_int():
    costs = CostProfile(plain={1: 1.0}, shapes={1: {"1,2,3": 1.0}})
    profile = AcceptanceProfile(((0.5,),))
    for bad in ("1", True, 1.0):
        with pytest.raises(TypeError, match=f"buckets: {bad!r}"):
            choose_shapes(costs, profile, [bad])


def test_a_file_that_is_not_a_profile_is_refused_by_name(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rates": [[0.5, None]]}))
    with pytest.raises(ValueError, match="bad.json"):
        AcceptanceProfile.load(bad)
    with pytest.raises(ValueError, match="bad.json: not a cost profile"):
        CostProfile.load(bad)
    for rates in (5, None, "0.5"):
        bad.write_text(json.dumps({"rates": rates}))
        with pytest.raises(ValueError, match="bad.json: 'rates' must be a list of rows"):
            AcceptanceProfile.load(bad)


def _hooked_engine(shape, hook, requests=16, max_new=64):
    k, s, n = shape
    models = make_models("tiny", draft="derived", seed=0)
    spec = fa3_spec.SpecConfig(page_size=2, topk=k, num_steps=s, num_draft_tokens=n, max_bs=4,
                               max_context_len=40 + max_new + n)
    spec = dataclasses.replace(spec, num_pages=spec.pool_pages(8, LoopConfig.draft_attention))
    eng = EagleEngine(LoopConfig(spec, max_new_tokens=max_new, attention_backend="torch"), models,
                      max_reqs=8, buckets=[4], graphs=False, compile_backend="none",
                      acceptance=hook)
    prompts, news = workload(requests, page_size=2, max_prompt=40, max_new=max_new,
                             vocab=models.vocab_size, seed=5)
    for p, m in zip(prompts, news):
        eng.submit(p, m)
    eng.run()
    return eng


def test_the_profile_hook_accepts_as_the_profile_says_and_bigger_trees_accept_more():
    from fa3_spec.eagle.acceptance import profile_acceptance

    rates = ((0.6, 0.2, 0.1, 0.05), (0.7, 0.1, 0.05, 0.0), (0.7, 0.1, 0.0, 0.0))
    chain = _hooked_engine((1, 3, 4), profile_acceptance(rates, seed=1))
    tree = _hooked_engine((4, 3, 8), profile_acceptance(rates, seed=1))
    prof = AcceptanceProfile(rates)
    for eng, shape in ((chain, (1, 3, 4)), (tree, (4, 3, 8))):
        measured = AcceptanceProfile.from_stats(eng.stats).rates
        offered = eng.stats.offered
        assert int(offered[1, 0]) > 50
        # The depth-1 first-sibling rate the hook drew, within sampling error.
        assert abs(measured[0][0] - 0.6) < 4 * (0.24 / int(offered[1, 0])) ** 0.5
    assert tree.stats.mean_accept_len > chain.stats.mean_accept_len
    assert chain.stats.mean_accept_len == pytest.approx(
        expected_accept_length((1, 3, 4), prof), rel=0.15)


def test_a_device_table_hook_draws_as_the_constant_one_and_switches_after_compiling():
    from fa3_spec.eagle.acceptance import profile_acceptance

    rates = ((0.6, 0.2, 0.1, 0.05), (0.7, 0.1, 0.05, 0.0), (0.7, 0.1, 0.0, 0.0))
    const = _hooked_engine((4, 3, 8), profile_acceptance(rates, seed=1), requests=6, max_new=32)
    table = _hooked_engine((4, 3, 8), profile_acceptance(rates, seed=1, device="cpu"),
                           requests=6, max_new=32)
    assert const.results() == table.results()
    assert [s["accept_lens"] for s in const.request_stats().values()] == \
        [s["accept_lens"] for s in table.request_stats().values()]

    # Compiled (dynamo, fullgraph), then switched: the table is read at every
    # call, not folded into the graph when it was traced.
    hook = profile_acceptance(((1.0,), (1.0,), (1.0,)), seed=1, device="cpu")
    compiled = torch.compile(hook, fullgraph=True, backend="eager")
    parents = torch.tensor([[-1, 0, 1, 2]] * 3)  # a chain of 3
    args = (torch.arange(12).view(3, 4), parents, torch.tensor([True, True, False]),
            torch.zeros(3, dtype=torch.int64), 3)
    assert compiled(*args)[1].tolist() == [3, 3, 0]
    hook.set_rates(((0.0,),))  # shallower than the table: padded with 0
    assert compiled(*args)[1].tolist() == [0, 0, 0]
    assert hook.rates == ((0.0,),)


@pytest.mark.parametrize("call, match", [
    (lambda h: h.set_rates(((0.5, 0.5, 0.0),)), "1 depths x 3 ranks do not fit"),
    (lambda h: h.set_rates(((0.7, 0.5),)), r"rates\[0\] sums to 1.2"),
])
def test_set_rates_refuses_a_table_that_does_not_fit(call, match):
    from fa3_spec.eagle.acceptance import profile_acceptance

    with pytest.raises(ValueError, match=match):
        call(profile_acceptance(((0.5, 0.2),), device="cpu"))
    with pytest.raises(ValueError, match="needs a hook made with device="):
        profile_acceptance(((0.5, 0.2),)).set_rates(((0.5,),))


@pytest.mark.parametrize("rates, seed, match", [
    (((0.7, 0.5),), 0, r"rates\[0\] sums to 1.2"),
    ((), 0, "non-empty"),
    (((0.5,),), 1.5, "seed must be an int"),
])
def test_bad_profile_hooks_are_refused_by_name(rates, seed, match):
    from fa3_spec.eagle.acceptance import profile_acceptance

    with pytest.raises(ValueError, match=match):
        profile_acceptance(rates, seed=seed)


def test_a_shape_key_parses_back_to_the_shape_it_was_written_from():
    from fa3_spec.eagle.policy import parse_shape_key, shape_key

    for shape in ((8, 5, 16), (1, 2, 3), (10, 10, 100)):
        assert parse_shape_key(shape_key(shape)) == shape
    with pytest.raises(TypeError, match="a shape key is a str"):
        parse_shape_key((8, 5, 16))
    with pytest.raises(ValueError, match=r"1 steps of topk 1 draft 1 nodes"):
        parse_shape_key("1,1,5")
