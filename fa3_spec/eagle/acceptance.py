"""Acceptance hooks: which draft nodes an iteration accepts, decided by something
other than the target (benchmarks and studies of tree shapes).

By default the target decides: the greedy walk takes the child whose token is
its argmax, and sampled rows take the lossless walk. A hook replaces that
decision for every row and keeps the rest of the iteration unchanged (the same
verify, commit and extend, the bonus token still the target's argmax at the
last accepted node), so timing a hooked loop times the real work. Its output
is not the model's, and every result produced with a hook must say so.

A hook is ``hook(tokens, parents, live, iters, max_depth) -> (path, accepted)``:

* ``tokens``, ``parents``: int64 ``[B, N]`` the draft tree (node 0 the root,
  ``parents[:, 0] = -1``, parents precede children);
* ``live``: bool ``[B]``; ``iters``: int64 ``[B]`` iterations run per row;
* ``max_depth``: static bound ``D`` of the accepted path;
* returns ``path`` int64 ``[B, D + 1]`` (``path[:, i]`` the node at depth ``i``
  for ``i <= accepted``, repeated after) and ``accepted`` int64 ``[B]``.

It runs inside the captured iteration: pure tensor code, no host syncs.
"""

from __future__ import annotations

from typing import Callable, Sequence, Tuple

import torch

AcceptanceHook = Callable[..., Tuple[torch.Tensor, torch.Tensor]]

__all__ = ["AcceptanceHook", "profile_acceptance", "scripted_acceptance"]


def scripted_acceptance(emitted: Sequence[int]) -> AcceptanceHook:
    """A hook that emits ``emitted[i % len(emitted)]`` tokens (accepted drafts + the
    bonus) at a row's ``i``-th iteration, along nodes ``0 .. a`` of the tree (the
    first ``a`` draft nodes are a path in a chain; in a tree they are whatever
    those nodes are): every shape then does the same work per iteration.

    Raises `ValueError` naming ``emitted`` unless it is a non-empty sequence of
    ints >= 1.
    """
    script = tuple(emitted) if not isinstance(emitted, (str, bytes)) else ()
    if not script or any(isinstance(e, bool) or not isinstance(e, int) or e < 1 for e in script):
        raise ValueError(f"emitted must be a non-empty sequence of ints >= 1, got {emitted!r}")

    def hook(tokens, parents, live, iters, max_depth):
        turn = torch.remainder(iters, len(script))
        forced = torch.zeros_like(iters)
        for j, count in enumerate(script):  # no host-to-device copy (capturable)
            forced = torch.where(turn == j, count - 1, forced)
        accepted = torch.where(live, forced.clamp(0, max_depth), 0)
        i = torch.arange(max_depth + 1, device=tokens.device)
        return torch.minimum(i.unsqueeze(0), accepted.unsqueeze(1)), accepted

    hook.script = script
    return hook


def _uniform(seed: int, iters: torch.Tensor, root: torch.Tensor, depth: int) -> torch.Tensor:
    """float64 ``[B]`` in [0, 1): a counter-based hash of (seed, row, iteration,
    the row's root token, depth), so a captured graph draws without a
    generator's state or a sync, and requests that reuse a row draw anew."""
    row = torch.arange(iters.shape[0], device=iters.device, dtype=torch.int64)
    x = (iters * 1_000_003 + row * 7_919 + depth * 104_729 + root * 15_485_863
         + seed) & 0x7FFFFFFF
    for _ in range(3):  # a 31-bit integer mixer (xorshift-multiply)
        x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & 0x7FFFFFFF
        x = ((x ^ (x >> 12)) * 0x297A2D39) & 0x7FFFFFFF
    return x.double() / float(1 << 31)


def _profile_table(rates) -> tuple:
    """``rates`` checked as an acceptance profile (rows in [0, 1] summing to at
    most 1)."""
    from .policy import AcceptanceProfile

    return AcceptanceProfile(tuple(tuple(r) for r in rates) if rates else ()).rates


def profile_acceptance(rates: Sequence[Sequence[float]], seed: int = 0, *,
                       device=None) -> AcceptanceHook:
    """A hook that accepts the draft tree as a head with acceptance profile
    ``rates`` would (`fa3_spec.eagle.policy.AcceptanceProfile`): at each depth
    ``d`` the path goes on through the child of sibling rank ``r`` with chance
    ``rates[d - 1][r]`` (at most one child; ranks and depths past the table 0).
    A bigger tree then accepts more in expectation, as with a trained head,
    where a scripted count would make every shape alike. Draws are a hash of
    ``seed``, the row, its iteration, its root token and the depth:
    reproducible and capturable.

    By default the rates are constants of the compiled graph. With ``device``
    they live in a float64 ``[depths, ranks]`` tensor there (``hook.table``),
    which the graph reads at every launch, so ``hook.set_rates(other)`` swaps
    in another profile no deeper or wider than the first without a recompile
    or a recapture (one engine, several profiles).

    Raises `ValueError` naming ``rates`` or ``seed`` when they are not a
    non-empty table of numbers in [0, 1] whose rows sum to at most 1, and an int.
    """
    from .stats import sibling_ranks

    table = _profile_table(rates)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    depth, width = len(table), len(table[0])
    held = None if device is None else torch.tensor(table, dtype=torch.float64, device=device)

    def rates_at(d: int, child: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
        """float64 ``[B, N]``: each child's rate at depth ``d`` (0 elsewhere)."""
        rate = torch.zeros(child.shape, dtype=torch.float64, device=child.device)
        if d > depth:
            return rate
        if held is not None:  # a gather from the device table; the index clamped in range
            at = held[d - 1][rank.clamp(0, width - 1)]
            return torch.where(child & (rank < width), at, rate)
        for r in range(width):  # constants only: no host-to-device copy
            rate = torch.where(child & (rank == r), table[d - 1][r], rate)
        return rate

    def hook(tokens, parents, live, iters, max_depth):
        b, n = parents.shape
        rank = sibling_ranks(parents)
        node = torch.zeros(b, dtype=torch.int64, device=tokens.device)
        going = live.clone()
        accepted = torch.zeros_like(node)
        path = [node]
        for d in range(1, max_depth + 1):
            child = (parents == node.unsqueeze(1)) & going.unsqueeze(1)  # [B, N]
            rate = rates_at(d, child, rank)
            upper = rate.cumsum(1)  # siblings in rank order: disjoint intervals
            u = _uniform(seed, iters, tokens[:, 0], d).unsqueeze(1)
            hit = child & (u >= upper - rate) & (u < upper)
            took = hit.any(1)
            nxt = torch.where(took, hit.long().argmax(1), node)
            going = going & took
            accepted = accepted + going.long()
            node = torch.where(going, nxt, node)
            path.append(node)
        return torch.stack(path, 1), torch.where(live, accepted, 0)

    def set_rates(other: Sequence[Sequence[float]]) -> None:
        """Read ``other`` from the next launch on (``device`` hooks only; a
        host-to-device copy, so not while a graph is being captured)."""
        if held is None:
            raise ValueError("set_rates needs a hook made with device=: these rates are "
                             "constants of the compiled graph")
        new = _profile_table(other)
        if len(new) > depth or len(new[0]) > width:
            raise ValueError(f"rates of {len(new)} depths x {len(new[0])} ranks do not fit "
                             f"this hook's table of {depth} x {width}")
        padded = torch.zeros(depth, width, dtype=torch.float64)
        padded[: len(new), : len(new[0])] = torch.tensor(new, dtype=torch.float64)
        held.copy_(padded)
        hook.rates = new

    hook.rates = table
    hook.table = held
    hook.set_rates = set_rates
    return hook
