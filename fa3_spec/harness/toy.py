"""Whole speculative steps, metadata inside: what a CUDA-graph runner captures.

A `ToyModel` is a stack of attention-only layers with fixed random weights and
one paged KV cache per layer: enough to exercise every attention call an EAGLE
iteration makes, write K/V where an engine writes them, and chain the draft
steps through hidden states (each step's output feeds the next), so a replay
that read stale or wrong metadata would show in the result.

Steps (pure functions of their tensor inputs, except the KV writes):

* `draft_iteration`: copies each prefix tail into every branch's first page
  (`draft_tail_copy_slots`), then runs all ``num_steps - 1`` draft-decode
  steps on metadata from `build_draft_iteration_metadata` (all steps' tables
  built together; the topk > 1 prefix once).
* `target_verify_step`: the target's verify pass (chain or tree).
* `draft_extend_step`: the draft model re-reading accepted tokens.

Every slot written is clamped into the cache; padding rows (``seq_len == 0``)
write to slot 0 (the reserved dummy page) and read nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from ..attention import cascade_attention, store_kv
from ..batch import SpecBatch
from ..builders import (
    build_draft_extend_metadata,
    build_draft_iteration_metadata,
    build_target_verify_metadata,
    draft_tail_copy_slots,
)
from ..builders.verify import draft_token_positions
from ..config import SpecConfig
from ..metadata_builder import MetadataBuilder


@dataclasses.dataclass
class ToyModel:
    """``layers`` attention-only layers over paged KV caches.

    Attributes:
        wq, wk, wv: ``[L, hidden, H * D]`` projections (``H_q`` for q,
            ``H_kv`` for k and v); wo: ``[L, H_q * D, hidden]``.
        k_cache, v_cache: ``[L, num_pages, page_size, H_kv, D]``.
    """

    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    @classmethod
    def create(cls, *, layers: int, num_pages: int, page_size: int, num_heads: int,
               num_kv_heads: int, head_dim: int, dtype=torch.bfloat16, device="cpu",
               seed: int = 0) -> "ToyModel":
        g = torch.Generator().manual_seed(seed)
        hidden = num_heads * head_dim

        def w(*shape):
            return (torch.randn(*shape, generator=g) * shape[-2] ** -0.5).to(device, dtype)

        cache = (layers, num_pages, page_size, num_kv_heads, head_dim)
        return cls(
            wq=w(layers, hidden, num_heads * head_dim),
            wk=w(layers, hidden, num_kv_heads * head_dim),
            wv=w(layers, hidden, num_kv_heads * head_dim),
            wo=w(layers, num_heads * head_dim, hidden),
            k_cache=(torch.randn(cache, generator=g)).to(device, dtype),
            v_cache=(torch.randn(cache, generator=g)).to(device, dtype),
        )

    @property
    def num_layers(self) -> int:
        return self.wq.shape[0]

    @property
    def hidden(self) -> int:
        return self.wq.shape[1]

    def _flat(self, layer_slots: torch.Tensor) -> torch.Tensor:
        """``[L, T]`` per-layer slots (clamped) -> flat slots into all layers."""
        layers, pages, p = self.k_cache.shape[:3]
        per_layer = pages * p
        offsets = torch.arange(layers, device=layer_slots.device).unsqueeze(1) * per_layer
        return (layer_slots.clamp(0, per_layer - 1) + offsets).reshape(-1)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K/V of slots ``src`` to ``dst`` in every layer (clamped)."""
        layers, _, _, hkv, d = self.k_cache.shape
        src_all = self._flat(src.to(torch.int64).unsqueeze(0).expand(layers, -1))
        dst_all = self._flat(dst.to(torch.int64).unsqueeze(0).expand(layers, -1))
        k = self.k_cache.view(-1, hkv, d)[src_all]
        v = self.v_cache.view(-1, hkv, d)[src_all]
        store_kv(self.k_cache, self.v_cache, dst_all, k, v)

    def forward(self, x: torch.Tensor, slots: torch.Tensor,
                attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                ) -> torch.Tensor:
        """Run every layer on ``x [T, hidden]`` whose tokens live at ``slots [T]``.

        Each layer writes the tokens' K/V at their slots (clamped into the
        cache, through the `fa3_spec.attention.store_kv` op so that a
        compiled step writes T rows, not a copy of the cache), then attends with ``attend(q, k_cache_l, v_cache_l)``.
        """
        t = x.shape[0]
        layers, pages, p, hkv, d = self.k_cache.shape
        hq = self.wq.shape[2] // d  # explicit sizes: an empty batch has 0 elements
        slots = slots.to(torch.int64).clamp(0, pages * p - 1)
        for layer in range(self.num_layers):
            q = (x @ self.wq[layer]).view(t, hq, d)
            k = (x @ self.wk[layer]).view(t, hkv, d)
            v = (x @ self.wv[layer]).view(t, hkv, d)
            store_kv(self.k_cache, self.v_cache, slots + layer * pages * p, k, v)
            out = attend(q, self.k_cache[layer], self.v_cache[layer])
            x = x + out.reshape(t, hq * d) @ self.wo[layer]
        return x


def _batch(req_to_token, req_pool_indices, seq_lens) -> dict:
    return dict(req_to_token=req_to_token, req_pool_indices=req_pool_indices, seq_lens=seq_lens)


def _attend_with(md, attention_backend: str, num_splits: Optional[int]):
    def attend(q, k_cache, v_cache):
        return cascade_attention(q, k_cache, v_cache, md, attention_backend=attention_backend,
                                 num_splits=num_splits)
    return attend


def draft_iteration(
    cfg: SpecConfig,
    model: ToyModel,
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    hidden: torch.Tensor,
    attention_backend: str = "auto",
    num_splits: Optional[int] = None,
) -> torch.Tensor:
    """All draft-decode steps of one iteration.

    Args:
        out_cache_loc: int64 ``[B, K, S]`` draft slots (the topk > 1 layout
            of docs/semantics.md).
        hidden: ``[B, K, hidden]`` input of step 0 per branch.

    Returns:
        ``[B, K, S - 1, hidden]``: each step's output (the next step's input).
    """
    bs, k, s = out_cache_loc.shape
    loc = out_cache_loc.reshape(bs * k, s)
    x = hidden.reshape(bs * k, model.hidden)
    batch = _batch(req_to_token, req_pool_indices, seq_lens)
    model.copy_slots(*draft_tail_copy_slots(cfg, seq_lens=seq_lens, out_cache_loc=loc))
    outs = []
    for step, md in enumerate(build_draft_iteration_metadata(cfg, **batch, out_cache_loc=loc)):
        x = model.forward(x, loc[:, step], _attend_with(md, attention_backend, num_splits))
        outs.append(x)
    if not outs:  # num_steps == 1: no draft-decode step
        return x.new_zeros((bs, k, 0, model.hidden))
    return torch.stack(outs, dim=1).view(bs, k, cfg.num_draft_decode_steps, model.hidden)


def target_verify_step(
    cfg: SpecConfig,
    model: ToyModel,
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    hidden: torch.Tensor,
    tree_mask: Optional[torch.Tensor] = None,
    attention_backend: str = "auto",
    num_splits: Optional[int] = None,
) -> torch.Tensor:
    """The verify pass over N draft tokens at row positions ``seq_len + c``.

    ``hidden``: ``[B, N, hidden]``; returns the same shape.
    """
    bs, n = hidden.shape[0], cfg.num_draft_tokens
    batch = _batch(req_to_token, req_pool_indices, seq_lens)
    md = build_target_verify_metadata(cfg, **batch, tree_mask=tree_mask)
    slots = verify_slots(cfg, **batch)
    attend = _attend_with(md, attention_backend, num_splits)
    x = model.forward(hidden.reshape(bs * n, model.hidden), slots, attend)
    return x.view(bs, n, model.hidden)


def verify_slots(cfg: SpecConfig, *, req_to_token: torch.Tensor,
                 req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """int64 ``[B * N]`` slots of the verify tokens (row positions ``seq_len + c``);
    padding rows get slot 0 (the dummy page)."""
    view = SpecBatch.create(cfg, req_to_token=req_to_token, req_pool_indices=req_pool_indices,
                            seq_lens=seq_lens).view()
    return view.mask_padding(view.slots(draft_token_positions(view)), 1).reshape(-1)


def draft_extend_step(
    cfg: SpecConfig,
    model: ToyModel,
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    hidden: torch.Tensor,
    attention_backend: str = "auto",
    num_splits: Optional[int] = None,
) -> torch.Tensor:
    """Draft extend: the packed accepted tokens re-read by the draft model.

    ``hidden``: ``[B, N, hidden]`` viewed flat as ``[B*N, hidden]`` with the
    ``sum(extend_seq_lens)`` real tokens packed at the front (request order).
    Token ``i`` of request ``b`` sits at row position
    ``seq_len - extend_seq_len + i``. Returns ``[B, N, hidden]``; rows past
    the real tokens are the (unattended) input passed through the layers.
    """
    bs, n = hidden.shape[0], cfg.num_draft_tokens
    batch = _batch(req_to_token, req_pool_indices, seq_lens)
    md = build_draft_extend_metadata(cfg, **batch, extend_seq_lens=extend_seq_lens)
    view = SpecBatch.create(cfg, **batch).view()
    cu = md.cu_seqlens_q.to(torch.int64)
    j = torch.arange(bs * n, device=seq_lens.device)
    row = md.query_rows(bs * n).clamp(max=max(bs - 1, 0))
    owned = j < cu[-1]
    if bs == 0:
        slots = torch.zeros(0, dtype=torch.int64, device=seq_lens.device)
    else:
        queries = cu[1:] - cu[:-1]
        position = view.seq_lens[row] - queries[row] + (j - cu[row])
        cols = position.clamp(0, req_to_token.shape[1] - 1)
        slots = req_to_token[view.rows[row], cols].to(torch.int64)
        slots = torch.where(owned, slots, 0)
    attend = _attend_with(md, attention_backend, num_splits)
    x = model.forward(hidden.reshape(bs * n, model.hidden), slots, attend)
    return x.view(bs, n, model.hidden)


#: Batch inputs of each mode's whole step (tree verify adds ``tree_mask``).
_STEP_INPUTS = {
    "draft_decode": ("req_pool_indices", "seq_lens", "out_cache_loc", "hidden"),
    "target_verify": ("req_pool_indices", "seq_lens", "hidden"),
    "draft_extend": ("req_pool_indices", "seq_lens", "extend_seq_lens", "hidden"),
}

#: Modes with a whole step here: every mode of `fa3_spec.MODES` but plain decode.
STEP_MODES = tuple(_STEP_INPUTS)

#: ``(mode, tree)`` of every whole step: verify both as a tree and as a chain.
STEP_VARIANTS = (("draft_decode", False), ("target_verify", True), ("target_verify", False),
                 ("draft_extend", False))


def step_inputs(mode: str, *, tree: bool = False) -> tuple:
    """Names of the batch tensors the whole step of ``mode`` takes."""
    if mode not in _STEP_INPUTS:
        raise ValueError(f"mode must be one of {STEP_MODES}, got {mode!r}")
    names = _STEP_INPUTS[mode]
    if mode == "target_verify" and tree:
        names = names[:2] + ("tree_mask",) + names[2:]
    return names


def make_step(mode: str, cfg: SpecConfig, model: ToyModel, req_to_token: torch.Tensor, *,
              tree: bool = False, attention_backend: str = "auto",
              num_splits: Optional[int] = None) -> Callable:
    """``step(**batch)`` of ``mode`` (one of `STEP_MODES`) over an engine's pool.

    ``req_to_token`` and ``model`` (weights, KV caches) are closed over, as an
    engine's pools are; the batch holds only batch-major tensors
    (`step_inputs`). ``tree`` selects tree verify (a ``tree_mask`` input).
    The step reads ``cfg`` through a `fa3_spec.MetadataBuilder`, so its ints
    are compile-time constants however many configurations a process compiles.
    """
    step_inputs(mode, tree=tree)  # validates the mode
    plan = MetadataBuilder(cfg, draft_attention="branch")
    common = dict(req_to_token=req_to_token, attention_backend=attention_backend,
                  num_splits=num_splits)
    if mode == "draft_decode":
        return lambda **b: draft_iteration(plan.cfg, model, **common, **b)
    if mode == "target_verify":
        return lambda **b: target_verify_step(plan.cfg, model, **common, **b)
    return lambda **b: draft_extend_step(plan.cfg, model, **common, **b)


def example_batch(mode: str, cfg: SpecConfig, model: ToyModel, bs: int, *, device,
                  tree: bool = False) -> dict:
    """An all-padding batch of ``bs`` rows with the shapes ``mode`` takes."""
    k, s, n, h = cfg.topk, cfg.num_steps, cfg.num_draft_tokens, model.hidden
    i64 = dict(dtype=torch.int64, device=device)
    shapes = {
        "req_pool_indices": torch.zeros(bs, **i64),
        "seq_lens": torch.zeros(bs, **i64),
        "extend_seq_lens": torch.zeros(bs, **i64),
        "out_cache_loc": torch.zeros(bs, k, s, **i64),
        "tree_mask": torch.zeros(bs, n, n, dtype=torch.bool, device=device),
        "hidden": torch.zeros(bs, k if mode == "draft_decode" else n, h,
                              dtype=model.wq.dtype, device=device),
    }
    return {name: shapes[name] for name in step_inputs(mode, tree=tree)}


def world_batch(mode: str, world, hidden: torch.Tensor, *, tree: bool = False) -> dict:
    """The batch of ``mode`` for a `fa3_spec.harness.worlds.World` and ``hidden``."""
    cfg = world.cfg
    values = dict(
        req_pool_indices=world.req_pool_indices,
        seq_lens=world.seq_lens,
        extend_seq_lens=world.extend_seq_lens,
        out_cache_loc=world.out_cache_loc.view(-1, cfg.topk, cfg.num_steps),
        tree_mask=world.tree_mask,
        hidden=hidden,
    )
    return {name: values[name] for name in step_inputs(mode, tree=tree)}
