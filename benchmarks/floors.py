"""The roofs a loop iteration is held against: the GPU's measured read
bandwidth and matmul throughput, and the bytes and FLOPs one forward needs.

A floor is bytes over bandwidth (or FLOPs over throughput): the time the
forward could not beat on this GPU. Both roofs are measured in the same
process as the loop they bound.
"""

from __future__ import annotations

import dataclasses

import torch

from fa3_spec.eagle import Eagle3Draft

import timing


def read_bandwidth() -> float:
    """TB/s of a streaming reduction over a 4 GiB buffer (CUDA graph replays)."""
    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda").view(torch.float32)
    x.fill_(1.0)
    out = torch.empty((), device="cuda")
    ms = timing.replay_ms(lambda: torch.sum(x, 0, out=out), reps=20)
    return x.numel() * 4 / (ms * 1e-3) / 1e12


def matmul_throughput(n: int = 8192, dtype=torch.bfloat16) -> float:
    """Dense TFLOP/s of one ``[n, n] @ [n, n]`` matmul (cuBLAS), replayed as a
    graph: the compute roof the loop's large-batch rows are held against."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    out = torch.empty(n, n, device="cuda", dtype=dtype)
    ms = timing.replay_ms(lambda: torch.mm(a, b, out=out), reps=20, inner=4)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def _fields(w) -> list:
    """A weights dataclass's fields, the tensors themselves (``dataclasses.astuple``
    would deep-copy them: gigabytes on the device)."""
    return [getattr(w, f.name) for f in dataclasses.fields(w)]


def forward_bytes(models, batch: int, context: int) -> dict:
    """Bytes one forward must read: ``target`` (every layer's matrices, the
    final norm and the lm_head, plus its K/V at ``context`` for ``batch``
    requests) and ``draft`` (the draft layer, ``fc``, norm and the lm_head,
    read again by every draft forward, plus one layer's K/V)."""
    t, d = models.target, models.draft
    size = lambda ts: sum(x.numel() * x.element_size() for x in ts if x is not None)  # noqa: E731
    layer = lambda w: size(_fields(w))  # noqa: E731
    kv_layer = 2 * batch * context * models.num_kv_heads * models.head_dim * t.embed.element_size()
    target = sum(layer(w) for w in t.layers) + size([t.norm, t.lm_head]) + t.shape.num_layers * kv_layer
    draft = layer(d.layer) + size([d.fc, d.norm, d.lm_head]) + kv_layer
    return dict(target=target, draft=draft)


def forward_flops(models, spec, batch: int, context: int) -> dict:
    """Matmul FLOPs of one (a) iteration and of one (c) decode step at
    ``batch`` requests of ``context`` keys, counted as the compiled graphs
    run them (padding rows included): ``2 * in * out`` per token and weight
    matrix, ``4 * keys * H_q * D`` per query and layer for attention.

    (a): the target verify over ``B * N`` tokens (lm_head included); each of
    the ``S - 1`` draft decode steps over ``B * K`` leaves (the draft layer,
    the lm_head, and ``fc`` where the draft applies it on every forward, as
    EAGLE-1's does; EAGLE-3's applies it once, in ``draft_input``); the draft
    extend over its ``B * N`` query rows (layer and ``fc``) and the lm_head of
    the ``B`` last rows. (c): ``B`` tokens through the target. The matmul
    count is exact (tested against ``FlopCounterMode``); the attention term is
    an estimate: every query over ``context`` keys (``context + S`` in a draft
    step), ignoring the tree's own keys and the growth of ``seq_len``.
    """
    t, d = models.target, models.draft
    sh = t.shape

    def mats(ws):
        return sum(2 * w.shape[0] * w.shape[1] for w in ws
                   if isinstance(w, torch.Tensor) and w.dim() == 2)

    def attn(keys):
        return 4 * keys * sh.num_heads * sh.head_dim

    layer = lambda w: mats(_fields(w))  # noqa: E731
    target_tok = sum(layer(w) for w in t.layers) + mats([t.lm_head])
    fc = mats([d.fc])
    draft_body = layer(d.layer) + (0 if isinstance(d, Eagle3Draft) else fc)
    extend_body = layer(d.layer) + fc
    draft_head = mats([d.lm_head])
    n, k, s = spec.num_draft_tokens, spec.topk, spec.num_steps
    a_mm = (batch * n * target_tok + (s - 1) * batch * k * (draft_body + draft_head)
            + batch * n * extend_body + batch * draft_head)
    a_attn = (batch * n * sh.num_layers * attn(context) + (s - 1) * batch * k * attn(context + s)
              + batch * n * attn(context))
    c_mm, c_attn = batch * target_tok, batch * sh.num_layers * attn(context)
    return dict(a=a_mm + a_attn, c=c_mm + c_attn, a_matmul=a_mm, c_matmul=c_mm)
