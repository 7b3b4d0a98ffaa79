"""Log-sum-exp merge of two partial attention results (plain torch ops)."""

from __future__ import annotations

import torch


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
        (e^(l_a - m) + e^(l_b - m))``, ``m = max(l_a, l_b)``. A query empty on
        both sides gets output 0 and LSE ``-inf``, never NaN. Traces to
        elementwise ops that inductor fuses into one kernel.
    """
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, 0.0)
    w_a = torch.exp(lse_a - m)  # exp(-inf) = 0
    w_b = torch.exp(lse_b - m)
    denom = w_a + w_b
    safe = torch.where(denom > 0, denom, 1.0)
    w_a = (w_a / safe).transpose(0, 1).unsqueeze(-1)  # [total_q, H, 1]
    w_b = (w_b / safe).transpose(0, 1).unsqueeze(-1)
    dtype = torch.promote_types(out_a.dtype, torch.float32)  # float64 stays float64
    out = out_a.to(dtype) * w_a.to(dtype) + out_b.to(dtype) * w_b.to(dtype)
    lse = torch.where(denom > 0, m + torch.log(safe), float("-inf"))
    return out.to(out_a.dtype), lse
