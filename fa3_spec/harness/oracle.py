"""Oracles: what each query must read, and comparisons of metadata.

The dense oracle (`expected_key_slots` + `dense_attention`) states, per
query, which token slots it must attend, straight from docs/semantics.md and
without page tables: it checks metadata and attention together.
`key_slots_read` derives the same lists from any metadata by FA3's read
rule; `metadata_mismatches` compares two metadata in what FA3 reads.

Host-side code (loops, host reads of tensor values): never inside a builder or a captured step.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..config import DRAFT_ATTENTION
from ..metadata import PAGE_SENTINEL, CascadeMetadata, FA3Metadata
from .worlds import World


def expected_key_slots(world: World, mode: str, *, step: int = 0, tree: bool = True,
                       draft_attention: Optional[str] = None) -> list:
    """Per query, in ``q`` order, the slots it must attend (docs/semantics.md).

    With ``P > 1`` and ``topk > 1`` a branch reads the prefix's partial last
    page from the copy at the start of its own region (branch 0's region
    starts on that page itself), so those are the slots listed. With
    ``draft_attention="ancestors"`` (draft decode, any topk) leaf ``t`` reads
    the whole prefix, then its ancestors and itself,
    ``world.ancestor_slots(step)[b, t, :step + 1]``.

    Query order: decode and draft topk = 1, one per request; draft topk > 1,
    ``[B, K]`` request-major; verify, ``[B, N]``; extend, the packed
    ``extend_seq_lens[b]`` queries of each request (the last accepted tokens).
    Padding rows contribute queries (with no keys) except in extend, where
    they have none.
    """
    cfg = world.cfg
    r2t = world.req_to_token.cpu()
    loc = world.out_cache_loc.cpu().view(-1, cfg.topk, cfg.num_steps)
    if mode == "draft_decode" and draft_attention not in DRAFT_ATTENTION:
        raise ValueError(f"draft_decode needs draft_attention in {DRAFT_ATTENTION}, "
                         f"got {draft_attention!r}")
    ancestors = draft_attention == "ancestors"
    if mode == "draft_decode" and ancestors:
        paths = world.ancestor_slots(step)[:, :, : step + 1].cpu().tolist()  # ok-host: harness
    out = []
    for b, (row, s) in enumerate(zip(world.req_pool_indices.tolist(), world.seq_lens.tolist())):  # ok-host
        tokens = r2t[row].tolist()  # ok-host: harness, never in a step
        live = s > 0
        if mode == "decode":
            out.append(tokens[:s])
        elif mode == "draft_decode" and ancestors:
            out.extend(tokens[:s] + path if live else [] for path in paths[b])
        elif mode == "draft_decode":
            d = step + 1
            if cfg.topk == 1:
                out.append(tokens[: s + d] if live else [])
            else:
                last = s % cfg.page_size if cfg.page_size > 1 else 0
                for t in range(cfg.topk):
                    # The prefix's partial last page is read from the copy at
                    # the start of the branch's own region (docs/semantics.md).
                    start = int(world.draft_positions[b, t, 0]) - last
                    tail = [tokens[start + o] for o in range(last)]
                    drafts = loc[b, t, :d].tolist()  # ok-host: harness, never in a step
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
    """Float32 attention (float64 for a float64 ``q``) of ``q[i]`` over
    ``key_slots[i]`` (zeros if empty).

    ``q``: ``[total_q, H_q, D]``; caches ``[num_pages, P, H_kv, D]``. Rows of
    ``q`` past ``len(key_slots)`` get zeros. GQA: query head ``h`` reads KV
    head ``h // (H_q // H_kv)``.
    """
    hq, dim = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    scale = softmax_scale if softmax_scale is not None else dim ** -0.5
    dtype = torch.promote_types(q.dtype, torch.float32)
    kf = k_cache.reshape(-1, hkv, k_cache.shape[-1]).to(dtype)
    vf = v_cache.reshape(-1, hkv, v_cache.shape[-1]).to(dtype)
    out = torch.zeros(q.shape[0], hq, v_cache.shape[-1], dtype=dtype, device=q.device)
    for i, slots in enumerate(key_slots):
        if not slots:
            continue
        idx = torch.tensor(slots, device=q.device)
        keys = kf[idx].repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        vals = vf[idx].repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].to(dtype), keys) * scale
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
    for name in ("max_seqlen_q", "max_seqlen_k", "page_size", "causal", "window_left"):
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


def key_slots_read(md, num_queries: int) -> list:
    """Per query, the slots FA3 reads under ``md`` (its documented read rule).

    Row ``b`` owns queries ``cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1``; key ``t``
    of the row is slot ``page_table[b, t // P] * P + t % P`` for
    ``t < cache_seqlens[b]``; with ``causal``, query ``i`` of a row with ``n``
    queries sees keys ``t <= cache_seqlens - n + i`` (bottom-right aligned),
    and with ``window_left >= 0`` only keys ``t >= cache_seqlens - n + i -
    window_left``.
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
    cu = md.cu_seqlens_q.tolist()  # ok-host: harness, never in a step
    table = md.page_table.tolist()  # ok-host: harness, never in a step
    p = md.page_size
    for b, length in enumerate(md.cache_seqlens.tolist()):  # ok-host: harness, never in a step
        keys = [table[b][t // p] * p + t % p for t in range(length)]
        n = cu[b + 1] - cu[b]
        for i in range(n):
            if cu[b] + i >= num_queries:
                break
            visible = keys[: max(0, length - n + i + 1)] if md.causal else keys
            if md.window_left >= 0:  # bottom-right: query i sits at key length - n + i
                visible = visible[max(0, length - n + i - md.window_left):]
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
