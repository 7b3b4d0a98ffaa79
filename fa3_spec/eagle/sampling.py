"""Lossless speculative sampling over a deterministic top-k draft tree, on the device.

Three pieces, each a pure function of device tensors with static shapes (no
host sync, no data-dependent shape, no Python branch on a tensor value), so
they compile with ``torch.compile(fullgraph=True)`` and capture into the
loop's CUDA graph; rows with different parameters share one batch.

1. **The target's sampling distribution** (`filtered_probs`): per row
   ``temperature`` (0 = greedy: a one-hot at the argmax), ``top_k`` (0 = off,
   above the vocabulary = off), ``top_p`` (1 = off), applied in that order as
   sglang, vLLM and Hugging Face do.
2. **Randomness** (`uniforms`): Philox4x32-10 (Salmon et al., "Parallel random
   numbers: as easy as 1, 2, 3", SC'11), the counter-based generator of
   PyTorch's CUDA RNG, written in int64 tensor ops (every product < 2^50: no
   overflow, so CPU, CUDA and inductor agree bit for bit). Key = the request's
   ``seed``; counter = (tokens the request has emitted, stream). A draw
   depends on nothing else: not the batch row, not the bucket, not the
   graph. Uniforms are float64 with 53 random bits.
3. **Tree verification** (`speculative_walk`): the recursive rejection
   sampling of SpecInfer (Miao et al., ASPLOS'24, "multi-step speculative
   sampling") specialised to a draft that is a point mass at each child,
   which is what an EAGLE top-k tree is (sglang calls it "target only").
   From the root, at node ``c`` with target distribution ``p`` and residual
   ``r = p``, try the children in index order; child token ``x`` is accepted
   with probability ``r(x) / sum(r)``; on rejection ``r(x) = 0``. If a child
   is accepted the walk moves to it; otherwise the emitted token is drawn
   from ``r / sum(r)``. At the end of a fully accepted path (a node without
   children) nothing was rejected and the bonus token is drawn from ``p``.

Why it is lossless (docs/semantics.md, "Lossless speculative sampling"):
speculative sampling with draft ``q`` accepts ``x ~ q`` with probability
``min(1, p(x) / q(x))`` and on rejection draws from ``norm(max(p - q, 0))``
(Leviathan et al. 2023; Chen et al. 2023). For ``q = delta_x`` that is:
accept with probability ``p(x)``; residual ``p`` with ``x`` removed,
renormalised. Each try is exact, so by induction over the siblings the token
emitted at a node has distribution ``p``: sampling without replacement, read
one draw at a time: with ``R_m = 1 - sum_{i<m} p(x_i)`` the mass left when
sibling ``m`` is tried, ``P(emit x_m) = prod_{i<m} (R_{i+1} / R_i) * p(x_m) /
R_m = p(x_m)``, and a token ``y`` no child holds is emitted with ``R_{M+1} *
p(y) / R_{M+1} = p(y)``.
"""

from __future__ import annotations

import secrets
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from .vocab import vocab_argmax, vocab_cumsum

#: Philox4x32 constants (Salmon et al. 2011): round multipliers, Weyl key bumps.
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_PHILOX_ROUNDS = 10
_M32 = 0xFFFFFFFF
_M16 = 0xFFFF

#: Stream of the one token an iteration (or the prefill) draws from a residual;
#: streams ``1 .. N-1`` are the accept coins of tree nodes ``1 .. N-1``.
FINAL_STREAM = 0


class RequestSampling(NamedTuple):
    """One request's sampling parameters on the host (checked by `create`)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @classmethod
    def create(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               seed: Optional[int] = None) -> "RequestSampling":
        """Checked (`check_sampling_params`); ``seed=None`` draws a fresh one
        (63 bits from the operating system's entropy)."""
        check_sampling_params(temperature, top_k, top_p, seed)
        if seed is None:
            seed = secrets.randbits(63)
        return cls(float(temperature), int(top_k), float(top_p), int(seed))


class SamplingParams(NamedTuple):
    """Per-row sampling parameters, device tensors of shape ``[B]``.

    Attributes:
        temperature: float ``[B]``, ``>= 0``; ``0`` is greedy (argmax).
        top_k: int64 ``[B]``, ``>= 0``; ``0`` = off, ``> vocab`` = off.
        top_p: float ``[B]`` in ``(0, 1]``; ``1`` = off.
        seed: int64 ``[B]``, the Philox key of the row's request.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor

    @classmethod
    def from_state(cls, st: dict) -> "SamplingParams":
        """The parameters held in a loop state (`state_entries`' keys)."""
        return cls(st["temperature"], st["top_k"], st["top_p"], st["seed"])

    @classmethod
    def stack(cls, requests: Sequence[RequestSampling], device) -> "SamplingParams":
        """Rows of the given requests' parameters (one host-to-device copy each)."""
        t, k, p, seed = zip(*requests) if requests else ((), (), (), ())
        return cls(torch.tensor(t, dtype=torch.float32, device=device),
                   torch.tensor(k, dtype=torch.int64, device=device),
                   torch.tensor(p, dtype=torch.float32, device=device),
                   torch.tensor(seed, dtype=torch.int64, device=device))

    @classmethod
    def full(cls, batch: int, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: int = 0, device="cpu") -> "SamplingParams":
        """``batch`` rows of the same (checked) parameters."""
        check_sampling_params(temperature, top_k, top_p, seed)
        f32 = dict(dtype=torch.float32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        return cls(torch.full((batch,), float(temperature), **f32),
                   torch.full((batch,), int(top_k), **i64),
                   torch.full((batch,), float(top_p), **f32),
                   torch.full((batch,), int(seed), **i64))


def state_entries(max_bs: int, device) -> dict:
    """The loop state's sampling rows (`fa3_spec.eagle.iteration.empty_state`):
    greedy (temperature 0, top-k and top-p off, seed 0) until a request is
    admitted into the row."""
    return dict(SamplingParams.full(max_bs, device=device)._asdict())


def check_sampling_params(temperature: float, top_k: int, top_p: float,
                          seed: Optional[int] = None) -> None:
    """Host-side range check (a request's boundary): ``ValueError`` naming the argument."""
    if (not isinstance(temperature, (int, float)) or isinstance(temperature, bool)
            or not 0.0 <= temperature < float("inf")):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), "
                         f"got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k < 2 ** 63:
        raise ValueError(f"top_k must be an int in [0, 2**63) (0 = off), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not -2 ** 63 <= seed < 2 ** 63):
        raise ValueError(f"seed must be an int in [-2**63, 2**63), got {seed!r}")


# ------------------------------------------------------------------ distribution
def min_temperature(dtype: torch.dtype) -> float:
    """The smallest temperature sampled as given in a computation of ``dtype``
    (float32 for half-precision and float32 logits, float64 for float64): the
    smallest normal number, about 1.2e-38 and 2.2e-308. Below it a row is
    decoded greedily, the limit of sampling as the temperature goes to 0;
    above it the division is safe (`filtered_probs` divides logits shifted
    by their maximum, which stay <= 0)."""
    return torch.finfo(dtype).tiny


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """The target's sampling distribution per row: temperature, then top-k, then top-p.

    Args:
        logits: ``[B, ..., V]`` (any float dtype).
        temperature, top_k, top_p: ``[B]`` (see `SamplingParams`).

    Returns:
        Probabilities ``[B, ..., V]`` in float32 (float64 for float64 logits),
        each row summing to 1. A row with ``temperature == 0``, or below
        `min_temperature` of the computation's dtype, is the one-hot of
        ``logits.argmax(-1)`` (the first maximum), whatever its top-k/top-p.

    Semantics (ties at a cut are kept, as Hugging Face's warpers keep them):
    top-k keeps the tokens whose tempered logit is ``>=`` the k-th largest;
    top-p then keeps, of the top-k distribution sorted by probability, the
    shortest prefix whose mass reaches ``top_p`` (token ``j`` is kept while
    the mass before it is ``< top_p``; the first token always), plus ties of
    its last logit; ``top_p >= 1`` keeps all. One sort over the vocabulary
    per row; no data-dependent shape.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    v = logits.shape[-1]
    view = (-1,) + (1,) * (logits.dim() - 1)
    t = temperature.to(dtype).view(view)
    greedy = t < min_temperature(dtype)
    x = logits.to(dtype)
    # Shifted by the row's maximum before the division, so a small temperature
    # sends the other logits towards -inf instead of the largest one to +inf.
    z = (x - x.amax(-1, keepdim=True)) / torch.where(greedy, 1.0, t)
    k = top_k.view(view)
    k = torch.where((k <= 0) | (k > v), v, k)
    p_cut = top_p.to(dtype).view(view)
    s = torch.sort(z, dim=-1, descending=True).values
    rank = torch.arange(v, device=logits.device)
    in_k = rank < k
    ps = torch.softmax(torch.where(in_k, s, float("-inf")), dim=-1)
    before = vocab_cumsum(ps) - ps
    keep = in_k & ((before < p_cut) | (p_cut >= 1) | (rank == 0))
    cutoff = s.gather(-1, keep.sum(-1, keepdim=True) - 1)  # the last kept logit
    probs = torch.softmax(torch.where(z >= cutoff, z, float("-inf")), dim=-1)
    one_hot = (rank == vocab_argmax(logits).unsqueeze(-1)).to(dtype)
    return torch.where(greedy, one_hot, probs)


# ------------------------------------------------------------------- randomness
def _mulhilo32(x: torch.Tensor, m: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` 32-bit words of ``x * m`` for int64 ``x`` in ``[0, 2^32)``: the
    constant is split in 16-bit halves so that no intermediate reaches 2^50."""
    a = x * (m & _M16)  # < 2^48
    b = x * (m >> 16)  # < 2^48; the product is a + b * 2^16
    low = a + ((b & _M16) << 16)  # < 2^49
    return (b >> 16) + (low >> 32), low & _M32


def philox4x32(counter: Tuple[torch.Tensor, ...], key: Tuple[torch.Tensor, torch.Tensor],
               rounds: int = _PHILOX_ROUNDS) -> Tuple[torch.Tensor, ...]:
    """Philox4x32-``rounds`` on int64 tensors holding 32-bit words (broadcasting).

    ``counter``: four words, ``key``: two words, each int64 in ``[0, 2^32)``;
    returns the four output words. Matches Random123's known-answer vectors
    (tested).
    """
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0 = (k0 + _PHILOX_W[0]) & _M32
            k1 = (k1 + _PHILOX_W[1]) & _M32
        hi0, lo0 = _mulhilo32(c0, _PHILOX_M[0])
        hi1, lo1 = _mulhilo32(c2, _PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def uniforms(seed: torch.Tensor, counter: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
    """Float64 uniforms in ``[0, 1)`` keyed by ``(seed, counter, stream)`` (broadcasting).

    ``seed``: int64 (all 64 bits are the Philox key); ``counter``: int64 >= 0
    (the low 64 bits are used); ``stream``: int64 in ``[0, 2^32)``. The same
    key gives the same value anywhere (any batch row, eager or compiled, CPU
    or CUDA). 53 bits: 27 from the first output word, 26 from the second.
    """
    words = lambda x: (x & _M32, (x >> 32) & _M32)  # noqa: E731  (arithmetic >> masked)
    c_lo, c_hi = words(counter)
    s_lo, s_hi = words(seed)
    stream = stream & _M32
    zero = torch.zeros_like(stream)
    out = philox4x32((c_lo, c_hi, stream, zero), (s_lo, s_hi))
    bits = ((out[0] >> 5) << 26) | (out[1] >> 6)  # 53 bits
    return bits.to(torch.float64) * (2.0 ** -53)


# ----------------------------------------------------------------- draws, walk
def sample_categorical(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw ``[B]`` from unnormalised ``weights [B, V] >= 0`` with ``u [B]``.

    Returns the token ``j`` with ``cdf[j-1] <= u * total < cdf[j]``: never a
    zero-weight token (clamped to the last positive one against rounding). A
    row of zero total weight gives its argmax (0): callers never produce one
    in exact arithmetic.
    """
    cdf = vocab_cumsum(weights)
    threshold = u.unsqueeze(-1) * cdf[..., -1:]
    drawn = (cdf <= threshold).sum(-1)
    rank = torch.arange(weights.shape[-1], device=weights.device)
    last_positive = torch.where(weights > 0, rank, 0).amax(-1)
    return torch.minimum(drawn, last_positive)


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  counter: torch.Tensor) -> torch.Tensor:
    """One token per row from ``logits [B, V]`` (the prefill's first token).

    Greedy rows (``temperature == 0``) get ``logits.argmax(-1)`` exactly; the
    others a draw from `filtered_probs` with the uniform of
    ``(seed, counter, FINAL_STREAM)``.
    """
    probs = filtered_probs(logits, params.temperature, params.top_k, params.top_p)
    u = uniforms(params.seed, counter, torch.full_like(counter, FINAL_STREAM))
    drawn = sample_categorical(probs, u)
    return torch.where(params.temperature > 0, drawn, vocab_argmax(logits))


def walk_tree(parents: torch.Tensor, live: torch.Tensor, max_depth: int, accepted_child
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Walk down a draft tree from the root, ``max_depth`` steps at most.

    ``accepted_child(cur [B], child [B, N]) -> [B, N]`` marks, among the
    children of the current node (``child``), those accepted; the walk moves
    to the first one and stops where none is. The greedy walk (the child
    whose token is the target's argmax) and the sampled one differ only in
    it. Returns ``path [B, D + 1]`` (entries past the accepted depth repeat
    the last node) and ``accepted [B]`` (0 on rows that are not ``live``).
    """
    cur = torch.zeros(parents.shape[0], dtype=torch.int64, device=parents.device)
    going = live
    accepted = torch.zeros_like(cur)
    nodes = [cur]
    for _ in range(max_depth):
        hit = accepted_child(cur, parents == cur.unsqueeze(1))
        found = hit.any(-1) & going
        cur = torch.where(found, hit.int().argmax(-1), cur)
        accepted = accepted + found.long()
        going = found
        nodes.append(cur)
    return torch.stack(nodes, 1), torch.where(live, accepted, 0)


def speculative_walk(probs: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                     live: torch.Tensor, u: torch.Tensor, max_depth: int):
    """Recursive rejection sampling down a tree of point-mass drafts (module docstring).

    Args:
        probs: ``[B, N, V]`` the target's sampling distribution at each node.
        tokens: int64 ``[B, N]`` node tokens (node 0: the root).
        parents: int64 ``[B, N]`` parent node (``-1`` at the root; parents
            precede children).
        live: bool ``[B]`` (padding rows accept nothing).
        u: float64 ``[B, N]``: ``u[:, j]`` the accept coin of node ``j``
            (``j >= 1``), ``u[:, 0]`` the final draw's uniform.
        max_depth: static bound of the accepted path.

    Returns:
        ``(path [B, D+1], accepted [B], token [B])`` as the greedy walk
        gives them: ``path[:, i]`` the accepted node at depth ``i`` (repeating
        the last past ``accepted``), and the emitted token after the path,
        drawn at its last node from the residual (its rejected children
        removed). Coin ``j`` decides node ``j`` when it is tried:
        ``u_j * sum(r) < r(x_j)``, which is how "accept with probability
        ``r(x_j) / sum(r)``" reads with one uniform.

    Vectorised per depth: child ``j`` is reached only if every earlier
    sibling was rejected, so the mass of ``r`` when ``j`` is tried is
    ``sum(p)`` minus the earlier siblings' ``p`` (an exclusive cumsum), and the
    accepted child is the first whose coin accepts. A token tried twice at a
    node (never in an EAGLE tree) has ``r = 0`` the second time.
    """
    bs, n, v = probs.shape
    flat = probs.reshape(bs, n * v)
    node = torch.arange(n, device=tokens.device)
    tok = tokens.clamp(0, v - 1)
    earlier = node.view(1, n, 1) > node.view(1, 1, n)  # [1, j, i]: i before j
    same = (tok.unsqueeze(2) == tok.unsqueeze(1)) & earlier  # [B, j, i]
    mass = probs.sum(-1)  # [B, N], 1 up to rounding

    def accepted_child(cur, child):
        p = flat.gather(1, cur.unsqueeze(1) * v + tok)  # p_cur(x_j)
        tried_before = (same & child.unsqueeze(1)).any(-1)
        p = torch.where(child & ~tried_before, p, 0)
        left = mass.gather(1, cur.unsqueeze(1)) - (torch.cumsum(p, dim=1) - p)
        return child & (u * left < p)

    path, accepted = walk_tree(parents, live, max_depth, accepted_child)
    last = path.gather(1, accepted.unsqueeze(1))  # [B, 1]
    # Residual at the last node: every child of it was tried and rejected (or it has none).
    residual = probs.gather(1, last.unsqueeze(-1).expand(bs, 1, v)).squeeze(1)
    rejected = torch.where(parents == last, tok, v)  # v: a dummy column
    residual = torch.nn.functional.pad(residual, (0, 1)).scatter(1, rejected, 0.0)[:, :v]
    return path, accepted, sample_categorical(residual, u[:, FINAL_STREAM])


def sample_tree(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                live: torch.Tensor, params: SamplingParams, counter: torch.Tensor,
                max_depth: int):
    """`speculative_walk` on the verify logits ``[B, N, V]``: the filtered
    distributions per node, and the uniforms of ``(seed, counter, node)``
    (``counter``: int64 ``[B]``, tokens the request has emitted so far).

    Greedy rows come out as the greedy walk's (a one-hot ``p`` accepts its
    argmax child with ``u < 1`` and rejects the rest with ``u >= 0``); the
    loop still selects its own argmax walk for them (`choose_rows`).
    """
    probs = filtered_probs(logits, params.temperature, params.top_k, params.top_p)
    stream = torch.arange(tokens.shape[1], device=tokens.device)
    u = uniforms(params.seed.unsqueeze(1), counter.unsqueeze(1), stream.unsqueeze(0))
    return speculative_walk(probs, tokens, parents, live, u, max_depth)


def choose_rows(rows: torch.Tensor, when_true: tuple, when_false: tuple) -> tuple:
    """Per row ``b``: ``when_true`` where ``rows[b]``, else ``when_false``
    (tuples of ``[B, ...]`` tensors, element by element)."""
    out = []
    for a, b in zip(when_true, when_false):
        out.append(torch.where(rows.view((-1,) + (1,) * (a.dim() - 1)), a, b))
    return tuple(out)
