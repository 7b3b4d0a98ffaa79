"""The models the EAGLE loop drives: a Llama-style target and an EAGLE draft head.

Plain torch, no ``nn.Module`` state beyond weight tensors, so a whole
iteration traces with ``torch.compile(fullgraph=True)``. Every attention goes
through `fa3_spec.cascade_attention` on fa3_spec metadata, and every K/V
write through the ``fa3_spec::store_kv`` op.

* `LlamaTarget`: embedding, ``L`` decoder layers (RMSNorm, RoPE at the
  positions the caller gives, GQA attention, SwiGLU MLP), final RMSNorm,
  lm_head. ``forward`` returns the last layer's output before the final norm
  (the feature EAGLE feeds its draft head); ``logits`` applies norm + lm_head.
* `EagleDraft`: one decoder layer fed ``fc([embed(token); hidden])``, sharing
  the target's embedding and lm_head (EAGLE-1/2's draft head).
* `SpecModel`: the protocol the loop drives; `EagleModels` implements it for
  the two classes above. An engine can plug in its own model by providing the
  same six members.

How acceptance is controlled (`make_models`): with ``draft="derived"`` the
target's layers ``1 .. L-1`` have their residual branches (``wo`` and
``w_down``) scaled by ``alpha``, so layer 0 dominates the target's output,
and the draft's decoder layer is a copy of target layer 0 whose ``fc`` feeds
it the token embedding (plus ``mix`` times the target hidden). EAGLE's shift
(draft position ``p`` consumes the token at ``p + 1``) leaves the draft's
attention one key short of the target's (it never sees token 0) but RoPE is
relative, so scores match and the draft mostly proposes the target's argmax.
Smaller ``alpha`` and ``mix`` -> higher acceptance; ``noise`` (relative
Gaussian noise on the draft's weights) lowers it. ``draft="random"`` draws
independent draft weights: almost every draft token is rejected.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Protocol, Tuple

import torch
import torch.nn.functional as F

from ..attention import cascade_attention
from ..attention.kv_store import store_kv


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Static architecture numbers (Llama conventions)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    logit_scale: float = 1.0  # lm_head init scale: > 1 sharpens the draft's scores
    max_position_embeddings: int = 8192  # rows of the RoPE table


#: ``tiny``: CPU tests (float64 on CPU); head_dim 64 so that FA3 runs it on
#: the GPU too; its sharper logits (``logit_scale``)
#: make EAGLE-2's cumulative scores prefer deep paths, as trained drafts do.
#: ``llama3-8b``: Llama-3-8B's shapes, random weights.

PRESETS = {
    "tiny": ModelShape(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=64, intermediate_size=256, logit_scale=6.0),
    "llama3-8b": ModelShape(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                            num_kv_heads=8, head_dim=128, intermediate_size=14336,
                            rope_theta=500000.0, rms_eps=1e-5),
}


@dataclasses.dataclass
class KVCache:
    """Paged K/V of one model: ``[layers, num_pages, page_size, H_kv, D]`` each."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def zeros(cls, layers: int, num_pages: int, page_size: int, num_kv_heads: int,
              head_dim: int, *, dtype, device) -> "KVCache":
        shape = (layers, num_pages, page_size, num_kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device))

    @property
    def slots_per_layer(self) -> int:
        return self.k.shape[1] * self.k.shape[2]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K/V of slots ``src [T]`` to ``dst [T]`` in every layer.

        All reads happen before any write, so ``dst`` may overlap ``src``
        (the commit of accepted tree nodes relies on it).
        """
        layers, _, _, hkv, d = self.k.shape
        per = self.slots_per_layer
        offsets = torch.arange(layers, device=src.device).view(layers, 1) * per
        src_all = (src.to(torch.int64).clamp(0, per - 1).view(1, -1) + offsets).reshape(-1)
        dst_all = (dst.to(torch.int64).clamp(0, per - 1).view(1, -1) + offsets).reshape(-1)
        k = self.k.view(-1, hkv, d)[src_all]
        v = self.v.view(-1, hkv, d)[src_all]
        store_kv(self.k, self.v, dst_all, k, v)


@dataclasses.dataclass
class LayerWeights:
    """One Llama decoder layer, matrices ``[in, out]`` (``x @ w``), with the
    projections that read the same input fused into one matrix each.

    ``wqkv`` columns: the ``H_q`` query heads, then the ``H_kv`` key heads,
    then the ``H_kv`` value heads (``D`` columns each). ``w_gate_up``
    columns: the ``I`` gate columns, then the ``I`` up columns. Why ``[in,
    out]``: on the H200 the 8B shapes' GEMMs stream 1.5% (M = 1) to 4%
    (M = 64) faster as ``x @ w`` than as ``F.linear`` on ``[out, in]``
    (``benchmarks/model_roofline.py``). Build one with `from_projections`,
    the one conversion from Hugging Face's separate ``[out, in]``
    projections (random presets and checkpoint loaders both go through it).
    """

    attn_norm: torch.Tensor  # [H]
    wqkv: torch.Tensor  # [H, (H_q + 2 H_kv) * D]
    wo: torch.Tensor  # [H_q * D, H]
    mlp_norm: torch.Tensor  # [H]
    w_gate_up: torch.Tensor  # [H, 2 I]
    w_down: torch.Tensor  # [I, H]

    @classmethod
    def from_projections(cls, *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         o: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                         down: torch.Tensor, attn_norm: torch.Tensor,
                         mlp_norm: torch.Tensor) -> "LayerWeights":
        """Fuse and transpose separate ``[out, in]`` projections (``q_proj`` ...
        ``down_proj`` of a Hugging Face Llama layer) into this layout (new,
        contiguous tensors; the inputs are not modified)."""
        return cls(attn_norm.clone(), torch.cat([q, k, v], 0).t().contiguous(),
                   o.t().contiguous(), mlp_norm.clone(), torch.cat([gate, up], 0).t().contiguous(),
                   down.t().contiguous())

    @classmethod
    def random(cls, shape: ModelShape, g: torch.Generator, *, dtype, device) -> "LayerWeights":
        h, d, i = shape.hidden_size, shape.head_dim, shape.intermediate_size

        def w(n_out, n_in):
            x = torch.randn(n_out, n_in, generator=g, device=device, dtype=torch.float32)
            return (x * n_in ** -0.5).to(dtype)

        ones = torch.ones(h, device=device, dtype=dtype)
        return cls.from_projections(
            q=w(shape.num_heads * d, h), k=w(shape.num_kv_heads * d, h),
            v=w(shape.num_kv_heads * d, h), o=w(h, shape.num_heads * d),
            gate=w(i, h), up=w(i, h), down=w(h, i), attn_norm=ones, mlp_norm=ones)

    def clone(self) -> "LayerWeights":
        return LayerWeights(*(t.clone() for t in dataclasses.astuple(self)))


@dataclasses.dataclass
class RopeTable:
    """RoPE's ``cos`` and ``sin`` per position, ``[max_positions, D / 2]`` each
    (float64 for float64 models, else float32), computed once per model.

    `at` gathers the rows of the given positions once per forward; every
    layer then rotates with those rows instead of recomputing them.
    Positions are clamped into the table (memory safety; the engine refuses
    a context longer than the table).
    """

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def create(cls, shape: ModelShape, *, dtype, device) -> "RopeTable":
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        d = shape.head_dim
        inv_freq = shape.rope_theta ** -(torch.arange(0, d, 2, device=device, dtype=compute) / d)
        pos = torch.arange(shape.max_position_embeddings, device=device, dtype=compute)
        angles = pos.unsqueeze(-1) * inv_freq  # [max_positions, D/2]
        return cls(angles.cos(), angles.sin())

    @property
    def max_positions(self) -> int:
        return self.cos.shape[0]

    def at(self, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` (any int dtype) -> ``(cos, sin)`` ``[T, D/2]``."""
        idx = positions.to(torch.int64).clamp(0, self.max_positions - 1)
        return self.cos[idx], self.sin[idx]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Llama) of ``x [T, H, D]`` with the ``[T, D/2]`` rows of
    `RopeTable.at`: ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``."""
    half = x.shape[-1] // 2
    xf = x.to(cos.dtype)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(x.dtype)


@torch.compiler.nested_compile_region
def attention_inputs(shape: ModelShape, w: LayerWeights, x: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [T, H]`` -> ``q [T, H_q, D]``, ``k, v [T, H_kv, D]`` (RMSNorm, fused
    QKV, RoPE with the tokens' ``cos, sin [T, D/2]``)."""
    t = x.shape[0]
    hq, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    h = rms_norm(x, w.attn_norm, shape.rms_eps)
    q, k, v = (h @ w.wqkv).split([hq * d, hkv * d, hkv * d], dim=-1)
    return (apply_rope(q.reshape(t, hq, d), cos, sin), apply_rope(k.reshape(t, hkv, d), cos, sin),
            v.reshape(t, hkv, d))


@torch.compiler.nested_compile_region
def attention_output_and_mlp(shape: ModelShape, w: LayerWeights, x: torch.Tensor,
                             attn: torch.Tensor) -> torch.Tensor:
    """The rest of the layer: ``x + attn @ wo``, then RMSNorm and the SwiGLU MLP
    with its residual. ``attn [T, H_q, D]`` -> ``[T, H]``."""
    x = x + attn.reshape(x.shape[0], -1) @ w.wo
    h = rms_norm(x, w.mlp_norm, shape.rms_eps)
    gate, up = (h @ w.w_gate_up).chunk(2, dim=-1)
    return x + (F.silu(gate) * up) @ w.w_down


def decoder_layer(shape: ModelShape, w: LayerWeights, x: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, slots: torch.Tensor, metadata, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, backend: str, num_splits: Optional[int]) -> torch.Tensor:
    """One layer on ``x [T, H]``: write K/V of the T tokens at ``slots``, then attend.

    ``cos, sin [T, D/2]``: the tokens' RoPE rows (`RopeTable.at`).
    ``k_cache, v_cache``: this layer's ``[num_pages, P, H_kv, D]``.
    ``slots [T]``: int64, already clamped into the layer's slots.
    ``metadata`` (an `fa3_spec.FA3Metadata` or `fa3_spec.CascadeMetadata`)
    says which keys each query reads; the K/V just written are among them.

    The two dense parts are nested compile regions (`attention_inputs`,
    `attention_output_and_mlp`): under ``torch.compile`` every layer of the
    model, and the draft's layer of the same shapes, reuses one compiled body
    of each, so compile time does not grow with depth. The cache write and
    the attention sit between them, traced inline: a region must not mutate
    its inputs (torch 2.11's functionalization refuses a mutating custom op
    inside one), and the metadata differs per forward. Eagerly all of it is
    plain calls.
    """
    q, k, v = attention_inputs(shape, w, x, cos, sin)
    store_kv(k_cache, v_cache, slots, k, v)
    attn = cascade_attention(q, k_cache, v_cache, metadata, backend=backend,
                             num_splits=num_splits)
    return attention_output_and_mlp(shape, w, x, attn)


def _layer_slots(kv: "KVCache", slots: torch.Tensor) -> torch.Tensor:
    return slots.to(torch.int64).clamp(0, kv.slots_per_layer - 1)


@dataclasses.dataclass
class LlamaTarget:
    """Llama-architecture target model (see the module docstring).

    ``embed [V, H]``; ``lm_head [H, V]`` (``x @ w``, as the layers: a tied
    checkpoint gets a transposed copy of its embedding); ``rope``: the
    model's table.
    """

    shape: ModelShape
    embed: torch.Tensor  # [V, H]
    layers: List[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [H, V]
    rope: RopeTable

    @classmethod
    def random(cls, shape: ModelShape, *, seed: int = 0, dtype=torch.float32,
               device="cpu") -> "LlamaTarget":
        """Random weights made on ``device`` (deterministic given ``seed`` and device)."""
        g = torch.Generator(device=device).manual_seed(seed)
        h, vocab = shape.hidden_size, shape.vocab_size
        embed = torch.randn(vocab, h, generator=g, device=device, dtype=torch.float32).to(dtype)
        layers = [LayerWeights.random(shape, g, dtype=dtype, device=device)
                  for _ in range(shape.num_layers)]
        lm_head = (torch.randn(h, vocab, generator=g, device=device, dtype=torch.float32)
                   * shape.logit_scale * h ** -0.5).to(dtype)
        return cls(shape, embed, layers, torch.ones(h, device=device, dtype=dtype), lm_head,
                   RopeTable.create(shape, dtype=dtype, device=device))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                metadata, kv: KVCache, *, backend: str = "auto",
                num_splits: Optional[int] = None) -> torch.Tensor:
        """``tokens, positions, slots [T]`` -> last layer output ``[T, H]`` (pre-norm)."""
        x = self.embed[tokens.to(torch.int64).clamp(0, self.shape.vocab_size - 1)]
        cos, sin = self.rope.at(positions)
        slots = _layer_slots(kv, slots)
        for i, w in enumerate(self.layers):
            x = decoder_layer(self.shape, w, x, cos, sin, slots, metadata, kv.k[i], kv.v[i],
                              backend, num_splits)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, H] -> [T, V]`` in the model dtype."""
        return rms_norm(hidden, self.norm, self.shape.rms_eps) @ self.lm_head


@dataclasses.dataclass
class EagleDraft:
    """EAGLE draft head: ``fc`` ``[2H, H]``, one decoder layer, its own final norm;
    embedding, lm_head and RoPE table are the target's tensors (shared, not copied)."""

    shape: ModelShape
    fc: torch.Tensor  # [2H, H]: rows 0..H-1 take embed(token), rows H..2H-1 the hidden
    layer: LayerWeights
    norm: torch.Tensor  # [H]
    embed: torch.Tensor  # shared with the target
    lm_head: torch.Tensor  # shared with the target
    rope: RopeTable  # shared with the target

    @classmethod
    def random(cls, target: LlamaTarget, *, seed: int = 1) -> "EagleDraft":
        """Independent random weights: proposals are almost always rejected."""
        shape, dev, dtype = target.shape, target.embed.device, target.embed.dtype
        g = torch.Generator(device=dev).manual_seed(seed)
        h = shape.hidden_size
        fc = (torch.randn(2 * h, h, generator=g, device=dev, dtype=torch.float32)
              * (2 * h) ** -0.5).to(dtype)
        return cls(shape, fc, LayerWeights.random(shape, g, dtype=dtype, device=dev),
                   torch.ones(h, device=dev, dtype=dtype), target.embed, target.lm_head,
                   target.rope)

    @classmethod
    def derived(cls, target: LlamaTarget, *, mix: float = 0.0, noise: float = 0.0,
                seed: int = 1) -> "EagleDraft":
        """A draft from the target's own layer 0 (see the module docstring)."""
        shape, dev, dtype = target.shape, target.embed.device, target.embed.dtype
        h = shape.hidden_size
        eye = torch.eye(h, device=dev, dtype=dtype)
        fc = torch.cat([(1.0 - mix) * eye, mix * eye], 0)
        layer = target.layers[0].clone()
        if noise > 0:
            g = torch.Generator(device=dev).manual_seed(seed)
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                t = getattr(layer, name)
                eps = torch.randn(t.shape, generator=g, device=dev, dtype=torch.float32)
                setattr(layer, name, t + (noise * t.float().std() * eps).to(dtype))
        return cls(shape, fc, layer, target.norm.clone(), target.embed, target.lm_head,
                   target.rope)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, metadata, kv: KVCache, *, backend: str = "auto",
                num_splits: Optional[int] = None) -> torch.Tensor:
        """``tokens [T]``, ``hidden [T, H]`` (target or previous draft feature) -> ``[T, H]``."""
        e = self.embed[tokens.to(torch.int64).clamp(0, self.shape.vocab_size - 1)]
        x = torch.cat([e, hidden.to(e.dtype)], -1) @ self.fc
        cos, sin = self.rope.at(positions)
        return decoder_layer(self.shape, self.layer, x, cos, sin, _layer_slots(kv, slots),
                             metadata, kv.k[0], kv.v[0], backend, num_splits)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.norm, self.shape.rms_eps) @ self.lm_head


class SpecModel(Protocol):
    """What the loop needs from a target + draft pair.

    ``*_forward`` write the K/V of their ``T`` tokens at ``slots`` into the
    given cache (every layer) and attend as ``metadata`` says; hidden states
    are ``[T, hidden_size]`` and logits ``[T, vocab_size]``. Everything must
    trace under ``torch.compile(fullgraph=True)`` and capture in a CUDA graph.

    Optional: ``draft_vocab_size``, the tokens the draft head proposes from
    (a reduced-vocabulary head); ``vocab_size`` when absent. `EagleEngine`
    refuses a ``topk`` above it.
    """

    hidden_size: int
    vocab_size: int
    num_kv_heads: int
    head_dim: int
    num_target_layers: int
    num_draft_layers: int
    dtype: torch.dtype
    max_positions: int  # longest context the model's RoPE covers

    def target_forward(self, tokens, positions, slots, metadata, kv, *, backend,
                       num_splits=None) -> torch.Tensor: ...

    def target_logits(self, hidden) -> torch.Tensor: ...

    def draft_forward(self, tokens, hidden, positions, slots, metadata, kv, *, backend,
                      num_splits=None) -> torch.Tensor: ...

    def draft_logits(self, hidden) -> torch.Tensor: ...


@dataclasses.dataclass
class EagleModels:
    """`SpecModel` for a `LlamaTarget` and an `EagleDraft`."""

    target: LlamaTarget
    draft: EagleDraft

    @property
    def hidden_size(self) -> int:
        return self.target.shape.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.target.shape.vocab_size

    @property
    def num_kv_heads(self) -> int:
        return self.target.shape.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.target.shape.head_dim

    @property
    def num_target_layers(self) -> int:
        return len(self.target.layers)

    @property
    def num_draft_layers(self) -> int:
        return 1

    @property
    def dtype(self) -> torch.dtype:
        return self.target.embed.dtype

    @property
    def max_positions(self) -> int:
        return self.target.rope.max_positions

    def target_forward(self, tokens, positions, slots, metadata, kv, *, backend="auto",
                       num_splits=None):
        return self.target.forward(tokens, positions, slots, metadata, kv, backend=backend,
                                   num_splits=num_splits)

    def target_logits(self, hidden):
        return self.target.logits(hidden)

    def draft_forward(self, tokens, hidden, positions, slots, metadata, kv, *, backend="auto",
                      num_splits=None):
        return self.draft.forward(tokens, hidden, positions, slots, metadata, kv,
                                  backend=backend, num_splits=num_splits)

    def draft_logits(self, hidden):
        return self.draft.logits(hidden)


def make_models(preset: str = "tiny", *, draft: str = "derived", alpha: float = 0.05,
                mix: float = 0.0, noise: float = 0.0, seed: int = 0, dtype=None,
                device="cpu", num_layers: Optional[int] = None) -> EagleModels:
    """A target of ``preset`` and an EAGLE draft head.

    Args:
        preset: a key of `PRESETS`.
        draft: ``"derived"`` (agrees with the target most of the time; ``alpha``,
            ``mix`` and ``noise`` control how often, see the module docstring)
            or ``"random"`` (independent weights, mostly rejected).
        alpha: residual scale of target layers ``1 .. L-1`` (derived draft only;
            1.0 leaves the target untouched).
        dtype: default float64 on CPU, bfloat16 on CUDA.
        num_layers: override the preset's target depth (e.g. fewer layers for a
            quick 8B-shaped check).
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    if draft not in ("derived", "random"):
        raise ValueError(f"draft must be 'derived' or 'random', got {draft!r}")
    shape = PRESETS[preset]
    if num_layers is not None:
        shape = dataclasses.replace(shape, num_layers=num_layers)
    if dtype is None:
        dtype = torch.float64 if torch.device(device).type == "cpu" else torch.bfloat16
    target = LlamaTarget.random(shape, seed=seed, dtype=dtype, device=device)
    if draft == "random":
        return EagleModels(target, EagleDraft.random(target, seed=seed + 1))
    for w in target.layers[1:]:
        w.wo.mul_(alpha)
        w.w_down.mul_(alpha)
    return EagleModels(target, EagleDraft.derived(target, mix=mix, noise=noise, seed=seed + 1))
