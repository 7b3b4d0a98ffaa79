"""The engine's running statistics: bounded aggregates, the same size after a
million iterations as after one.

`EngineStats` is what `fa3_spec.eagle.EagleEngine.stats` holds and what the
CLI, the benchmarks and acceptance studies read:

* counts: iterations launched, requests admitted, finished and failed,
  request iterations read back (``row_iterations``), the tokens they
  accepted (``accepted``: accepted drafts plus the bonus token, as the tree
  was accepted) and the tokens they emitted (``tokens``: after EOS and
  ``max_new_tokens`` cut a request's last iteration);
* ``accept_hist[a]``: request iterations that accepted ``a`` tokens;
* per draft depth ``d >= 1`` and sibling rank ``r`` (a node's place among its
  parent's children in the tree, 0 the one the draft scored highest):
  ``offered[d, r]``, how often the accepted path reached the parent of such a
  node (depth ``d - 1``), and ``taken[d, r]``, how often it then went on
  through that node. ``taken / offered`` is the conditional acceptance rate an
  acceptance profile needs (`acceptance_rates`);
* host seconds spent launching iterations and from each launch to reading its
  results back.

Host syncs are counted by `fa3_spec.eagle.sync_probe.HostSyncProbe`, which
wraps an engine from outside. A request's own accept lengths live with the
request until the caller collects it (`EagleEngine.pop_results`).
"""

from __future__ import annotations

import dataclasses
from typing import Dict

import torch

__all__ = ["EngineStats", "sibling_ranks"]


def sibling_ranks(parents: torch.Tensor) -> torch.Tensor:
    """int64 ``[B, N]``: each node's rank among its siblings in draft trees
    given by ``parents [B, N]`` (``-1`` at the root, parents before children).

    It counts the earlier nodes with the same parent: nodes are in candidate
    order, which lists each parent's children best-scored first, so 0 is the
    child the draft scored highest.
    """
    n = parents.shape[1]
    same = parents.unsqueeze(2) == parents.unsqueeze(1)  # [B, c, c']
    earlier = torch.ones(n, n, dtype=torch.bool, device=parents.device).tril(-1)
    return (same & earlier).sum(-1)


@dataclasses.dataclass
class EngineStats:
    """Running aggregates of one engine (see the module docstring).

    ``max_depth`` (the loop's ``D``) and ``topk`` size the tables:
    ``accept_hist`` ``[D + 2]``, ``offered`` and ``taken`` ``[D + 1, topk]``
    (row 0 unused: the root is never drafted).
    """

    max_depth: int
    topk: int
    iterations: int = 0
    admitted: int = 0
    finished: int = 0
    failed: int = 0
    row_iterations: int = 0
    accepted: int = 0
    tokens: int = 0
    launch_seconds: float = 0.0
    readback_seconds: float = 0.0
    readbacks: int = 0
    accept_hist: torch.Tensor = None
    offered: torch.Tensor = None
    taken: torch.Tensor = None

    def __post_init__(self):
        self.accept_hist = torch.zeros(self.max_depth + 2, dtype=torch.int64)
        self.offered = torch.zeros(self.max_depth + 1, self.topk, dtype=torch.int64)
        self.taken = torch.zeros(self.max_depth + 1, self.topk, dtype=torch.int64)

    @property
    def mean_accept_len(self) -> float:
        """Tokens accepted per request iteration, the speculative speed-up's
        numerator (0.0 before any)."""
        return self.accepted / self.row_iterations if self.row_iterations else 0.0

    @property
    def max_accept_len(self) -> int:
        """The most tokens one request iteration accepted (0 before any)."""
        seen = self.accept_hist.nonzero()
        return int(seen[-1]) if len(seen) else 0

    def record(self, accept_len: torch.Tensor, parents: torch.Tensor, path: torch.Tensor,
               emitted: int) -> None:
        """Add one read-back iteration: host tensors ``accept_len [B]`` (accepted
        drafts + 1; 0 on padding rows), ``parents [B, N]`` and ``path [B, D + 1]``,
        and the ``emitted`` tokens its rows added to their outputs.

        The accepted depth is read off ``path`` (node ids grow along a path;
        entries past it repeat the last node), the same as ``accept_len - 1``.
        """
        self.tokens += emitted
        live = accept_len > 0
        if not bool(live.any()):
            return
        lens = accept_len[live]
        self.row_iterations += int(lens.numel())
        self.accepted += int(lens.sum())
        self.accept_hist += torch.bincount(lens.clamp(max=self.max_depth + 1),
                                           minlength=self.max_depth + 2)
        parents, path = parents[live], path[live]
        rank = sibling_ranks(parents).clamp(max=self.topk - 1)
        nodes = torch.arange(parents.shape[1]).unsqueeze(0)
        steps = path[:, 1:] > path[:, :-1]  # [b, D]: depth i + 1 was reached
        accepted = steps.long().cumprod(1).sum(1)  # [b]
        for d in range(1, self.max_depth + 1):
            at_parent = accepted >= d - 1  # the path reached depth d - 1
            parent = path[:, d - 1]
            offered = (parents == parent.unsqueeze(1)) & at_parent.unsqueeze(1)  # [b, N]
            went = path[:, d].unsqueeze(1) == nodes
            taken = offered & went & (accepted >= d).unsqueeze(1)
            self.offered[d] += torch.bincount(rank[offered], minlength=self.topk)
            self.taken[d] += torch.bincount(rank[taken], minlength=self.topk)

    def acceptance_rates(self) -> torch.Tensor:
        """float64 ``[D + 1, topk]``: ``taken / offered`` per depth and sibling
        rank (NaN where nothing was offered; row 0 is NaN)."""
        offered = self.offered.double()
        return torch.where(offered > 0, self.taken.double() / offered.clamp(min=1),
                           float("nan"))

    def as_dict(self) -> Dict[str, object]:
        """Plain numbers and lists, for JSON."""
        rates = self.acceptance_rates()
        return dict(iterations=self.iterations, admitted=self.admitted, finished=self.finished,
                    failed=self.failed, row_iterations=self.row_iterations,
                    accepted=self.accepted, tokens=self.tokens,
                    mean_accept_len=round(self.mean_accept_len, 4),
                    accept_hist=self.accept_hist.tolist(),  # ok-host: host tensors
                    offered=self.offered.tolist(), taken=self.taken.tolist(),  # ok-host
                    acceptance_rates=[[None if r != r else round(r, 4) for r in row]
                                      for row in rates.tolist()],  # ok-host
                    launch_seconds=self.launch_seconds, readback_seconds=self.readback_seconds,
                    readbacks=self.readbacks)
