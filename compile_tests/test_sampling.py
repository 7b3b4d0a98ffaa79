"""Lossless speculative sampling (`fa3_spec.eagle.sampling`): distribution, greedy, seeds, compile.

The distribution tests use a target small enough to enumerate: an order-1
Markov model over ``V = 8`` tokens (the logits at a node depend on the node's
token only: a table ``[V, V]``), drafts that are EAGLE-style top-``k`` trees
built from a draft table (the target's own logits: high acceptance; an
independent random table: low acceptance), and the loop's bookkeeping (emit the accepted
path, then the token drawn at its end; that token is the next root). The
exact joint law of the first three emitted tokens is then
``p(a | r) p(b | a) p(c | b)`` with ``p`` the filtered distribution
(temperature, top-k, top-p). Each row of a batch is one independent draw
(its own seed), so thousands of draws take one batched call per iteration.

The test: Pearson's chi-square over the cells of positive probability (cells
expected below 5 pooled, compile_tests/chisquare.py), rejected when its
p-value is below ``ALPHA = 1e-3``; any draw in a cell of probability 0 fails
outright. Seeds are fixed, so the outcome is deterministic: a correct sampler
fails it by bad luck for 1 in 1000 seed sets. Power, computed by the
noncentral chi-square approximation for the draws used here, is asserted to
be above 0.99 against a sampler that is too cold by a factor 0.8 in
temperature (and the test is shown to reject that sampler, and one that
always emits the draft's tokens, on the same draws).

CI runs chain (topk 1) and tree (topk 4) with high- and low-acceptance
drafts, two parameter groups sharing one batch, 4000 draws per group;
``FA3_SPEC_SAMPLING_FULL=1`` runs a larger grid with 20000 draws.
"""

import os

import pytest
import torch

from chisquare import chi_square, power
from fa3_spec.eagle.sampling import (
    SamplingParams, check_sampling_params, filtered_probs, philox4x32, sample_tokens,
    sample_tree, speculative_walk, uniforms,
)
from fa3_spec.probes import RecordingBackend

FULL = os.environ.get("FA3_SPEC_SAMPLING_FULL") == "1"
ALPHA = 1e-3
V = 8
DRAWS = 20000 if FULL else 4000
ROOT = 0  # every draw starts from this root token


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def target_table(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g, dtype=torch.float64) * scale


def draft_table(table, draft):
    """The draft's logits: the target's own (high acceptance) or independent ones (low)."""
    return table if draft == "high" else target_table(seed=5)


def make_trees(draft_logits, k, s, n):
    """An EAGLE-style tree per root token: every node's top-``k`` draft children
    to depth ``s``, the ``n - 1`` best by cumulative draft log-probability
    (ancestors score higher, so they are kept), ordered by depth then score.
    Returns ``tokens, parents`` int64 ``[V, n]`` (row = root token)."""
    logq = torch.log_softmax(draft_logits, -1)
    all_tokens, all_parents = [], []
    for root in range(V):
        nodes = [(root, -1, 0, 0.0)]  # token, parent (index in nodes), depth, score
        frontier = [0]
        for _ in range(s):
            nxt = []
            for i in frontier:
                tok, _, d, score = nodes[i]
                top = logq[tok].topk(k)
                for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                    nodes.append((t, i, d + 1, score + lp))
                    nxt.append(len(nodes) - 1)
            frontier = nxt
        best = sorted(range(1, len(nodes)), key=lambda i: -nodes[i][3])[: n - 1]
        order = [0] + sorted(best, key=lambda i: (nodes[i][2], -nodes[i][3]))
        where = {old: new for new, old in enumerate(order)}
        all_tokens.append([nodes[i][0] for i in order])
        all_parents.append([where.get(nodes[i][1], -1) for i in order])
    return torch.tensor(all_tokens), torch.tensor(all_parents)


def emit(table, trees, params, num_tokens=3, walk=sample_tree, max_depth=None):
    """The first ``num_tokens`` emitted tokens of every row ``[B, num_tokens]``,
    iterating verify + accept as the loop does (counter = tokens emitted, from 1)."""
    tok_t, par_t = trees
    bs, n = params.seed.shape[0], tok_t.shape[1]
    depth = max_depth if max_depth is not None else n - 1
    width = num_tokens + depth + 1
    out = torch.zeros(bs, width + 1, dtype=torch.int64)  # last column: trash
    out_len = torch.zeros(bs, dtype=torch.int64)
    root = torch.full((bs,), ROOT, dtype=torch.int64)
    counter = torch.ones(bs, dtype=torch.int64)
    live = torch.ones(bs, dtype=torch.bool)
    i = torch.arange(depth + 1)
    for _ in range(num_tokens):
        tokens, parents = tok_t[root], par_t[root]
        path, accepted, last = walk(table[tokens], tokens, parents, live, params, counter, depth)
        nxt = torch.cat([path[:, 1:], path[:, -1:]], 1)
        emitted = torch.where(i < accepted.unsqueeze(1), tokens.gather(1, nxt), last.unsqueeze(1))
        col = torch.where(i <= accepted.unsqueeze(1), out_len.unsqueeze(1) + i, width)
        out.scatter_(1, col.clamp(max=width), emitted)
        out_len += accepted + 1
        counter += accepted + 1
        root = last
    assert (out_len >= num_tokens).all()
    return out[:, :num_tokens]


def exact_joint(table, temperature, top_k, top_p, num_tokens=3):
    """Exact law of the first ``num_tokens`` tokens, flattened ``[V ** num_tokens]``."""
    ones = torch.ones(V)
    p = filtered_probs(table, temperature * ones, torch.full((V,), top_k), top_p * ones)
    joint = p[ROOT]  # joint[..., a] * p[a, b]: the next token given the last one
    for _ in range(num_tokens - 1):
        joint = joint.unsqueeze(-1) * p.view((1,) * (joint.dim() - 1) + (V, V))
    return joint.flatten()


def cells(seqs):
    idx = torch.zeros(seqs.shape[0], dtype=torch.int64)
    for j in range(seqs.shape[1]):
        idx = idx * V + seqs[:, j]
    return torch.bincount(idx, minlength=V ** seqs.shape[1])


def batch_of_groups(groups, draws, seed0):
    """One batch, ``draws`` rows per parameter group (``(T, top_k, top_p)``), distinct seeds."""
    parts = [SamplingParams.full(draws, temperature=t, top_k=k, top_p=p) for t, k, p in groups]
    params = SamplingParams(*(torch.cat(x) for x in zip(*parts)))
    return params._replace(seed=seed0 * 1_000_003 + torch.arange(len(groups) * draws))


def always_draft(logits, tokens, parents, live, params, counter, max_depth):
    """Broken sampler (power check): always accepts a node's first child, then draws from p."""
    probs = filtered_probs(logits, params.temperature, params.top_k, params.top_p)
    n = tokens.shape[1]
    is_child = parents.unsqueeze(1) == torch.arange(n).view(1, n, 1)  # [B, node, j]
    first = torch.where(is_child, torch.arange(n), n).amin(-1)  # first child (n: none)
    tok = tokens.gather(1, first.clamp(max=n - 1))
    one_hot = torch.nn.functional.one_hot(tok, V).to(probs.dtype)
    probs = torch.where((first < n).unsqueeze(-1), one_hot, probs)
    u = uniforms(params.seed.unsqueeze(1), counter.unsqueeze(1), torch.arange(n).unsqueeze(0))
    return speculative_walk(probs, tokens, parents, live, u, max_depth)


TOPOLOGIES = {"chain": (1, 3, 4), "tree": (4, 3, 8)}  # (topk, num_steps, N)
GROUPS = [(1.0, 3, 1.0), (0.7, 0, 0.8)]  # two parameter groups in one batch
FULL_GROUPS = [(0.5, 0, 1.0), (1.0, 2, 1.0), (1.3, 5, 0.9), (1.0, 100, 0.6), (2.0, 4, 1.0)]


def run_case(topology, draft, groups, draws, seed0, table=None):
    table = target_table() if table is None else table
    k, s, n = TOPOLOGIES[topology]
    trees = make_trees(draft_table(table, draft), k, s, n)
    params = batch_of_groups(groups, draws, seed0)
    return table, trees, params, emit(table, trees, params)


def acceptance(table, trees, params):
    """Mean accepted drafts of the first iteration (for the high/low labels)."""
    tok, par = trees[0][params.seed * 0 + ROOT], trees[1][params.seed * 0 + ROOT]
    live = torch.ones(tok.shape[0], dtype=torch.bool)
    _, accepted, _ = sample_tree(table[tok], tok, par, live, params,
                                 torch.ones_like(params.seed), tok.shape[1] - 1)
    return float(accepted.double().mean())


CASES = [(t, d) for t in TOPOLOGIES for d in ("high", "low")]


@pytest.mark.parametrize("topology, draft", CASES, ids=[f"{t}-{d}" for t, d in CASES])
def test_first_three_tokens_follow_the_exact_target_law(topology, draft):
    groups = GROUPS + (FULL_GROUPS if FULL else [])
    table, trees, params, seqs = run_case(topology, draft, groups, DRAWS, seed0=len(topology))
    for g, (t, k, p) in enumerate(groups):
        rows = slice(g * DRAWS, (g + 1) * DRAWS)
        res = chi_square(cells(seqs[rows]), exact_joint(table, t, k, p), ALPHA)
        assert not res.rejects, (topology, draft, (t, k, p), res)
    mean = acceptance(table, trees, params)
    assert (mean > 1.0) if draft == "high" else (0 < mean < 0.5), mean


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_the_test_has_power_against_a_too_cold_sampler(topology):
    t, k, p = GROUPS[0]
    table = target_table()
    want = exact_joint(table, t, k, p)
    cold = exact_joint(table, 0.8 * t, k, p)
    assert power(want, cold, DRAWS, ALPHA) > 0.99
    _, _, _, seqs = run_case(topology, "high", [(0.8 * t, k, p)], DRAWS, seed0=7)
    assert chi_square(cells(seqs), want, ALPHA).rejects


@pytest.mark.parametrize("draft", ["high", "low"])
def test_the_test_rejects_a_sampler_that_always_emits_the_draft(draft):
    t, k, p = GROUPS[0]
    table = target_table()
    kk, s, n = TOPOLOGIES["tree"]
    trees = make_trees(draft_table(table, draft), kk, s, n)
    params = batch_of_groups([(t, k, p)], DRAWS, seed0=11)
    seqs = emit(table, trees, params, walk=always_draft)
    res = chi_square(cells(seqs), exact_joint(table, t, k, p), ALPHA)
    assert res.rejects, res


# ----------------------------------------------------------------- the pieces
def test_philox_matches_random123_known_answers():
    kat = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
           ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
           ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, want in kat:
        got = philox4x32(tuple(torch.tensor(c) for c in ctr), tuple(torch.tensor(c) for c in key))
        assert [int(x) for x in got] == list(want)


def test_uniforms_are_in_range_uniform_and_keyed_only_by_their_key():
    seeds = torch.tensor([0, 1, -1, 2 ** 62, -2 ** 63])
    u = uniforms(seeds.view(-1, 1), torch.arange(20000).view(1, -1), torch.tensor(3))
    assert u.dtype == torch.float64 and (u >= 0).all() and (u < 1).all()
    res = chi_square(torch.bincount((u.flatten() * 100).long(), minlength=100),
                     torch.full((100,), 0.01), ALPHA)
    assert not res.rejects, res
    assert torch.equal(uniforms(seeds[2], torch.tensor(17), torch.tensor(3)), u[2, 17])
    assert u[0, 0] != u[1, 0] and u[0, 0] != u[0, 1]
    assert uniforms(seeds[0], torch.tensor(0), torch.tensor(4)) != u[0, 0]


def _reference_probs(logits, t, k, p):
    """Row-by-row filtered distribution, written the obvious way."""
    if t == 0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).double()
    z = logits.double() / t
    if 0 < k < z.numel():
        z = torch.where(z >= z.sort(descending=True).values[k - 1], z, float("-inf"))
    probs = torch.softmax(z, -1)
    if p < 1:
        keep = torch.zeros_like(probs, dtype=torch.bool)
        mass = 0.0
        for j in probs.argsort(descending=True).tolist():
            if mass < p:
                keep[j] = True
            mass += float(probs[j])
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    return probs


def test_filtered_probs_matches_a_row_by_row_reference_in_one_mixed_batch():
    g = torch.Generator().manual_seed(3)
    rows = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.5, 3, 1.0), (1.0, 0, 0.3), (2.0, 5, 0.9),
            (1.0, 1, 1.0), (0.7, 10 ** 6, 0.5), (1e-4, 0, 1.0), (0.0, 2, 0.1)]
    logits = torch.randn(len(rows), 3, 50, generator=g, dtype=torch.float64) * 3
    t, k, p = (torch.tensor(c) for c in zip(*rows))
    got = filtered_probs(logits, t.float(), k, p.double())
    assert got.dtype == torch.float64
    for b, (tb, kb, pb) in enumerate(rows):
        for node in range(3):
            want = _reference_probs(logits[b, node], float(t.float()[b]), kb, pb)
            torch.testing.assert_close(got[b, node], want, rtol=1e-12, atol=1e-15)
    # Greedy rows are the exact one-hot of argmax; top_p = 1 keeps even 1e-30 masses.
    assert torch.equal(got[0].argmax(-1), logits[0].argmax(-1))
    assert (got[0].max(-1).values == 1).all()
    assert (got[1] > 0).all()
    bf16 = filtered_probs(logits.bfloat16(), t.float(), k, p.float())
    assert bf16.dtype == torch.float32


def _greedy_walk(logits, tokens, parents, depth):
    """The loop's greedy acceptance, written independently: follow the argmax."""
    path, acc, bonus = [], [], []
    for b in range(tokens.shape[0]):
        cur, nodes = 0, [0]
        for _ in range(depth):
            want = int(logits[b, cur].argmax())
            kids = [j for j in range(tokens.shape[1])
                    if int(parents[b, j]) == cur and int(tokens[b, j]) == want]
            if not kids:
                break
            cur = kids[0]
            nodes.append(cur)
        acc.append(len(nodes) - 1)
        path.append(nodes + [cur] * (depth + 1 - len(nodes)))
        bonus.append(int(logits[b, cur].argmax()))
    return torch.tensor(path), torch.tensor(acc), torch.tensor(bonus)


def random_trees(bs, n, seed, vocab):
    """Random parent arrays (parents before children) with tokens that often
    match the target's argmax, so greedy paths are long."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(0, j, (1,), generator=g))
                                                for j in range(1, n)]) for _ in range(bs)])
    tokens = torch.randint(0, vocab, (bs, n), generator=g)
    logits = torch.randn(bs, n, vocab, generator=g, dtype=torch.float64)
    for j in range(1, n):  # half the nodes hold their parent's argmax
        take = torch.rand(bs, generator=g) < 0.5
        arg = logits[torch.arange(bs), parents[:, j]].argmax(-1)
        tokens[:, j] = torch.where(take, arg, tokens[:, j])
    return logits, tokens, parents


def test_greedy_rows_are_the_argmax_walk_inside_a_sampled_batch():
    bs, n, vocab, depth = 24, 8, 16, 5
    logits, tokens, parents = random_trees(bs, n, 0, vocab)
    greedy = torch.arange(bs) % 2 == 0
    params = SamplingParams(torch.where(greedy, 0.0, 1.0), torch.where(greedy, 0, 4),
                            torch.where(greedy, 1.0, 0.9), torch.arange(bs) * 7919)
    live = torch.ones(bs, dtype=torch.bool)
    got = sample_tree(logits, tokens, parents, live, params, torch.full((bs,), 5), depth)
    want = _greedy_walk(logits, tokens, parents, depth)
    for a, b in zip(got, want):
        assert torch.equal(a[greedy], b[greedy])
    assert want[1][greedy].sum() > bs // 2  # the greedy paths are not all empty
    first = sample_tokens(logits[:, 0], params, torch.zeros(bs, dtype=torch.int64))
    assert torch.equal(first[greedy], logits[greedy, 0].argmax(-1))


def test_padding_rows_accept_nothing():
    logits, tokens, parents = random_trees(4, 6, 1, 10)
    params = SamplingParams.full(4, temperature=1.0)
    live = torch.tensor([True, False, True, False])
    _, accepted, _ = sample_tree(logits, tokens, parents, live, params, torch.ones(4).long(), 4)
    assert (accepted[~live] == 0).all()


def test_same_seed_same_tokens_alone_and_at_any_batch_position():
    bs, n, vocab, depth = 12, 8, 16, 5
    logits, tokens, parents = random_trees(bs, n, 2, vocab)
    params = SamplingParams(torch.linspace(0.3, 1.5, bs), torch.arange(bs) % 5,
                            torch.linspace(0.5, 1.0, bs), torch.arange(bs) + 100)
    counter = torch.arange(bs) + 3
    live = torch.ones(bs, dtype=torch.bool)
    batched = sample_tree(logits, tokens, parents, live, params, counter, depth)
    perm = torch.randperm(bs, generator=torch.Generator().manual_seed(0))
    pick = lambda x, i: x[i]  # noqa: E731
    shuffled = sample_tree(logits[perm], tokens[perm], parents[perm], live,
                           SamplingParams(*(pick(x, perm) for x in params)), counter[perm], depth)
    for a, b in zip(batched, shuffled):
        assert torch.equal(a[perm], b)
    for row in (0, 5, bs - 1):
        one = slice(row, row + 1)
        alone = sample_tree(logits[one], tokens[one], parents[one], live[one],
                            SamplingParams(*(x[one] for x in params)), counter[one], depth)
        for a, b in zip(batched, alone):
            assert torch.equal(a[one], b)
    other = sample_tree(logits, tokens, parents, live, params._replace(seed=params.seed + 1),
                        counter, depth)
    assert not all(torch.equal(a, b) for a, b in zip(batched, other))


def test_sampling_compiles_fullgraph_with_no_data_dependent_ops_and_equals_eager():
    bs, n, vocab, depth = 6, 5, 16, 3
    logits, tokens, parents = random_trees(bs, n, 4, vocab)
    params = SamplingParams(torch.tensor([0.0, 0.5, 1.0, 1.0, 2.0, 0.0]),
                            torch.tensor([0, 0, 3, 100, 2, 1]),
                            torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0, 0.2]),
                            torch.tensor([1, -2, 3, 2 ** 62, 5, 6]))
    live = torch.tensor([True, True, True, True, False, True])
    counter = torch.tensor([1, 2, 3, 4, 5, 6])

    def step(logits, tokens, parents, live, params, counter):
        tree = sample_tree(logits, tokens, parents, live, params, counter, depth)
        return tree + (sample_tokens(logits[:, 0], params, counter),)

    backend = RecordingBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    got = compiled(logits, tokens, parents, live, params, counter)
    want = step(logits, tokens, parents, live, params, counter)
    assert backend.frame_count == 1 and backend.data_dependent == []
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # New values, same shapes: no recompile.
    params2 = params._replace(seed=params.seed + 9, temperature=params.temperature.flip(0))
    with torch._dynamo.config.patch(error_on_recompile=True):
        got2 = compiled(logits, tokens, parents, live, params2, counter + 1)
    for a, b in zip(got2, step(logits, tokens, parents, live, params2, counter + 1)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(top_k=-1), "top_k"),
    (dict(top_k=1.5), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"),
    (dict(seed=2 ** 63), "seed"), (dict(seed="1"), "seed"),
])
def test_bad_parameters_are_value_errors_naming_the_argument(kwargs, name):
    args = dict(temperature=1.0, top_k=0, top_p=1.0, seed=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        check_sampling_params(**args)
