"""Boundary checks, all in one place: Python ints, shapes, dtypes, devices.

Every check reads only Python-visible facts (``ndim``, ``shape``, ``dtype``,
``device``, Python ints), so under ``torch.compile`` it runs at trace time
and leaves nothing in the graph. Problems raise `TypeError` (wrong kind or
dtype) or `ValueError` (wrong value or shape), naming the argument.

Under ``torch.compile(fullgraph=True)`` an exception raised while tracing
reaches the caller as ``torch._dynamo.exc.Unsupported`` (a `RuntimeError`)
whose message contains the original one. To get the typed error, validate
outside the compiled region: build a `fa3_spec.SpecBatch` there (as an
engine does once per batch) and pass it in.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

INDEX_DTYPES = (torch.int32, torch.int64)

#: Largest sliding-window side accepted (``window_left``, ``window_size``
#: entries): a window at least as long as a call's key bound already reads
#: every key, so nothing larger means more, and int64 arithmetic on a value
#: this size (positions minus the window) cannot overflow.
MAX_WINDOW = 2**62


# ------------------------------------------------------------------ Python ints
def int_at_least(name: str, value: object, minimum: int) -> int:
    """``value`` must be a Python int (not bool) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def positive_int(name: str, value: object) -> int:
    return int_at_least(name, value, 1)


def window_side(name: str, value: object, minimum: int) -> int:
    """A sliding-window side: an int in ``[minimum, MAX_WINDOW]``."""
    return int_in_range(name, value, minimum, MAX_WINDOW,
                        " (a window past the context already reads every key)")


def int_in_range(name: str, value: object, low: int, high: int, why: str = "") -> int:
    """``low <= value <= high`` (a Python int)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}]{why}, got {value}")
    return value


# --------------------------------------------------------------------- tensors
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
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")
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


def per_request(name: str, value: object, bs: int) -> torch.Tensor:
    """An int tensor ``[B]`` (one entry per request)."""
    t = tensor(name, value, ndim=1)
    if t.shape[0] != bs:
        raise ValueError(f"{name} has {t.shape[0]} entries but the batch has {bs}")
    return t


# ------------------------------------------------------------ the batch inputs
def request_triple(cfg, req_to_token: object, req_pool_indices: object,
                   seq_lens: object) -> int:
    """Validate the three inputs every builder takes; return ``B``."""
    r2t = tensor("req_to_token", req_to_token, ndim=2)
    rpi = tensor("req_pool_indices", req_pool_indices, ndim=1)
    bs = rpi.shape[0]
    per_request("seq_lens", seq_lens, bs)
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
    same_device(req_to_token=r2t, req_pool_indices=rpi, seq_lens=seq_lens)
    return bs


def draft_slots(cfg, out_cache_loc: object, bs: int) -> torch.Tensor:
    """``out_cache_loc`` (flat, ``[B, K, S]`` or ``[B*K, S]``) as ``[B*K, S]``."""
    loc = tensor("out_cache_loc", out_cache_loc)
    rows, steps = bs * cfg.topk, cfg.num_steps
    if loc.numel() != rows * steps or loc.dim() not in (1, 2, 3):
        raise ValueError(
            f"out_cache_loc must hold B*topk*num_steps = {bs}*{cfg.topk}*"
            f"{steps} = {rows * steps} slots (flat, [B, K, S] or [B*K, S]), "
            f"got shape {tuple(loc.shape)}"
        )
    if loc.dim() > 1 and loc.shape[-1] != steps:
        raise ValueError(
            f"out_cache_loc's last dimension must be num_steps={steps}, "
            f"got shape {tuple(loc.shape)}"
        )
    if loc.dim() == 3 and loc.shape[1] != cfg.topk:
        raise ValueError(
            f"out_cache_loc of shape [B, K, S] must have K = topk = {cfg.topk}, "
            f"got shape {tuple(loc.shape)}"
        )
    return loc.reshape(rows, steps)


def ancestor_slots(cfg, value: object, bs: int) -> torch.Tensor:
    """``ancestor_slots`` (int64 ``[B, K, d']`` or ``[B*K, d']``, ``d' >= 1``) as ``[B*K, d']``."""
    slots = tensor("ancestor_slots", value, dtypes=(torch.int64,))
    k = cfg.topk
    if slots.dim() == 3 and tuple(slots.shape[:2]) == (bs, k) or (
            slots.dim() == 2 and slots.shape[0] == bs * k):
        if slots.shape[-1] >= 1:
            return slots.reshape(bs * k, slots.shape[-1])
    raise ValueError(
        f"ancestor_slots must be [B, K, d'] = [{bs}, {k}, d'] or [B*K, d'] = [{bs * k}, d'] "
        f"with d' >= 1 (d' >= step + 1 at draft step `step`), got shape {tuple(slots.shape)}")


def tree_mask(value: object, bs: int, n: int) -> torch.Tensor:
    mask = tensor("tree_mask", value, ndim=3, dtypes=(torch.bool,))
    if tuple(mask.shape) != (bs, n, n):
        raise ValueError(
            f"tree_mask must have shape [B, N, N] = [{bs}, {n}, {n}], got {tuple(mask.shape)}"
        )
    return mask


# ------------------------------------------------------------------ audited calls
def call_arguments(name: str, value: object) -> tuple:
    """``(args, kwargs)`` of an audited call: ``value`` is a tuple/list of
    positional arguments or a dict of keyword arguments (str keys)."""
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{name}: keyword argument names must be str, got {bad[0]!r}")
        return (), dict(value)
    if isinstance(value, (tuple, list)):
        return tuple(value), {}
    raise TypeError(f"{name} must be a tuple/list of positional arguments or a dict of "
                    f"keyword arguments, got {type(value).__name__}")


def same_call_layout(name: str, value: object, like: object) -> None:
    """``value`` has the pytree structure of ``like``, tensors of equal shapes,
    dtypes and devices (only values may differ)."""
    from torch.utils import _pytree

    leaves, spec = _pytree.tree_flatten(value)
    ref_leaves, ref_spec = _pytree.tree_flatten(like)
    if spec != ref_spec:
        raise ValueError(f"{name} must have the structure of example: {spec} vs {ref_spec}")
    for i, (a, b) in enumerate(zip(leaves, ref_leaves)):
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"{name}: leaf {i} must be a tensor, got {type(a).__name__}")
            if (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device):
                raise ValueError(
                    f"{name}: leaf {i} is {tuple(a.shape)} {a.dtype} on {a.device}, example has "
                    f"{tuple(b.shape)} {b.dtype} on {b.device} (variants change values only)")
