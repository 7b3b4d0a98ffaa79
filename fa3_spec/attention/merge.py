"""Log-sum-exp algebra of partial attention results (plain torch ops).

Attention over a key set ``S`` is ``o = sum_t e^(s_t - l) v_t`` with
``l = log sum_t e^(s_t)``. Two disjoint key sets merge exactly from their
``(o, l)`` pairs; an attention sink (a logit with a zero value vector) is one
more such set, with output 0 and LSE equal to the sink logit.
"""

from __future__ import annotations

import torch


def merge_float(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_attention_states` in float32 (float64 inputs stay float64): no
    rounding to the inputs' dtype."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, 0.0)
    w_a = torch.exp(lse_a - m)  # exp(-inf) = 0
    w_b = torch.exp(lse_b - m)
    denom = w_a + w_b
    safe = torch.where(denom > 0, denom, 1.0)
    w_a = (w_a / safe).transpose(0, 1).unsqueeze(-1)  # [total_q, H, 1]
    w_b = (w_b / safe).transpose(0, 1).unsqueeze(-1)
    dtype = torch.float64 if out_a.dtype == torch.float64 else torch.float32
    out = out_a.to(dtype) * w_a.to(dtype) + out_b.to(dtype) * w_b.to(dtype)
    lse = torch.where(denom > 0, m + torch.log(safe), float("-inf"))
    return out, lse


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets.

    Args:
        out_a, out_b: ``[total_q, H, D]``.
        lse_a, lse_b: float32 ``[H, total_q]`` (FA3's layout); ``-inf`` for a
            query that saw no key.

    Returns:
        ``(out, lse)`` with ``out = (o_a e^(l_a - m) + o_b e^(l_b - m)) /
        (e^(l_a - m) + e^(l_b - m))``, ``m = max(l_a, l_b)``, in ``out_a``'s
        dtype. A query empty on both sides gets output 0 and LSE ``-inf``,
        never NaN. Traces to elementwise ops that inductor fuses into one
        kernel.
    """
    out, lse = merge_float(out_a, lse_a, out_b, lse_b)
    return out.to(out_a.dtype), lse


def add_attention_sink(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add one sink logit per query head to the softmax denominator.

    The sink is a key with logit ``s_h`` (same units as the scaled, capped
    scores) and a zero value, so it only rescales:
    ``o' = o * e^l / (e^l + e^s)``, ``l' = log(e^l + e^s)``.

    Args:
        out: ``[total_q, H, D]`` attention over the real keys.
        lse: float32 ``[H, total_q]``; ``-inf`` for a query that saw no key.
        sinks: ``[H]`` sink logits (gpt-oss's learnable per-head sinks).

    Returns:
        ``(out', lse')``, ``out'`` float32 (float64 for float64 ``out``). A query with no key gets output 0
        and LSE ``s_h``. Apply it once, to the merged result of all calls: a
        sink merged from two calls would be counted twice.
    """
    dtype = torch.float64 if out.dtype == torch.float64 else torch.float32
    lse = lse.to(dtype)
    s = sinks.to(dtype)[:, None].expand_as(lse)
    new_lse = torch.logaddexp(lse, s)
    # e^l / (e^l + e^s): 0 when l = -inf; 0, not NaN, when l = s = -inf.
    scale = torch.where(torch.isneginf(new_lse), 0.0, torch.exp(lse - new_lse))
    return out.to(dtype) * scale.transpose(0, 1).unsqueeze(-1), new_lse
