"""A synthetic serving world for tests, notebooks and benchmarks.

`make_world` lays out what an engine would hold for one batch: a paged
``req_to_token`` whose physical pages are shuffled (page 0 is the reserved
dummy page, never allocated), draft slots allocated exactly as SPEC §3
prescribes, random draft trees, and accepted-token counts for draft extend.
`fill_kv_cache` writes random keys/values, including the copies of each
prefix's partial last page into every branch's first page.

The dense oracle (`expected_key_slots` + `dense_attention`) states, per
query, which token slots it must attend, straight from SPEC §3 and without
page tables: it checks metadata and attention together.

Host-side code (loops, ``.tolist()``) is fine here; nothing in this module
runs inside a builder or a captured step.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from .builders import MODES, build_metadata  # noqa: F401  (MODES re-exported)
from .config import SpecConfig, cdiv
from .metadata import PAGE_SENTINEL, CascadeMetadata, FA3Metadata
from .tree import tree_mask_from_parents



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

    def mode_kwargs(self, mode: str, tree: bool = True) -> dict:
        """Keyword arguments of the builder of ``mode`` (see `MODES`)."""
        kw = self.batch()
        if mode == "draft_decode":
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


def draft_positions(cfg: SpecConfig, seq_lens: torch.Tensor) -> torch.Tensor:
    """Row positions ``[B, K, S]`` of the draft tokens (SPEC §3).

    ``P > 1`` and ``K > 1``: branch ``t`` owns a page-aligned region of
    ``ceil((last + S) / P)`` pages starting at ``seq_len - last + t * that *
    P``, and its token ``s`` sits at offset ``last + s`` of the region.
    Otherwise the ``K * S`` drafts follow the prefix contiguously.
    """
    p, k, s = cfg.page_size, cfg.topk, cfg.num_steps
    seq = seq_lens.to(torch.int64).view(-1, 1, 1)
    t = torch.arange(k).view(1, k, 1).to(seq.device)
    step = torch.arange(s).view(1, 1, s).to(seq.device)
    if p > 1 and k > 1:
        last = seq % p
        region = torch.div(last + s + p - 1, p, rounding_mode="floor") * p
        return seq - last + t * region + last + step
    return seq + t * s + step


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

    positions = draft_positions(cfg, seq)
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
    )
    return world.to(device)


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
        for b, (row, s) in enumerate(zip(world.req_pool_indices.tolist(), world.seq_lens.tolist())):
            last = s % p
            for t in range(1, cfg.topk):
                for o in range(last):
                    src = int(r2t[row, s - last + o])
                    dst = int(r2t[row, int(world.draft_positions[b, t, 0]) - last + o])
                    kf[dst] = kf[src]
                    vf[dst] = vf[src]
    return k, v


def expected_key_slots(world: World, mode: str, *, step: int = 0, tree: bool = True) -> list:
    """Per query, in ``q`` order, the slots it must attend (SPEC §3).

    With ``P > 1`` and ``topk > 1`` a branch reads the prefix's partial last
    page from the copy at the start of its own region (branch 0's region
    starts on that page itself), so those are the slots listed.

    Query order: decode and draft topk = 1, one per request; draft topk > 1,
    ``[B, K]`` request-major; verify, ``[B, N]``; extend, the packed
    ``extend_seq_lens[b]`` queries of each request (the last accepted tokens).
    Padding rows contribute queries (with no keys) except in extend, where
    they have none.
    """
    cfg = world.cfg
    r2t = world.req_to_token.cpu()
    loc = world.out_cache_loc.cpu().view(-1, cfg.topk, cfg.num_steps)
    out = []
    for b, (row, s) in enumerate(zip(world.req_pool_indices.tolist(), world.seq_lens.tolist())):
        tokens = r2t[row].tolist()
        live = s > 0
        if mode == "decode":
            out.append(tokens[:s])
        elif mode == "draft_decode":
            d = step + 1
            if cfg.topk == 1:
                out.append(tokens[: s + d] if live else [])
            else:
                last = s % cfg.page_size if cfg.page_size > 1 else 0
                for t in range(cfg.topk):
                    # The prefix's partial last page is read from the copy at
                    # the start of the branch's own region (SPEC §3).
                    start = int(world.draft_positions[b, t, 0]) - last
                    tail = [tokens[start + o] for o in range(last)]
                    drafts = loc[b, t, :d].tolist()
                    out.append(tokens[: s - last] + tail + drafts if live else [])
        elif mode == "target_verify":
            n = cfg.num_draft_tokens
            mask = world.tree_mask[b].cpu()
            for j in range(n):
                if not live:
                    out.append([])
                elif tree:
                    out.append(tokens[:s] + [tokens[s + c] for c in range(n) if mask[j, c]])
                else:
                    out.append(tokens[: s + j + 1])
        elif mode == "draft_extend":
            e = int(world.extend_seq_lens[b]) if live else 0
            for j in range(e):
                out.append(tokens[: s - e + j + 1])
        else:
            raise ValueError(f"unknown mode {mode!r}")
    return out


def dense_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_slots: list,
    softmax_scale: Optional[float] = None,
) -> torch.Tensor:
    """Float32 attention of ``q[i]`` over ``key_slots[i]`` (zeros if empty).

    ``q``: ``[total_q, H_q, D]``; caches ``[num_pages, P, H_kv, D]``. Rows of
    ``q`` past ``len(key_slots)`` get zeros. GQA: query head ``h`` reads KV
    head ``h // (H_q // H_kv)``.
    """
    hq, dim = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    scale = softmax_scale if softmax_scale is not None else dim ** -0.5
    kf = k_cache.reshape(-1, hkv, k_cache.shape[-1]).float()
    vf = v_cache.reshape(-1, hkv, v_cache.shape[-1]).float()
    out = torch.zeros(q.shape[0], hq, v_cache.shape[-1], dtype=torch.float32, device=q.device)
    for i, slots in enumerate(key_slots):
        if not slots:
            continue
        idx = torch.tensor(slots, device=q.device)
        keys = kf[idx].repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        vals = vf[idx].repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].float(), keys) * scale
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), vals)
    return out


def _visible_table(md: FA3Metadata, width: int) -> torch.Tensor:
    """``md.page_table`` with every column FA3 never reads set to the sentinel."""
    table = torch.where(md.read_columns(), md.page_table.to(torch.int64), PAGE_SENTINEL)
    pad = width - table.shape[1]
    if pad > 0:
        table = torch.nn.functional.pad(table, (0, pad), value=PAGE_SENTINEL)
    return table


def metadata_mismatches(actual, expected, *, prefix: str = "") -> list:
    """Differences between two metadata in what FA3 reads; ``[]`` if none.

    Compares static fields, ``cache_seqlens``, both ``cu_seqlens`` and the
    page-table columns FA3 reads (``< ceil(cache_seqlens / page_size)``).
    Dead columns may differ (upstream leaves stale slots there); use
    `dead_columns_clean` to check ours hold the sentinel.
    """
    if isinstance(expected, CascadeMetadata) or isinstance(actual, CascadeMetadata):
        if type(actual) is not type(expected):
            return [f"{prefix}type {type(actual).__name__} != {type(expected).__name__}"]
        out = metadata_mismatches(actual.prefix, expected.prefix, prefix=prefix + "prefix.")
        if (actual.expand is None) != (expected.expand is None):
            return out + [f"{prefix}expand presence differs"]
        if actual.expand is not None:
            out += metadata_mismatches(actual.expand, expected.expand, prefix=prefix + "expand.")
        return out
    out = []
    for name in ("max_seqlen_q", "max_seqlen_k", "page_size", "causal"):
        if getattr(actual, name) != getattr(expected, name):
            out.append(f"{prefix}{name}: {getattr(actual, name)} != {getattr(expected, name)}")
    for name in ("cache_seqlens", "cu_seqlens_q", "cu_seqlens_k"):
        a, e = getattr(actual, name), getattr(expected, name)
        if a.shape != e.shape or not torch.equal(a.cpu().to(torch.int64), e.cpu().to(torch.int64)):
            out.append(f"{prefix}{name} differs")
    if not out:
        width = max(actual.page_table.shape[1], expected.page_table.shape[1])
        if not torch.equal(_visible_table(actual, width).cpu(), _visible_table(expected, width).cpu()):
            out.append(f"{prefix}page_table differs in columns FA3 reads")
    return out


def dead_columns_clean(md) -> bool:
    """True when every column FA3 never reads holds `PAGE_SENTINEL`."""
    return all(torch.equal(_visible_table(c, c.page_table.shape[1]), c.page_table.to(torch.int64))
               for c in md.calls)


build = build_metadata  # the builder of a mode, by name


def key_slots_read(md, num_queries: int) -> list:
    """Per query, the slots FA3 reads under ``md`` (its documented read rule).

    Row ``b`` owns queries ``cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1``; key ``t``
    of the row is slot ``page_table[b, t // P] * P + t % P`` for
    ``t < cache_seqlens[b]``; with ``causal``, query ``i`` of a row with ``n``
    queries sees keys ``t <= cache_seqlens - n + i`` (bottom-right aligned).
    A cascade's query reads the union, prefix keys first. Queries no row
    owns read nothing.
    """
    if isinstance(md, CascadeMetadata):
        out = key_slots_read(md.prefix, num_queries)
        if md.expand is not None:
            for i, extra in enumerate(key_slots_read(md.expand, num_queries)):
                out[i] = out[i] + extra
        return out
    out = [[] for _ in range(num_queries)]
    cu = md.cu_seqlens_q.tolist()
    table = md.page_table.tolist()
    p = md.page_size
    for b, length in enumerate(md.cache_seqlens.tolist()):
        keys = [table[b][t // p] * p + t % p for t in range(length)]
        n = cu[b + 1] - cu[b]
        for i in range(n):
            if cu[b] + i >= num_queries:
                break
            visible = keys[: max(0, length - n + i + 1)] if md.causal else keys
            out[cu[b] + i] = visible
    return out


def num_queries(world: World, mode: str) -> int:
    """Rows of ``q`` a step of ``mode`` takes for ``world`` (static size)."""
    cfg, bs = world.cfg, world.batch_size
    return {
        "decode": bs,
        "draft_decode": bs * cfg.topk,
        "target_verify": bs * cfg.num_draft_tokens,
        "draft_extend": bs * cfg.num_draft_tokens,
    }[mode]
