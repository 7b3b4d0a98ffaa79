"""A synthetic serving world for tests, notebooks and benchmarks.

`make_world` lays out what an engine would hold for one batch: a paged
``req_to_token`` whose physical pages are shuffled (page 0 is the reserved
dummy page, never allocated), draft slots allocated exactly as
docs/semantics.md prescribes, random draft trees (the verify tree, and the
draft steps' trees for ancestor semantics, on shuffled slots), and
accepted-token counts for draft extend. `fill_kv_cache` writes random keys/values, including the
copies of each prefix's partial last page into every branch's first page.

Host-side code (loops, host reads of tensor values) is fine here; nothing in this module
runs inside a builder or a captured step.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from ..builders import draft_ancestor_slots, draft_positions
from ..config import DRAFT_ATTENTION, SpecConfig, cdiv
from ..tree import tree_mask_from_parents


@dataclasses.dataclass
class World:
    """One batch of a synthetic engine (all tensors on one device).

    Attributes:
        cfg: the static configuration.
        req_to_token: int32 ``[max_reqs, cfg.draft_row_len]``.
        req_pool_indices: int64 ``[B]``.
        seq_lens: int64 ``[B]``; 0 marks padding rows.
        out_cache_loc: int64 ``[B * K * S]`` draft slots, ``[B, K, S]`` order.
        draft_positions: int64 ``[B, K, S]`` row positions of those slots.
        parents: int64 ``[B, N]`` draft tree (``-1`` at the root).
        tree_mask: bool ``[B, N, N]`` ancestor-or-self mask of ``parents``.
        extend_seq_lens: int64 ``[B]`` accepted tokens (included in seq_lens).
        num_pages: pages in the KV pool.
        ancestor_positions: int64 ``[S-1, B, K, S-1]`` row positions of the
            draft steps' ancestor slots (`ancestor_slots`): at step ``i``,
            columns ``0 .. i`` are leaf ``t``'s path in a random draft tree
            (random parent at every step, own slots shuffled over the row's
            ``cfg.ancestor_draft_slots`` positions after the prefix); the
            columns after hold the own slots of later steps, which step ``i``
            must not read.
    """

    cfg: SpecConfig
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    draft_positions: torch.Tensor
    parents: torch.Tensor
    tree_mask: torch.Tensor
    extend_seq_lens: torch.Tensor
    num_pages: int
    ancestor_positions: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    def batch(self) -> dict:
        """The three per-batch keyword arguments every builder takes."""
        return dict(
            req_to_token=self.req_to_token,
            req_pool_indices=self.req_pool_indices,
            seq_lens=self.seq_lens,
        )

    def ancestor_slots(self, step: int) -> torch.Tensor:
        """int64 ``[B, K, S-1]``: the ``ancestor_slots`` of draft ``step``."""
        rows = self.req_pool_indices.view(-1, 1, 1)
        return self.req_to_token[rows, self.ancestor_positions[step]].to(torch.int64)

    def mode_kwargs(self, mode: str, tree: bool = True, *, step: int = 0,
                    draft_attention: Optional[str] = None) -> dict:
        """Keyword arguments of the builder of ``mode`` (a key of `fa3_spec.MODES`);
        draft decode at ``step`` with ``draft_attention="ancestors"`` gets
        `ancestor_slots` instead of ``out_cache_loc``."""
        kw = self.batch()
        if mode == "draft_decode" and draft_attention not in DRAFT_ATTENTION:
            raise ValueError(f"draft_decode needs draft_attention in {DRAFT_ATTENTION}, "
                             f"got {draft_attention!r}")
        if mode == "draft_decode" and draft_attention == "ancestors":
            kw["ancestor_slots"] = self.ancestor_slots(step)
        elif mode == "draft_decode":
            kw["out_cache_loc"] = self.out_cache_loc
        elif mode == "target_verify":
            kw["tree_mask"] = self.tree_mask if tree else None
        elif mode == "draft_extend":
            kw["extend_seq_lens"] = self.extend_seq_lens
        return kw

    def to(self, device) -> "World":
        moved = {
            f.name: (v.to(device) if isinstance(v, torch.Tensor) else v)
            for f in dataclasses.fields(self)
            for v in [getattr(self, f.name)]
        }
        return World(**moved)


def make_world(
    cfg: SpecConfig,
    batch_size: int,
    *,
    seq_lens: Optional[Sequence[int]] = None,
    num_padding: int = 0,
    seed: int = 0,
    extra_rows: int = 3,
    device="cpu",
) -> World:
    """Build a random world of ``batch_size`` requests.

    Args:
        cfg: static configuration.
        batch_size: ``B`` (may be 0).
        seq_lens: explicit lengths (0 = padding row); random in
            ``[1, max_context_len]`` when omitted.
        num_padding: when ``seq_lens`` is omitted, make the last
            ``num_padding`` rows padding rows.
        seed: RNG seed; the world is a deterministic function of the arguments.
        extra_rows: unused ``req_to_token`` rows, so request rows are a
            shuffled subset of the pool.
    """
    g = torch.Generator().manual_seed(seed)
    p, n = cfg.page_size, cfg.num_draft_tokens
    if seq_lens is None:
        seq = torch.randint(1, cfg.max_context_len + 1, (batch_size,), generator=g)
        if num_padding:
            seq[batch_size - num_padding:] = 0
    else:
        seq = torch.as_tensor(list(seq_lens), dtype=torch.int64)
        if seq.numel() != batch_size:
            raise ValueError("seq_lens must have batch_size entries")
    seq = seq.to(torch.int64)

    max_reqs = batch_size + extra_rows
    row_len = cfg.draft_row_len
    pages_per_row = cdiv(row_len, p)
    num_pages = 1 + max_reqs * pages_per_row  # page 0: reserved dummy
    physical = 1 + torch.randperm(num_pages - 1, generator=g)
    row_pages = physical.view(max_reqs, pages_per_row)
    pos = torch.arange(row_len)
    req_to_token = (row_pages[:, pos // p] * p + pos % p).to(torch.int32)
    req_pool_indices = torch.randperm(max_reqs, generator=g)[:batch_size]

    positions = draft_positions(cfg, seq, "branch")
    loc = req_to_token[req_pool_indices.view(-1, 1, 1), positions].to(torch.int64)

    parents = torch.full((batch_size, n), -1, dtype=torch.int64)
    for c in range(1, n):
        parents[:, c] = torch.randint(0, c, (batch_size,), generator=g)
    tree_mask = tree_mask_from_parents(parents)

    upper = torch.minimum(seq, torch.full_like(seq, n)).clamp(min=1)
    ext = (torch.rand(batch_size, generator=g) * upper).floor().to(torch.int64) + 1
    ext = torch.where(seq > 0, torch.minimum(ext, upper), 0)

    world = World(
        cfg=cfg,
        req_to_token=req_to_token,
        req_pool_indices=req_pool_indices.to(torch.int64),
        seq_lens=seq,
        out_cache_loc=loc.reshape(-1),
        draft_positions=positions,
        parents=parents,
        tree_mask=tree_mask,
        extend_seq_lens=ext,
        num_pages=num_pages,
        ancestor_positions=_random_ancestors(cfg, seq, g),
    )
    return world.to(device)


def _random_ancestors(cfg: SpecConfig, seq: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """`World.ancestor_positions`: random draft trees over shuffled positions."""
    k, steps = cfg.topk, cfg.num_draft_decode_steps
    bs = seq.shape[0]
    positions = draft_positions(cfg, seq, "ancestors").transpose(1, 2).reshape(bs, steps * k)
    order = torch.rand(bs, steps * k, generator=g).argsort(dim=1)
    own = positions.gather(1, order).view(bs, steps, k)  # own[b, i, t]: leaf t of step i
    parents = torch.randint(0, k, (max(steps, 1), bs, k), generator=g)
    path = own.new_zeros(bs, k, 0)
    per_step = []
    for i in range(steps):
        path = draft_ancestor_slots(path, parents[i], own[:, i])
        later = own[:, i + 1:].transpose(1, 2)  # never read at step i
        per_step.append(torch.cat([path, later], dim=2))
    if not per_step:
        return torch.zeros(0, bs, k, 0, dtype=torch.int64)
    return torch.stack(per_step)


def rebase_world(world: World, req_to_token: torch.Tensor) -> World:
    """``world``'s batch over another pool (same row length, as many rows or more).

    Engines keep one ``req_to_token`` pool; to feed several batches to one
    captured step, give them all the same pool.
    """
    if (req_to_token.shape[1] != world.req_to_token.shape[1]
            or req_to_token.shape[0] < world.req_to_token.shape[0]):
        raise ValueError("req_to_token must have the world's row length and at least its rows")
    rows = world.req_pool_indices.view(-1, 1, 1)
    loc = req_to_token[rows, world.draft_positions].to(torch.int64).reshape(-1)
    return dataclasses.replace(world, req_to_token=req_to_token, out_cache_loc=loc)


def fill_kv_cache(
    world: World,
    *,
    num_kv_heads: int,
    head_dim: int,
    dtype=torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``k_cache, v_cache`` ``[num_pages, P, H_kv, D]`` for ``world``.

    With ``P > 1`` and ``topk > 1`` the first ``last`` slots of every
    branch's region are overwritten with copies of the prefix's partial last
    page, as an engine does before the draft steps (branch 0's region starts
    on that very page, so it already holds them).
    """
    cfg = world.cfg
    p = cfg.page_size
    device = world.req_to_token.device
    g = torch.Generator().manual_seed(seed)
    shape = (world.num_pages, p, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    if p > 1 and cfg.topk > 1:
        kf, vf = k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)
        r2t = world.req_to_token
        for b, (row, s) in enumerate(zip(world.req_pool_indices.tolist(), world.seq_lens.tolist())):  # ok-host
            last = s % p
            for t in range(1, cfg.topk):
                for o in range(last):
                    src = int(r2t[row, s - last + o])
                    dst = int(r2t[row, int(world.draft_positions[b, t, 0]) - last + o])
                    kf[dst] = kf[src]
                    vf[dst] = vf[src]
    return k, v
