"""One Llama decoder layer: its weights and its math, on plain tensors.

The one implementation of the layer, shared by the inline path
(`fa3_spec.eagle.models.decoder_layer`) and the compiled regions
(`fa3_spec.eagle.regions`). ``shape`` arguments are anything with the
`LayerShape` fields (a `fa3_spec.eagle.ModelShape` is one).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..attention import cascade_attention
from .gemm import matmul
from .rope_kv import rope_and_store


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """The static numbers one layer reads (`ModelShape` has them too)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float


@dataclasses.dataclass
class LayerWeights:
    """One Llama decoder layer, matrices ``[in, out]`` (``x @ w``), with the
    projections that read the same input fused into one matrix each.

    ``wqkv`` columns: the ``H_q`` query heads, then the ``H_kv`` key heads,
    then the ``H_kv`` value heads (``D`` columns each). ``w_gate_up``
    columns: the ``I`` gate columns, then the ``I`` up columns. Why ``[in,
    out]``: cuBLAS streams the target's GEMMs a little faster as ``x @ w``
    than as ``F.linear`` on ``[out, in]`` (the kernel benchmark compares
    them); on CUDA the layers multiply through
    `fa3_spec.eagle.gemm.matmul`, a Triton kernel at up to 16 rows.
    Build one with `from_projections`,
    the one conversion from Hugging Face's separate ``[out, in]``
    projections (random presets and checkpoint loaders both go through it).

    ``attn_norm`` is None for a layer whose attention reads its input as
    given: layer 0 of a published EAGLE-1/2 head (no ``input_layernorm``)
    and the EAGLE-3 draft layer, which normalises its two halves itself
    (`Eagle3Draft`).
    """

    attn_norm: Optional[torch.Tensor]  # [H], or None: no norm before attention
    wqkv: torch.Tensor  # [H, (H_q + 2 H_kv) * D]
    wo: torch.Tensor  # [H_q * D, H]
    mlp_norm: torch.Tensor  # [H]
    w_gate_up: torch.Tensor  # [H, 2 I]
    w_down: torch.Tensor  # [I, H]

    @classmethod
    def from_projections(cls, *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         o: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                         down: torch.Tensor, attn_norm: Optional[torch.Tensor],
                         mlp_norm: torch.Tensor) -> "LayerWeights":
        """Fuse and transpose separate ``[out, in]`` projections (``q_proj`` ...
        ``down_proj`` of a Hugging Face Llama layer) into this layout (new,
        contiguous tensors; the inputs are not modified). ``attn_norm``
        (``input_layernorm``) may be None (see the class docstring)."""
        return cls(None if attn_norm is None else attn_norm.clone(),
                   torch.cat([q, k, v], 0).t().contiguous(),
                   o.t().contiguous(), mlp_norm.clone(), torch.cat([gate, up], 0).t().contiguous(),
                   down.t().contiguous())

    @classmethod
    def random(cls, shape: LayerShape, g: torch.Generator, *, dtype, device) -> "LayerWeights":
        h, d, i = shape.hidden_size, shape.head_dim, shape.intermediate_size

        def w(n_out, n_in):
            x = torch.randn(n_out, n_in, generator=g, device=device, dtype=torch.float32)
            return (x * n_in ** -0.5).to(dtype)

        ones = torch.ones(h, device=device, dtype=dtype)
        return cls.from_projections(
            q=w(shape.num_heads * d, h), k=w(shape.num_kv_heads * d, h),
            v=w(shape.num_kv_heads * d, h), o=w(h, shape.num_heads * d),
            gate=w(i, h), up=w(i, h), down=w(h, i), attn_norm=ones, mlp_norm=ones)

    def as_list(self) -> List[torch.Tensor]:
        """``[wqkv, wo, mlp_norm, w_gate_up, w_down]``, then ``attn_norm`` if any
        (how a compiled region takes them, `fa3_spec.eagle.regions`)."""
        out = [self.wqkv, self.wo, self.mlp_norm, self.w_gate_up, self.w_down]
        return out if self.attn_norm is None else out + [self.attn_norm]

    @classmethod
    def from_list(cls, weights: List[torch.Tensor]) -> "LayerWeights":
        """Inverse of `as_list`."""
        wqkv, wo, mlp_norm, w_gate_up, w_down, *attn_norm = weights
        return cls(attn_norm[0] if attn_norm else None, wqkv, wo, mlp_norm, w_gate_up, w_down)

    def clone(self) -> "LayerWeights":
        return LayerWeights(*(None if t is None else t.clone()
                              for t in (getattr(self, f.name) for f in dataclasses.fields(self))))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def attention_inputs(shape: LayerShape, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """``x [T, H_in]`` -> ``qkv [T, H_q + 2 H_kv, D]``: RMSNorm (unless
    ``w.attn_norm`` is None) and the fused QKV projection, viewed per head,
    before RoPE (`fa3_spec.eagle.rope_kv` rotates it and writes K/V)."""
    h = x if w.attn_norm is None else rms_norm(x, w.attn_norm, shape.rms_eps)
    # One view of the fused output (`rope_kv` then splits it along the heads):
    # the strides of reshaping each part, without a reshape's layout check over
    # T (which guards a symbolic batch against 1 when T is the batch, a chain's draft).
    return matmul(h, w.wqkv).view(x.shape[0], shape.num_heads + 2 * shape.num_kv_heads,
                                  shape.head_dim)


def mlp(shape: LayerShape, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """The SwiGLU MLP branch of ``x [T, H]`` (RMSNorm first), without its residual."""
    gate, up = matmul(rms_norm(x, w.mlp_norm, shape.rms_eps), w.w_gate_up).chunk(2, dim=-1)
    return matmul(F.silu(gate) * up, w.w_down)


def layer_body(shape: LayerShape, w: LayerWeights, x: torch.Tensor,
               deltas: Sequence[torch.Tensor], attn_in: Optional[torch.Tensor],
               cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, metadata,
               k_cache: torch.Tensor, v_cache: torch.Tensor, attention_backend: str,
               num_splits: Optional[int],
               plans: Optional[tuple] = None
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer, its residual stream carried as ``x`` plus unsummed ``deltas``.

    The layer's input is ``x`` plus each of ``deltas`` (none, or the previous
    layer's two, added left to right). Returns ``(x_in, attn_out,
    mlp_out)``: that input (``x`` itself when ``deltas`` is empty), the
    attention branch after its output projection, and the MLP branch. The
    layer's output is ``(x_in + attn_out) + mlp_out``, which the next layer
    adds as its ``deltas``: every sum of the stream is then a pointwise add
    that inductor fuses into the RMSNorm after it, and no matmul's result is
    added to a tensor a compiled region returns (inductor makes such an add
    an ``addmm``, which copies the addend into the output before the GEMM:
    one device-to-device copy per layer, `fa3_spec.eagle.regions`).
    ``plans``: FA3 scheduler plans the forward's layers share
    (`fa3_spec.attention.fa3_plans`), or None. Shapes and the other
    arguments: `fa3_spec.eagle.models.decoder_layer`.
    """
    for d in deltas:
        x = x + d
    qkv = attention_inputs(shape, w, x if attn_in is None else attn_in)
    q = rope_and_store(k_cache, v_cache, slots, qkv, cos, sin, shape.num_heads)
    attn = cascade_attention(q, k_cache, v_cache, metadata, attention_backend=attention_backend,
                             num_splits=num_splits, plans=plans)
    attn_out = matmul(attn.reshape(x.shape[0], -1), w.wo)
    return x, attn_out, mlp(shape, w, x + attn_out)


def layer_output(x_in: torch.Tensor, attn_out: torch.Tensor, mlp_out: torch.Tensor) -> torch.Tensor:
    """The output of a layer from `layer_body`'s three parts, summed in the
    order the next layer sums them."""
    return x_in + attn_out + mlp_out
