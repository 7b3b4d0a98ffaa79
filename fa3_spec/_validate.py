"""Boundary checks: shapes, dtypes and devices, never tensor values.

Every check here reads only Python-visible facts (``ndim``, ``shape``,
``dtype``, ``device``), so under ``torch.compile`` it runs at trace time and
leaves nothing in the graph. Problems raise `TypeError` (wrong kind or dtype)
or `ValueError` (wrong shape), with the argument's name in the message.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .config import SpecConfig

INDEX_DTYPES = (torch.int32, torch.int64)


def tensor(
    name: str,
    value: object,
    *,
    ndim: Optional[int] = None,
    dtypes: Sequence[torch.dtype] = INDEX_DTYPES,
) -> torch.Tensor:
    """Check that ``value`` is a tensor of one of ``dtypes`` with ``ndim`` dims."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {value.dtype}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(
            f"{name} must be {ndim}-D, got shape {tuple(value.shape)}"
        )
    return value


def same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            raise ValueError(
                f"{name} is on {dev} but {first_name} is on {first}; "
                "all inputs must share one device"
            )


def batch(
    cfg: SpecConfig,
    req_to_token: object,
    req_pool_indices: object,
    seq_lens: object,
) -> int:
    """Validate the per-batch inputs every builder takes; return ``B``."""
    if not isinstance(cfg, SpecConfig):
        raise TypeError(f"cfg must be a SpecConfig, got {type(cfg).__name__}")
    r2t = tensor("req_to_token", req_to_token, ndim=2)
    rpi = tensor("req_pool_indices", req_pool_indices, ndim=1)
    sl = tensor("seq_lens", seq_lens, ndim=1)
    bs = rpi.shape[0]
    if sl.shape[0] != bs:
        raise ValueError(
            f"seq_lens has {sl.shape[0]} entries but req_pool_indices has {bs}"
        )
    if bs > cfg.max_bs:
        raise ValueError(f"batch size {bs} exceeds max_bs={cfg.max_bs}")
    if r2t.shape[0] < 1:
        raise ValueError("req_to_token must have at least one row")
    if r2t.shape[1] < cfg.min_row_len:
        raise ValueError(
            f"req_to_token rows have {r2t.shape[1]} columns but the config "
            f"needs at least max_context_len + max(num_steps - 1, "
            f"num_draft_tokens) = {cfg.min_row_len}"
        )
    same_device(req_to_token=r2t, req_pool_indices=rpi, seq_lens=sl)
    return bs
