"""Which tree shape each batch bucket should run: an acceptance profile, the
expected accepted length of any shape under it, and a cost model.

An **acceptance profile** holds ``rates[d - 1][r]``: the chance that the
accepted path goes on through a draft node at depth ``d`` with sibling rank
``r`` once it has reached that node's parent, exactly as `EngineStats`
counts it (``taken / offered``). Under greedy verification at most one child
of a node is accepted, so a node's chance of being accepted is the product of
the rates along its path, and a tree's expected accepted length (the bonus
token included) is one plus the sum of those products over its drafted nodes.

The tree a shape ``(topk, num_steps, num_draft_tokens)`` drafts is modelled
as the engine builds it (docs/eagle.md): the root's ``topk`` children;
then, per step, the ``topk`` best of that step's children each grow ``topk``
children; finally the ``num_draft_tokens - 1`` best of all drafted
nodes are verified. "Best" is the draft's cumulative score, which the model
takes to order nodes as their acceptance chances do (a calibrated draft),
with each rank's rate capped by the ranks above it (`drafted_tree`).

A **cost profile** holds measured milliseconds per iteration of each
candidate shape, and of one plain decode step, per batch bucket. The policy
picks, per bucket, the shape with the most expected tokens per second, or
plain decoding (``None``) when no shape beats it; with ``max_shapes``, the
best such choice that uses at most that many shapes over all the buckets
(each is compiled and captured of its own).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import math
import pathlib
import re
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["AcceptanceProfile", "BucketChoice", "CostProfile", "Shape", "choose_shapes",
           "expected_accept_length", "parse_shape_key", "shape_key"]

#: ``(topk, num_steps, num_draft_tokens)``.
Shape = Tuple[int, int, int]


def shape_key(shape: Shape) -> str:
    """``"topk,steps,N"``, the key of a shape in JSON files."""
    return ",".join(str(v) for v in shape)


#: A shape key as `shape_key` writes it: three decimal ints, no signs, spaces
#: or leading zeros, so that no two keys name one shape.
_SHAPE_KEY = re.compile(r"[1-9][0-9]*,[1-9][0-9]*,[1-9][0-9]*")


def parse_shape_key(key: str) -> Shape:
    """The shape `shape_key` wrote as ``key``, checked to be a tree that
    ``num_steps`` steps of ``topk`` can draft (`ValueError` otherwise)."""
    if not isinstance(key, str):
        raise TypeError(f"a shape key is a str 'topk,steps,N', got {key!r}")
    if not _SHAPE_KEY.fullmatch(key):
        raise ValueError(f"a shape key is 'topk,steps,N' of decimal ints >= 1 as "
                         f"`shape_key` writes it, got {key!r}")
    return _check_shape(tuple(int(v) for v in key.split(",")))


def check_shape_ints(shape, name: str = "shape") -> Shape:
    """``shape`` as a tuple of three ints >= 1 (`ValueError` naming ``name``
    otherwise); whether such a tree can be drafted is `LoopConfig`'s check."""
    if (not isinstance(shape, (tuple, list)) or len(shape) != 3
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in shape)):
        raise ValueError(f"{name} must be (topk, num_steps, num_draft_tokens) of ints >= 1, "
                         f"got {shape!r}")
    return tuple(shape)


def _check_shape(shape) -> Shape:
    k, s, n = check_shape_ints(shape)
    if n < 2:
        raise ValueError(f"shape {shape!r}: num_draft_tokens must be >= 2 (the root and a draft)")
    if n - 1 > k + (s - 1) * k * k:
        raise ValueError(f"shape {shape!r}: {s} steps of topk {k} draft "
                         f"{k + (s - 1) * k * k} nodes, fewer than num_draft_tokens - 1 = {n - 1}")
    return (k, s, n)


@dataclasses.dataclass(frozen=True)
class AcceptanceProfile:
    """``rates[d - 1][r]`` in [0, 1]: depth ``d >= 1``, sibling rank ``r``
    (module docstring), each row summing to at most 1 since at most one
    child of a node is accepted. A depth or rank past the table has rate 0:
    what the engine never saw is not counted on (a chain's profile says
    nothing of a second sibling)."""

    rates: Tuple[Tuple[float, ...], ...]

    def __post_init__(self):
        rows = self.rates
        if not isinstance(rows, (tuple, list)) or not rows:
            raise ValueError("rates must be a non-empty list of rows, one per depth")
        width = None
        clean = []
        for d, row in enumerate(rows, 1):
            if not isinstance(row, (tuple, list)) or not row:
                raise ValueError(f"rates[{d - 1}] must be a non-empty list, one rate per rank")
            if width is not None and len(row) != width:
                raise ValueError(f"rates[{d - 1}] has {len(row)} ranks, rates[0] has {width}")
            width = len(row)
            for r, v in enumerate(row):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                    raise ValueError(f"rates[{d - 1}][{r}] must be a number in [0, 1], got {v!r}")
            if math.fsum(row) > 1 + 1e-9:
                raise ValueError(f"rates[{d - 1}] sums to {math.fsum(row):.4g} > 1: at most one "
                                 "child of a node is accepted")
            clean.append(tuple(float(v) for v in row))
        object.__setattr__(self, "rates", tuple(clean))

    def rate(self, depth: int, rank: int) -> float:
        """``rates[depth - 1][rank]``, 0 past the table; ``depth >= 1`` and
        ``rank >= 0`` (`ValueError` otherwise: a negative index must not wrap)."""
        if (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1
                or isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ValueError(f"rate: depth must be an int >= 1 and rank an int >= 0, "
                             f"got depth={depth!r}, rank={rank!r}")
        if depth > len(self.rates) or rank >= len(self.rates[0]):
            return 0.0
        return self.rates[depth - 1][rank]

    @classmethod
    def from_stats(cls, stats, *, default: float = 0.0) -> "AcceptanceProfile":
        """The profile an engine measured (`EngineStats`): ``taken / offered``
        per depth and rank, ``default`` where nothing was offered. Ranks are
        offered on different iterations (the verified tree keeps the best
        nodes), so a row of counted rates can sum above 1, the most that
        siblings can accept; each rank is then capped at what the ranks above
        it leave, so that rank 0, offered whenever its parent was reached,
        keeps the rate the engine counted (a chain's profile is exactly its
        counts)."""
        rows = []
        for d in range(1, stats.offered.shape[0]):
            offered, taken = stats.offered[d].tolist(), stats.taken[d].tolist()  # ok-host
            row, left = [], 1.0
            for t, o in zip(taken, offered):
                rate = min(t / o if o else default, max(left, 0.0))
                row.append(rate)
                left -= rate
            rows.append(row)
        return cls(tuple(map(tuple, rows)))

    @classmethod
    def load(cls, path) -> "AcceptanceProfile":
        """From a JSON file ``{"rates": [[...], ...]}``; None rates (nothing
        offered, as `EngineStats.as_dict` writes them) are refused by name."""
        p = pathlib.Path(path)
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{p}: not a readable JSON file ({exc})") from None
        if not isinstance(doc, dict) or "rates" not in doc:
            raise ValueError(f"{p}: expected an object with 'rates'")
        if not isinstance(doc["rates"], list):
            raise ValueError(f"{p}: 'rates' must be a list of rows, one per depth, "
                             f"got {doc['rates']!r}")
        try:
            return cls(tuple(tuple(row) if isinstance(row, list) else row
                             for row in doc["rates"]))
        except ValueError as exc:
            raise ValueError(f"{p}: {exc}") from None

    def save(self, path) -> None:
        pathlib.Path(path).write_text(json.dumps(dict(rates=[list(r) for r in self.rates])))


def drafted_tree(shape: Shape, profile: AcceptanceProfile) -> List[Tuple[int, int, float]]:
    """The ``num_draft_tokens - 1`` nodes the model of the module docstring
    verifies, as ``(depth, rank, chance of acceptance)``, highest score first.

    Nodes are ordered by a score that stands in for the draft's: the product
    along the path of each rank's rate capped by the rates of the ranks above
    it. Rank is the draft's own order of siblings, so a counted row whose
    rates rise with rank (sampling noise) must not put a sibling ahead of a
    better-scored one: the engine never verifies a rank-1 child without its
    rank-0 sibling. The chance of acceptance is the uncapped product."""
    _check_profile(profile)
    k, s, n = _check_shape(shape)
    capped = {d: list(itertools.accumulate((profile.rate(d, r) for r in range(k)), min))
              for d in range(1, s + 1)}
    # A node is (score, chance, depth, rank); beams are the best k children of a step.
    beams = [(capped[1][r], profile.rate(1, r), 1, r) for r in range(k)]
    drafted = list(beams)
    for depth in range(2, s + 1):
        children = [(score * capped[depth][r], chance * profile.rate(depth, r), depth, r)
                    for score, chance, _, _ in beams for r in range(k)]
        drafted += children
        beams = heapq.nlargest(k, children, key=lambda c: c[0])
    # Ties resolve shallow first, then by rank: a parent never ranks below its child.
    best = sorted(drafted, key=lambda c: (-c[0], c[2], c[3]))[: n - 1]
    return [(depth, rank, chance) for _, chance, depth, rank in best]


def _check_profile(profile) -> None:
    if not isinstance(profile, AcceptanceProfile):
        raise TypeError(f"profile must be an AcceptanceProfile, got {type(profile).__name__}")


def expected_accept_length(shape: Shape, profile: AcceptanceProfile) -> float:
    """Expected tokens a request accepts per iteration with ``shape``: one (the
    target's own token) plus each verified node's chance of acceptance."""
    return 1.0 + math.fsum(chance for _, _, chance in drafted_tree(shape, profile))


@dataclasses.dataclass(frozen=True)
class CostProfile:
    """Measured ms per iteration: ``plain[bucket]`` for one plain decode step,
    ``shapes[bucket][shape_key]`` for each candidate shape's iteration, on one
    machine and model (``device``, ``model``: what they were measured on)."""

    plain: Dict[int, float]
    shapes: Dict[int, Dict[str, float]]
    device: str = ""
    model: str = ""

    def __post_init__(self):
        for name, table in (("plain", self.plain), ("shapes", self.shapes)):
            if not isinstance(table, dict) or not table:
                raise ValueError(f"{name} must be a non-empty dict keyed by batch bucket")
            for b in table:
                if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                    raise ValueError(f"{name}: bucket {b!r} is not an int >= 1")
        for b, ms in self.plain.items():
            if not _positive_ms(ms):
                raise ValueError(f"plain[{b}] must be a finite number of ms > 0, got {ms!r}")
        for name in ("device", "model"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, got {getattr(self, name)!r}")
        for b, row in self.shapes.items():
            if b not in self.plain:
                raise ValueError(f"shapes[{b}]: no plain[{b}] to compare with")
            if not isinstance(row, dict):
                raise TypeError(f"shapes[{b}] must be a dict of 'topk,steps,N' -> ms, "
                                f"got {type(row).__name__}")
            for key, ms in row.items():
                if not isinstance(key, str):
                    raise TypeError(f"shapes[{b}]: shape key {key!r} must be a str "
                                    "'topk,steps,N' (`shape_key`)")
                try:  # keys are written one way only, so no two of them name one shape
                    parse_shape_key(key)
                except ValueError as exc:
                    raise ValueError(f"shapes[{b}]: {exc}") from None
                if not _positive_ms(ms):
                    raise ValueError(f"shapes[{b}][{key!r}] must be a finite number of ms > 0, "
                                     f"got {ms!r}")

    @classmethod
    def load(cls, path) -> "CostProfile":
        p = pathlib.Path(path)
        try:
            doc = json.loads(p.read_text())
            return cls(plain=_bucket_keys("plain", doc["plain"]),
                       shapes=_bucket_keys("shapes", doc["shapes"]),
                       device=doc.get("device", ""), model=doc.get("model", ""))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{p}: not a cost profile ({exc})") from None

    def save(self, path) -> None:
        pathlib.Path(path).write_text(json.dumps(dict(
            device=self.device, model=self.model,
            plain={str(b): v for b, v in self.plain.items()},
            shapes={str(b): row for b, row in self.shapes.items()}), indent=1))


def _bucket_keys(name: str, table) -> dict:
    """A JSON table's ``"bucket"`` string keys as ints, written as `save`
    writes them ("8", not "08" or "8.0"), so no two keys name one bucket."""
    if not isinstance(table, dict):
        raise ValueError(f"{name} must be an object keyed by batch bucket")
    out = {}
    for key, v in table.items():
        if not (key.isascii() and key.isdigit()) or str(int(key)) != key:
            raise ValueError(f"{name}: bucket key {key!r} is not a decimal int like \"8\"")
        out[int(key)] = v
    return out


def _positive_ms(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v < math.inf


@dataclasses.dataclass(frozen=True)
class BucketChoice:
    """A bucket's shape (None: plain decoding), its expected accepted length
    and tokens/s per row, and plain decoding's tokens/s per row beside it."""

    bucket: int
    shape: Optional[Shape]
    expected_accept_length: float
    tokens_per_s: float
    plain_tokens_per_s: float

    @property
    def speedup(self) -> float:
        return self.tokens_per_s / self.plain_tokens_per_s


#: The most candidate sets `choose_shapes` weighs under ``max_shapes``.
_MAX_SHAPE_SETS = 200_000


def choose_shapes(costs: CostProfile, profile: AcceptanceProfile,
                  buckets: Optional[Sequence[int]] = None, *,
                  max_shapes: Optional[int] = None) -> Dict[int, BucketChoice]:
    """Per bucket (default: every bucket of ``costs``), the measured shape with
    the most expected tokens/s per row, ``E[accept] / ms``, or plain decoding
    when none beats ``1 / plain ms``. Ties keep the smaller shape.

    ``max_shapes`` bounds what the engine compiles and captures: each shape
    chosen is a step of its own (plain decoding counts as one), so at most
    ``max_shapes`` distinct choices over all the buckets. Among the sets of at
    most that many candidates, the one whose per-bucket best has the largest
    sum of ``log(speedup)`` wins (every bucket weighs alike, whatever its
    absolute tokens/s), fewer shapes on a tie; a set that leaves some bucket
    no option (plain decoding, or a shape the profile has for that bucket) is
    ruled out."""
    if not isinstance(costs, CostProfile):
        raise TypeError(f"costs must be a CostProfile, got {type(costs).__name__}")
    _check_profile(profile)
    bucket_list = list(buckets) if buckets is not None else sorted(costs.plain)
    for b in bucket_list:
        if isinstance(b, bool) or not isinstance(b, int):
            raise TypeError(f"buckets: {b!r} is not an int batch bucket")
        if b not in costs.plain:
            raise ValueError(f"buckets: {b} has no measured plain decode step in the profile")
    if max_shapes is not None and (isinstance(max_shapes, bool) or not isinstance(max_shapes, int)
                                   or max_shapes < 1):
        raise ValueError(f"max_shapes must be an int >= 1 or None, got {max_shapes!r}")
    # Every (bucket, candidate) once: candidate None is plain decoding.
    options: Dict[int, List[BucketChoice]] = {}
    for b in bucket_list:
        plain = 1e3 / costs.plain[b]
        row = [BucketChoice(b, None, 1.0, plain, plain)]
        row_costs = ((parse_shape_key(key), ms) for key, ms in costs.shapes.get(b, {}).items())
        for shape, ms in sorted(row_costs, key=lambda shape_ms: shape_ms[0][::-1]):
            e = expected_accept_length(shape, profile)
            row.append(BucketChoice(b, shape, e, 1e3 * e / ms, plain))
        options[b] = row

    def best_within(allowed) -> Optional[Dict[int, BucketChoice]]:
        chosen = {}
        for b, row in options.items():
            best = None  # the first (smallest) of the fastest allowed options
            for c in row:
                if c.shape in allowed and (best is None or c.tokens_per_s > best.tokens_per_s):
                    best = c
            if best is None:
                return None
            chosen[b] = best
        return chosen

    everything = {c.shape for row in options.values() for c in row}
    unbounded = best_within(everything)
    if max_shapes is None or not bucket_list:
        return unbounded
    used = len({c.shape for c in unbounded.values()})
    if max_shapes >= used:
        # The unbounded score is reachable, and only by sets that give each
        # bucket one of its best options: weigh just those, for fewer shapes.
        everything = {c.shape for b, row in options.items() for c in row
                      if c.tokens_per_s == unbounded[b].tokens_per_s}
    candidates = sorted(everything, key=lambda s: (0,) if s is None else (1, *s[::-1]))
    # The unbounded choice is the best of all; sets larger than it never score higher.
    size = min(max_shapes, used)
    sets = sum(math.comb(len(candidates), k) for k in range(1, size + 1))
    if sets > _MAX_SHAPE_SETS:
        raise ValueError(f"max_shapes={max_shapes} leaves {sets} sets of the {len(candidates)} "
                         f"candidates to weigh, more than {_MAX_SHAPE_SETS}: measure fewer "
                         "candidate shapes or lower max_shapes")
    best, best_score = None, -math.inf
    for k in range(1, size + 1):
        for allowed in itertools.combinations(candidates, k):
            chosen = best_within(set(allowed))
            if chosen is None:
                continue
            score = math.fsum(math.log(c.speedup) for c in chosen.values())
            if score > best_score:  # strictly: a set of fewer shapes keeps a tie
                best, best_score = chosen, score
    return best
