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

__all__ = ["AcceptanceHook", "scripted_acceptance"]


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
