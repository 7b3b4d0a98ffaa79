"""The models the EAGLE loop drives: a Llama-style target and an EAGLE draft head.

Plain torch, no ``nn.Module`` state beyond weight tensors, so a whole
iteration traces with ``torch.compile(fullgraph=True)``. Every attention goes
through `fa3_spec.cascade_attention` on fa3_spec metadata, and every K/V
write through the ``fa3_spec::store_kv`` op (on CUDA a layer's write goes
through ``fa3_spec::rope_store_kv``: RoPE and the write in one kernel).

* `LlamaTarget`: embedding, ``L`` decoder layers (RMSNorm, RoPE at the
  positions the caller gives, GQA attention, SwiGLU MLP), final RMSNorm,
  lm_head. ``forward`` returns the last layer's output before the final norm
  (the feature EAGLE feeds its draft head); ``logits`` applies norm + lm_head.
  With ``capture`` it also hands out the residual stream at chosen layers
  (what EAGLE-3 reads).
* `EagleDraft`: one decoder layer fed ``fc([embed(token); hidden])``, sharing
  the target's embedding and lm_head (EAGLE-1/2's draft head; the published
  heads' bias, missing norms and post-norm input are fields).
* `Eagle3Draft`: EAGLE-3's head: ``fc`` over three target layers' states, one
  layer attending over ``[embed; hidden]``, its own norm and lm_head over a
  reduced vocabulary mapped back to target ids by ``d2t``.
* `SpecModel`: the protocol the loop drives; `EagleModels` implements it for
  the classes above. An engine can plug in its own model by providing the
  same members.
* `Llama3RopeScaling`: ``rope_scaling`` of type ``"llama3"``, applied by
  `RopeTable.create` (the one place RoPE frequencies are made).

Checkpoints load through `fa3_spec.eagle.checkpoint` (`from_pretrained`),
into the same layout, through `LayerWeights.from_projections`.

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
import math
from typing import List, Optional, Protocol, Tuple, Union

import torch

from ..attention import fa3_plans, provider_plans, resolve_attention_backend
from ..attention.kv_store import store_kv
from .gemm import matmul
from .layer import LayerWeights, layer_output, rms_norm
from .regions import REGION_COMPILE_BACKENDS, decoder_layer_region
from .vocab import log_prob_topk


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency scaling (``rope_scaling`` of type ``"llama3"``).

    Frequencies whose wavelength ``2 pi / f`` exceeds
    ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``; those shorter than ``... / high_freq_factor`` are kept; the
    ones in between are interpolated linearly in
    ``original_max_position_embeddings / wavelength``.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        old = self.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor
                                                           - self.low_freq_factor)
        mid = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        out = torch.where(wavelen > old / self.low_freq_factor, inv_freq / self.factor, mid)
        return torch.where(wavelen < old / self.high_freq_factor, inv_freq, out)


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
    rope_scaling: Optional[Llama3RopeScaling] = None  # None: plain RoPE


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
        if shape.rope_scaling is not None:
            inv_freq = shape.rope_scaling.apply(inv_freq)
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


def decoder_layer(shape: ModelShape, w: LayerWeights, x: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, slots: torch.Tensor, metadata, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, attention_backend: str, num_splits: Optional[int],
                  attn_in: Optional[torch.Tensor] = None,
                  regions: Optional[str] = None) -> torch.Tensor:
    """One layer on ``x [T, H]``: write K/V of the T tokens at ``slots``, then attend.

    ``attn_in``: what the attention reads when it is not ``x`` (the EAGLE-3
    draft layer's ``[embed; hidden]``, ``[T, 2H]``); ``x`` stays the residual.

    ``cos, sin [T, D/2]``: the tokens' RoPE rows (`RopeTable.at`).
    ``k_cache, v_cache``: this layer's ``[num_pages, P, H_kv, D]``.
    ``slots [T]``: int64, already clamped into the layer's slots.
    ``metadata`` (an `fa3_spec.FA3Metadata` or `fa3_spec.CascadeMetadata`)
    says which keys each query reads; the K/V just written are among them.

    ``regions``: None traces the layer inline; a ``torch.compile`` backend
    name (`fa3_spec.eagle.regions.REGION_COMPILE_BACKENDS`) runs it, inside an
    enclosing compile, as a ``fa3_spec_eagle::decoder_layer_first`` op (a
    layer whose input is ``x`` as given; the forward's later layers are
    ``decoder_layer``), whose
    layer is compiled once with that backend and reused by every layer of the
    same program (the models' ``compile_regions`` field). The same numbers
    under ``eager`` and ``aot_eager``; under inductor the program's fused
    kernels round as inductor's inline code does, not bit for bit alike.
    """
    return layer_output(*decoder_layer_region(shape, w, x, (), attn_in, cos, sin, slots,
                                              metadata, k_cache, v_cache, attention_backend, num_splits,
                                              regions))


def normed_rows(hidden: torch.Tensor, norm: Optional[torch.Tensor], eps: float,
                rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RMSNorm of ``hidden [T, H]`` (none if ``norm`` is None), then its int64
    ``rows [R]`` if given (``[R, H]``; a row outside ``[0, T)`` is clamped
    into it, so no value of ``rows`` reads out of range).

    The norm runs over all ``T`` rows and the gather reads its output, not the
    other way round: the norm is row-wise, so the numbers are those of
    ``rms_norm(hidden[rows])``, but a gather read inside the norm's reduction
    kernel is what inductor failed to compile with a size-oblivious batch
    (``CantSplit``). The extra rows cost one
    pass over ``[T, H]``.
    """
    out = hidden if norm is None else rms_norm(hidden, norm, eps)
    return out if rows is None else out[rows.clamp(0, out.shape[0] - 1)]


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
    compile_regions: Optional[str] = None  # `decoder_layer`'s ``regions``: None = inline

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
                metadata, kv: KVCache, *, attention_backend: str = "auto",
                num_splits: Optional[int] = None,
                capture: Tuple[int, ...] = ()) -> torch.Tensor:
        """``tokens, positions, slots [T]`` -> last layer output ``[T, H]`` (pre-norm).

        ``capture``: layer indices ``i`` (static) whose input, the residual
        stream after layer ``i - 1`` (``i = 0``: the embeddings; ``i = L``:
        the last layer's output), is returned too, as EAGLE-3 reads it:
        then the result is ``[T, (1 + len(capture)) H]``, the last layer's
        output followed by the captured states in ``capture`` order.
        """
        x = self.embed[tokens.to(torch.int64).clamp(0, self.shape.vocab_size - 1)]
        cos, sin = self.rope.at(positions)
        slots = _layer_slots(kv, slots)
        plans = None
        if (len(self.layers) > 1 and resolve_attention_backend(attention_backend, x.device) == "fa3"
                and provider_plans()):
            # On FA3, one scheduler plan per call shared by the layers, where the
            # provider plans (fa3_plans): the outputs are the same bit for bit.
            plans = fa3_plans(metadata, num_heads=self.shape.num_heads,
                              head_dim=self.shape.head_dim, k_cache=kv.k[0], v_cache=kv.v[0],
                              num_splits=num_splits)
        captured, deltas = {}, ()
        for i, w in enumerate(self.layers):
            # x comes back as this layer's input (the stream summed): what capture reads.
            x, *deltas = decoder_layer_region(self.shape, w, x, deltas, None, cos, sin, slots,
                                              metadata, kv.k[i], kv.v[i], attention_backend, num_splits,
                                              self.compile_regions, plans)
            if i in capture:
                captured[i] = x
        if deltas:
            x = layer_output(x, *deltas)
        if not capture:
            return x
        captured[len(self.layers)] = x
        return torch.cat([x] + [captured[i] for i in capture], -1)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.norm, self.shape.rms_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, H] -> [T, V]`` in the model dtype (the first ``H`` columns of a
        ``capture`` result are the last layer's output)."""
        return matmul(self.final_norm(hidden[..., : self.shape.hidden_size]), self.lm_head)


@dataclasses.dataclass
class EagleDraft:
    """EAGLE-1/2 draft head: ``fc`` ``[2H, H]``, one decoder layer, its own final norm;
    embedding, lm_head and RoPE table are the target's tensors (shared, not copied).

    A published EAGLE-1/2 head (`fa3_spec.eagle.checkpoint`) differs from the
    random and derived heads made here in four ways, each a field: ``fc``
    has a bias (``fc_bias``), its layer has no ``input_layernorm``
    (``layer.attn_norm`` is None), there is no final norm (``norm`` is None:
    logits are ``hidden @ lm_head``), and it reads the target's hidden state
    *after* the target's final norm (``normed_target``), as sglang's EAGLE
    worker hands it over. Derived and random heads read it before.
    """

    shape: ModelShape
    fc: torch.Tensor  # [2H, H]: rows 0..H-1 take embed(token), rows H..2H-1 the hidden
    layer: LayerWeights
    norm: Optional[torch.Tensor]  # [H], or None: no final norm
    embed: torch.Tensor  # shared with the target
    lm_head: torch.Tensor  # shared with the target
    rope: RopeTable  # shared with the target
    fc_bias: Optional[torch.Tensor] = None  # [H]
    normed_target: bool = False  # reads the target's post-norm hidden state
    compile_regions: Optional[str] = None  # `decoder_layer`'s ``regions``: None = inline

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
                slots: torch.Tensor, metadata, kv: KVCache, *, attention_backend: str = "auto",
                num_splits: Optional[int] = None) -> torch.Tensor:
        """``tokens [T]``, ``hidden [T, H]`` (target or previous draft feature) -> ``[T, H]``."""
        e = self.embed[tokens.to(torch.int64).clamp(0, self.shape.vocab_size - 1)]
        x = matmul(torch.cat([e, hidden.to(e.dtype)], -1), self.fc)
        if self.fc_bias is not None:
            x = x + self.fc_bias
        cos, sin = self.rope.at(positions)
        return decoder_layer(self.shape, self.layer, x, cos, sin, _layer_slots(kv, slots),
                             metadata, kv.k[0], kv.v[0], attention_backend, num_splits,
                             regions=self.compile_regions)

    def input_from_target(self, target: "LlamaTarget", hidden: torch.Tensor) -> torch.Tensor:
        """The target's last-layer output ``[T, H]`` as this head reads it."""
        return target.final_norm(hidden) if self.normed_target else hidden

    def logits(self, hidden: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[T, H] -> [T, V]`` (``[R, V]`` for the int64 ``rows [R]`` of
        ``hidden``: `normed_rows`)."""
        return matmul(normed_rows(hidden, self.norm, self.shape.rms_eps, rows), self.lm_head)

    def topk(self, hidden: torch.Tensor, k: int,
             rows: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``[T, H]`` -> the ``k`` best tokens of each row (of each of ``rows``):
        float32 log-probabilities and int64 ids."""
        return log_prob_topk(self.logits(hidden, rows), k)


@dataclasses.dataclass
class Eagle3Draft:
    """EAGLE-3 draft head (the layout sglang's ``llama_eagle3.py`` loads).

    Inputs: the target's residual stream at three of its layers
    (``aux_layers``, `LlamaTarget.forward`'s ``capture``), concatenated
    ``[T, 3H]`` and projected by ``fc`` to ``[T, H]`` (`input_from_target`);
    in later draft steps, the draft's own output ``[T, H]`` instead. One
    decoder layer whose attention reads ``[input_layernorm(embed(token));
    hidden_norm(hidden)]`` (``[T, 2H]``, so ``layer.wqkv`` is ``[2H, ...]``
    and ``layer.attn_norm`` is None) and whose residual is ``hidden``
    (``hidden_norm(hidden)`` with ``norm_before_residual``); the rest is a
    Llama layer (``layer.mlp_norm`` is its ``post_attention_layernorm``).
    The output is the pre-norm residual stream; logits are
    ``norm(hidden) @ lm_head`` over the draft vocabulary ``V_d``, and
    draft token ``j`` is target token ``d2t[j]``. The embedding is the
    target's; the RoPE table is the draft's own (its config's theta and
    scaling, as many rows as the target's).
    """

    shape: ModelShape
    fc: torch.Tensor  # [3H, H]
    embed_norm: torch.Tensor  # [H] input_layernorm, on the token embedding
    hidden_norm: torch.Tensor  # [H]
    layer: LayerWeights
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [H, V_d]
    d2t: torch.Tensor  # int64 [V_d]: target token id of each draft token
    embed: torch.Tensor  # shared with the target
    rope: RopeTable
    aux_layers: Tuple[int, ...]  # target layers whose input fc reads (low, middle, high)
    fc_bias: Optional[torch.Tensor] = None  # [H]
    norm_before_residual: bool = False
    compile_regions: Optional[str] = None  # `decoder_layer`'s ``regions``: None = inline

    def input_from_target(self, target: "LlamaTarget", features: torch.Tensor) -> torch.Tensor:
        """`LlamaTarget.forward`'s ``[T, 4H]`` (captures of ``aux_layers``) -> ``[T, H]``."""
        x = matmul(features[..., target.shape.hidden_size:].to(self.fc.dtype), self.fc)
        return x if self.fc_bias is None else x + self.fc_bias

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, metadata, kv: KVCache, *, attention_backend: str = "auto",
                num_splits: Optional[int] = None) -> torch.Tensor:
        """``tokens [T]``, ``hidden [T, H]`` (`input_from_target`, or the previous
        draft output) -> ``[T, H]``, the pre-norm residual stream."""
        eps = self.shape.rms_eps
        e = self.embed[tokens.to(torch.int64).clamp(0, self.embed.shape[0] - 1)]
        hidden = hidden.to(e.dtype)
        normed = rms_norm(hidden, self.hidden_norm, eps)
        attn_in = torch.cat([rms_norm(e, self.embed_norm, eps), normed], -1)
        residual = normed if self.norm_before_residual else hidden
        cos, sin = self.rope.at(positions)
        return decoder_layer(self.shape, self.layer, residual, cos, sin, _layer_slots(kv, slots),
                             metadata, kv.k[0], kv.v[0], attention_backend, num_splits, attn_in=attn_in,
                             regions=self.compile_regions)

    def logits(self, hidden: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[T, H] -> [T, V_d]``: logits over the draft vocabulary (``[R, V_d]``
        for the int64 ``rows [R]`` of ``hidden``: `normed_rows`)."""
        return matmul(normed_rows(hidden, self.norm, self.shape.rms_eps, rows), self.lm_head)

    def topk(self, hidden: torch.Tensor, k: int,
             rows: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` best draft tokens of each row (of each of ``rows``):
        float32 log-probabilities (over ``V_d``) and their *target* token ids
        (through ``d2t``)."""
        logp, idx = log_prob_topk(self.logits(hidden, rows), k)
        return logp, self.d2t[idx]


class SpecModel(Protocol):
    """What the loop needs from a target + draft pair.

    ``*_forward`` write the K/V of their ``T`` tokens at ``slots`` into the
    given cache (every layer) and attend as ``metadata`` says. The target's
    output (its *features*, ``[T, F]``) is opaque to the loop: it goes to
    ``target_logits`` (``[T, vocab_size]``) and, through ``draft_input``, to
    the draft (``[T, hidden_size]``; EAGLE-3's features carry three layers'
    hidden states besides the last). The draft's outputs are ``[T,
    hidden_size]``; ``draft_topk`` gives its ``k`` best proposals as target
    token ids (a reduced draft vocabulary is mapped back here) with their
    log-probabilities; with int64 ``rows [R]`` it scores only those rows
    (``[R, k]``, the numbers of ``draft_topk(hidden[rows], k)``; the draft
    extend passes them, so a model must accept the argument). Everything
    must trace under ``torch.compile(fullgraph=True)`` and capture in a CUDA
    graph.

    Optional: ``draft_vocab_size``, the tokens the draft head proposes from
    (a reduced-vocabulary head such as EAGLE-3's ``V_d``, the width of
    ``draft_logits``); ``vocab_size`` when absent. `EagleEngine` refuses a
    ``topk`` above it. ``with_compile_regions(compile_backend) -> SpecModel``: the
    same model running its layers as compiled regions of ``compile_backend`` (None:
    inline); `EagleEngine` calls it with the engine's compile backend when
    the regions are on (``compile_regions=True``, or the default under
    inductor; `EagleModels.with_compile_regions`); a model without it is
    compiled as it is.
    """

    hidden_size: int
    vocab_size: int
    num_kv_heads: int
    head_dim: int
    num_target_layers: int
    num_draft_layers: int
    dtype: torch.dtype
    max_positions: int  # longest context the model's RoPE covers

    def target_forward(self, tokens, positions, slots, metadata, kv, *, attention_backend,
                       num_splits=None) -> torch.Tensor: ...

    def target_logits(self, hidden) -> torch.Tensor: ...

    def draft_forward(self, tokens, hidden, positions, slots, metadata, kv, *, attention_backend,
                      num_splits=None) -> torch.Tensor: ...

    def draft_logits(self, hidden) -> torch.Tensor: ...

    def draft_input(self, features) -> torch.Tensor: ...

    def draft_topk(self, hidden, k: int,
                   rows: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]: ...


@dataclasses.dataclass
class EagleModels:
    """`SpecModel` for a `LlamaTarget` and an `EagleDraft` or `Eagle3Draft`.

    With an `Eagle3Draft` the target's features are ``[T, 4H]`` (its last
    layer output, then the draft's ``aux_layers`` captures); otherwise the
    last layer output ``[T, H]``.
    """

    target: LlamaTarget
    draft: Union[EagleDraft, Eagle3Draft]

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
    def draft_vocab_size(self) -> int:
        """Tokens the draft proposes from: an `Eagle3Draft`'s reduced vocabulary
        ``V_d`` (its ``d2t`` entries), else the target's ``vocab_size``."""
        d2t = getattr(self.draft, "d2t", None)
        return self.vocab_size if d2t is None else int(d2t.shape[0])

    @property
    def capture(self) -> Tuple[int, ...]:
        """Target layers whose input the draft reads besides the last output."""
        return getattr(self.draft, "aux_layers", ())

    def with_compile_regions(self, compile_backend: Optional[str]) -> "EagleModels":
        """The same models (weights shared, not copied) whose layers run as
        compiled regions of ``compile_backend`` (one of
        `fa3_spec.eagle.regions.REGION_COMPILE_BACKENDS`) or inline (None); see
        `decoder_layer`. Eagerly both are the same calls."""
        if compile_backend is not None and compile_backend not in REGION_COMPILE_BACKENDS:
            raise ValueError(f"compile_backend must be None or one of {REGION_COMPILE_BACKENDS}, "
                             f"got {compile_backend!r}")
        return EagleModels(dataclasses.replace(self.target, compile_regions=compile_backend),
                           dataclasses.replace(self.draft, compile_regions=compile_backend))

    @property
    def max_positions(self) -> int:
        return self.target.rope.max_positions

    def target_forward(self, tokens, positions, slots, metadata, kv, *, attention_backend="auto",
                       num_splits=None):
        return self.target.forward(tokens, positions, slots, metadata, kv,
                                   attention_backend=attention_backend,
                                   num_splits=num_splits, capture=self.capture)

    def target_logits(self, hidden):
        return self.target.logits(hidden)

    def draft_forward(self, tokens, hidden, positions, slots, metadata, kv, *,
                      attention_backend="auto",
                      num_splits=None):
        return self.draft.forward(tokens, hidden, positions, slots, metadata, kv,
                                  attention_backend=attention_backend, num_splits=num_splits)

    def draft_logits(self, hidden):
        """Logits over the draft's vocabulary (EAGLE-3: ``V_d``, see `draft_topk`)."""
        return self.draft.logits(hidden)

    def draft_input(self, features):
        """Target features (of `target_forward`) -> the draft's input ``[T, H]``."""
        return self.draft.input_from_target(self.target, features)

    def draft_topk(self, hidden, k: int, rows: Optional[torch.Tensor] = None):
        """``[T, H]`` -> ``(logp float32 [T, k], token ids int64 [T, k])``, target
        ids; with int64 ``rows [R]``, those rows' ``[R, k]`` only (the same
        numbers as ``draft_topk(hidden[rows], k)``; `normed_rows`)."""
        return self.draft.topk(hidden, k, rows)


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

    The ``alpha`` scaling is of this function's own random target only: a
    loaded one (`fa3_spec.eagle.from_pretrained`) is never modified, and its
    ``"derived"`` draft is `EagleDraft.derived` (a copy of layer 0).
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
