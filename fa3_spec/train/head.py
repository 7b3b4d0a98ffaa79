"""A trainable EAGLE-3 head and its training-time test forward.

`Eagle3Head` holds the head's parameters in Hugging Face's names and layout
(``[out, in]`` projections), so that its state dict is the published layout
(`fa3_spec.train.export`) and `fa3_spec.eagle.Eagle3Draft` runs the same
weights in the loop. The target's embedding is frozen and shared.

Training-time test (EAGLE-3): step 0 reads the target's features; step ``k``
reads the head's own output of step ``k - 1``, as the draft does at depth
``k + 1`` of a tree. On a sequence, the query of step ``k`` at position ``p``
stands for a draft whose prefix ends at ``p - k``:

* its input is the token at ``p + 1`` and the head's step ``k - 1`` output at
  ``p - 1`` (the target's features at ``p`` for step 0);
* it attends step 0's keys at positions ``<= p - k`` (the prefix, drafted
  from the target's features) and step ``j``'s key at ``p - k + j`` for
  ``j = 1 .. k`` (its own ancestors, then itself);
* it predicts the token at ``p + 2``, whose target distribution is the
  target's at ``p + 1``.

Every position is its sequence position, RoPE included, as in the loop.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..eagle.layer import rms_norm
from ..eagle.models import LlamaTarget, RopeTable
from ..eagle.rope_kv import apply_rope
from .vocab import DraftVocab

__all__ = ["Eagle3Head", "default_aux_layers"]


def default_aux_layers(num_layers: int) -> Tuple[int, int, int]:
    """Target layer *inputs* the head reads: ``(2, L // 2, L - 3)``, the
    convention `fa3_spec.eagle.checkpoint` assumes when a head's config names
    none (its ``eagle_aux_hidden_state_layer_ids`` are these minus one:
    layer outputs)."""
    if num_layers < 7:
        raise ValueError(f"the default auxiliary layers (2, L // 2, L - 3) are three distinct, "
                         f"ordered layers from L = 7 on; got num_layers={num_layers} (pass "
                         "aux_layers)")
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Head(nn.Module):
    """An EAGLE-3 draft head for ``target`` over draft vocabulary ``vocab``.

    Parameters (``H`` hidden, ``D`` head dim, ``I`` MLP width, ``V_d`` draft
    vocabulary), named as they are exported: ``fc.weight [H, 3H]``;
    ``midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight
    [H]``; ``midlayer.self_attn.{q,k,v}_proj.weight [H_* D, 2H]`` and
    ``o_proj [H, H_q D]``; ``midlayer.mlp.{gate,up}_proj [I, H]``, ``down_proj
    [H, I]``; ``norm.weight [H]``; ``lm_head.weight [V_d, H]``. Buffers:
    ``d2t`` int64 ``[V_d]``, ``t2d`` bool ``[V]``.

    Initialised from the target where it can be: the lm_head from the
    target's rows of the draft tokens, the MLP and output projection from
    the target's last layer, ``fc`` reading the highest of the three features
    (so the untrained head starts as "the target's late residual stream, one
    more layer"); the rest small and random (``seed``).
    """

    def __init__(self, target: LlamaTarget, vocab: DraftVocab, *,
                 aux_layers: Optional[Sequence[int]] = None, seed: int = 0,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        s = target.shape
        h, d = s.hidden_size, s.head_dim
        vocab.check()
        if vocab.t2d.numel() != s.vocab_size:
            raise ValueError(f"vocab covers {vocab.t2d.numel()} target tokens, the target has "
                             f"{s.vocab_size}")
        self.shape = s
        self.aux_layers = tuple(default_aux_layers(s.num_layers) if aux_layers is None
                                else aux_layers)
        if len(self.aux_layers) != 3 or not all(1 <= a <= s.num_layers for a in self.aux_layers):
            raise ValueError(f"aux_layers must be three target layer inputs in 1..{s.num_layers}, "
                             f"got {self.aux_layers}")
        g = torch.Generator().manual_seed(seed)
        dev = target.embed.device

        def param(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t.detach().to(device=dev, dtype=dtype).clone())

        def rand(n_out: int, n_in: int) -> nn.Parameter:
            return param(torch.randn(n_out, n_in, generator=g) * (0.02 / math.sqrt(2.0)))

        last = target.layers[-1]  # `LayerWeights`, [in, out]
        fc = torch.zeros(h, 3 * h)
        fc[:, 2 * h:] = torch.eye(h)
        self.fc = param(fc)
        self.input_layernorm = param(torch.ones(h))
        self.hidden_norm = param(torch.ones(h))
        self.q_proj = rand(s.num_heads * d, 2 * h)
        self.k_proj = rand(s.num_kv_heads * d, 2 * h)
        self.v_proj = rand(s.num_kv_heads * d, 2 * h)
        self.o_proj = param(last.wo.t())
        self.post_attention_layernorm = param(last.mlp_norm)
        gate, up = last.w_gate_up.t().chunk(2, dim=0)
        self.gate_proj, self.up_proj = param(gate), param(up)
        self.down_proj = param(last.w_down.t())
        self.norm = param(target.norm)
        self.lm_head = param(target.lm_head.t()[vocab.ids.to(dev)])
        self.register_buffer("d2t", vocab.d2t.to(dev))
        self.register_buffer("t2d", vocab.t2d.to(dev))
        self.register_buffer("ids", vocab.ids.to(dev))
        self.embed = target.embed  # frozen, shared: never a parameter
        self.rope = RopeTable.create(s, dtype=dtype, device=dev)

    # ------------------------------------------------------------------ pieces
    def input_from_features(self, features: torch.Tensor) -> torch.Tensor:
        """``[..., 3H]`` target features (the three aux layer inputs) -> ``[..., H]``."""
        return F.linear(features.to(self.fc.dtype), self.fc)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` pre-norm output -> ``[..., V_d]`` draft-vocabulary logits."""
        return F.linear(rms_norm(hidden, self.norm, self.shape.rms_eps), self.lm_head)

    def _qkv(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        s = self.shape
        eps, d = s.rms_eps, s.head_dim
        e = self.embed[tokens.clamp(0, self.embed.shape[0] - 1)].to(hidden.dtype)
        attn_in = torch.cat([rms_norm(e, self.input_layernorm, eps),
                             rms_norm(hidden, self.hidden_norm, eps)], -1)
        b, t = tokens.shape
        q = F.linear(attn_in, self.q_proj).view(b * t, s.num_heads, d)
        k = F.linear(attn_in, self.k_proj).view(b * t, s.num_kv_heads, d)
        v = F.linear(attn_in, self.v_proj).view(b, t, s.num_kv_heads, d)
        cos, sin = self.rope.at(positions.reshape(-1))
        q = apply_rope(q, cos, sin).view(b, t, s.num_heads, d)
        k = apply_rope(k, cos, sin).view(b, t, s.num_kv_heads, d)
        return q, k, v

    def _rest(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = hidden + F.linear(attn, self.o_proj)
        h = rms_norm(x, self.post_attention_layernorm, self.shape.rms_eps)
        return x + F.linear(F.silu(F.linear(h, self.gate_proj)) * F.linear(h, self.up_proj),
                            self.down_proj)

    # ------------------------------------------------------------ the unrolled test
    def forward(self, tokens: torch.Tensor, features: torch.Tensor, steps: int,
                lengths: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        """Training-time test over a batch (module docstring).

        Args:
            tokens: int64 ``[B, T]``, the sequences (padding anywhere past
                ``lengths``).
            features: ``[B, T, 3H]``, the target's three aux layer inputs at
                every position.
            steps: how many draft steps to unroll (``>= 1``).
            lengths: int64 ``[B]`` real lengths (None: all ``T``); a key past
                its row's length is never attended.

        Returns one ``[B, T, V_d]`` logits tensor per step; step ``k``'s at
        position ``p`` predicts the token at ``p + 2`` (meaningful where
        ``k <= p <= length - 3``).
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        b, t = tokens.shape
        s = self.shape
        group = s.num_heads // s.num_kv_heads
        scale = s.head_dim ** -0.5
        pos = torch.arange(t, device=tokens.device)
        positions = pos.expand(b, t)
        real = (pos.unsqueeze(0) < (lengths if lengths is not None
                                    else torch.full((b,), t, device=tokens.device)).unsqueeze(1))
        nxt = torch.cat([tokens[:, 1:], tokens[:, :1]], 1)  # token at p + 1 (last: unused)
        hidden = self.input_from_features(features)
        keys: List[Tuple[torch.Tensor, torch.Tensor]] = []
        out = []
        for k in range(steps):
            if k > 0:  # the previous step's output at p - 1
                hidden = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], 1)
            q, key, val = self._qkv(nxt, hidden, positions)
            keys.append((key, val))
            qh = q.transpose(1, 2)  # [B, Hq, T, D]
            k0 = keys[0][0].repeat_interleave(group, 2).transpose(1, 2)
            v0 = keys[0][1].repeat_interleave(group, 2).transpose(1, 2)
            scores = torch.matmul(qh, k0.transpose(-1, -2)) * scale  # [B, Hq, Tq, Tk]
            prefix = (pos.unsqueeze(0) <= pos.unsqueeze(1) - k)  # key <= p - k
            allowed = prefix.unsqueeze(0) & real.unsqueeze(1)  # [B, Tq, Tk]
            scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
            diag, diag_v = [], []
            for j in range(1, k + 1):  # step j's key at p - k + j
                shift = k - j
                kj = keys[j][0].repeat_interleave(group, 2)
                vj = keys[j][1].repeat_interleave(group, 2)
                if shift:
                    kj = torch.cat([torch.zeros_like(kj[:, :shift]), kj[:, :-shift]], 1)
                    vj = torch.cat([torch.zeros_like(vj[:, :shift]), vj[:, :-shift]], 1)
                diag.append((q * kj).sum(-1).transpose(1, 2).unsqueeze(-1) * scale)  # [B,Hq,T,1]
                diag_v.append(vj.transpose(1, 2))  # [B, Hq, T, D]
            if diag:
                scores = torch.cat([scores] + diag, -1)
            probs = torch.softmax(scores.float(), -1).to(q.dtype)
            probs = torch.nan_to_num(probs)  # rows with no key (p < k): zeros
            attn = torch.matmul(probs[..., :t], v0)
            for j, vj in enumerate(diag_v):
                attn = attn + probs[..., t + j:t + j + 1] * vj
            attn = attn.transpose(1, 2).reshape(b, t, s.num_heads * s.head_dim)
            hidden = self._rest(hidden, attn)
            out.append(self.logits(hidden))
        return out
