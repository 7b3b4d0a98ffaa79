"""A trained head in the published EAGLE-3 layout, the one SpecForge exports and
sglang's and vLLM's EAGLE-3 loaders read as it is:

* ``config.json``: ``architectures: ["LlamaForCausalLMEagle3"]``, the target's
  Llama numbers (one hidden layer), ``draft_vocab_size``,
  ``tie_word_embeddings: false``, the target's ``max_position_embeddings`` and
  RoPE, and ``eagle_config.eagle_aux_hidden_state_layer_ids`` (layer
  *outputs*: the head's auxiliary layer inputs minus one);
* ``model.safetensors``: ``fc.weight``, ``midlayer.*``, ``norm.weight``,
  ``lm_head.weight``, ``d2t``, ``t2d``, and no ``embed_tokens`` (the target's).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Dict, Optional

import torch
from safetensors.torch import save_file

from .head import Eagle3Head

__all__ = ["ARCHITECTURE", "EXPORTED_NAMES", "head_config", "head_state_dict", "save_head"]

#: The architecture name the published EAGLE-3 loaders dispatch on.
ARCHITECTURE = "LlamaForCausalLMEagle3"

#: Exported tensor name of each `Eagle3Head` parameter.
EXPORTED_NAMES = {
    "fc": "fc.weight",
    "input_layernorm": "midlayer.input_layernorm.weight",
    "hidden_norm": "midlayer.hidden_norm.weight",
    "q_proj": "midlayer.self_attn.q_proj.weight",
    "k_proj": "midlayer.self_attn.k_proj.weight",
    "v_proj": "midlayer.self_attn.v_proj.weight",
    "o_proj": "midlayer.self_attn.o_proj.weight",
    "post_attention_layernorm": "midlayer.post_attention_layernorm.weight",
    "gate_proj": "midlayer.mlp.gate_proj.weight",
    "up_proj": "midlayer.mlp.up_proj.weight",
    "down_proj": "midlayer.mlp.down_proj.weight",
    "norm": "norm.weight",
    "lm_head": "lm_head.weight",
}

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def head_config(head: Eagle3Head, dtype: torch.dtype) -> dict:
    """The head's ``config.json`` (module docstring)."""
    s = head.shape
    config = dict(
        architectures=[ARCHITECTURE], model_type="llama", hidden_act="silu",
        hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim, num_hidden_layers=1, rms_norm_eps=s.rms_eps,
        max_position_embeddings=s.max_position_embeddings, rope_theta=s.rope_theta,
        vocab_size=s.vocab_size, draft_vocab_size=int(head.lm_head.shape[0]),
        target_hidden_size=s.hidden_size, tie_word_embeddings=False,
        torch_dtype=_DTYPE_NAMES[dtype],
        eagle_config=dict(eagle_aux_hidden_state_layer_ids=[a - 1 for a in head.aux_layers],
                          use_aux_hidden_state=True))
    if s.rope_scaling is not None:
        r = s.rope_scaling
        config["rope_scaling"] = dict(rope_type="llama3", factor=r.factor,
                                      low_freq_factor=r.low_freq_factor,
                                      high_freq_factor=r.high_freq_factor,
                                      original_max_position_embeddings=(
                                          r.original_max_position_embeddings))
    return config


def head_state_dict(head: Eagle3Head, dtype: Optional[torch.dtype] = None
                    ) -> Dict[str, torch.Tensor]:
    """The exported tensors (contiguous CPU copies; matrices in ``dtype``,
    default the head's)."""
    out = {}
    for attr, name in EXPORTED_NAMES.items():
        t = getattr(head, attr).detach()
        out[name] = t.to(device="cpu", dtype=dtype or t.dtype).contiguous()
    out["d2t"] = head.d2t.detach().to("cpu", torch.int64).contiguous()
    out["t2d"] = head.t2d.detach().to("cpu", torch.bool).contiguous()
    return out


def save_head(head: Eagle3Head, directory: os.PathLike, *,
              dtype: torch.dtype = torch.bfloat16) -> pathlib.Path:
    """Write ``config.json`` and ``model.safetensors`` into ``directory``
    (created); each file is written to a temporary name and renamed, so an
    interrupted save never leaves a half-written head."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(_DTYPE_NAMES)}, got {dtype!r}")
    d = pathlib.Path(directory).expanduser()
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / "model.safetensors.tmp"
    save_file(head_state_dict(head, dtype), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, d / "model.safetensors")
    tmp = d / "config.json.tmp"
    tmp.write_text(json.dumps(head_config(head, dtype), indent=2) + "\n")
    os.replace(tmp, d / "config.json")
    return d
