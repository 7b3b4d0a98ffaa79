"""What a forward mode is: the interface each builder module implements once.

A mode's module (``builders/decode.py``, ``draft.py``, ``verify.py``,
``extend.py``) defines one `Mode` subclass that holds everything the library
knows about that mode: the batch inputs it takes and requires, its builder,
its sliding-window builder, which tokens of a request's own row its
request-level call reads, and its value checks. `fa3_spec.modes.MODES` lists
the modes; ``build_metadata``, ``error_flags``, the audit and the CLI look a
mode up there and call it, with no switch over mode names anywhere. Adding a
mode is one module plus one entry in that table.

Every method has the same shape for every mode (``step`` is the draft step,
0 for modes that have none), so callers never ask which mode they hold.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..batch import SpecBatch
from ..config import SpecConfig, check_config
from ..metadata import Metadata
from ..paged import BatchView


class Mode:
    """One forward mode.

    Attributes:
        name: the mode's name (its key in `fa3_spec.MODES`).
        inputs: the batch inputs the mode takes beyond the request triple
            (``req_to_token``, ``req_pool_indices``, ``seq_lens``).
        per_step: True when the metadata depends on the draft ``step``.
        required_when: the condition under which `required` inputs are
            required, for error messages (e.g. ``"topk > 1"``); empty: always.
    """

    name: str = ""
    inputs: Tuple[str, ...] = ()
    per_step: bool = False
    required_when: str = ""

    # ---------------------------------------------------------------- inputs
    def required(self, cfg: SpecConfig) -> Tuple[str, ...]:
        """The extra inputs that must not be None under ``cfg`` (default: all)."""
        return self.inputs

    def unused(self, cfg: SpecConfig) -> Tuple[str, ...]:
        """Extra inputs the mode accepts but does not read under ``cfg``; they
        are dropped before validation (default: none)."""
        return ()

    def queries_per_request(self, cfg: SpecConfig) -> int:
        """Queries each request contributes (a static bound where it varies)."""
        raise NotImplementedError

    def batch(self, cfg: SpecConfig, *, step: int = 0, **kwargs) -> SpecBatch:
        """Validate the builder keywords of this mode into a `SpecBatch`.

        Unknown keywords raise `TypeError`; a missing required input raises
        `ValueError`; ``step`` is checked for per-step modes.
        """
        allowed = {"req_to_token", "req_pool_indices", "seq_lens", *self.inputs}
        extra = {k for k, v in kwargs.items() if k not in allowed and v is not None}
        if extra:
            raise TypeError(f"mode {self.name!r} takes no {sorted(extra)}")
        cfg = check_config(cfg)
        dropped = self.unused(cfg)
        batch = SpecBatch.create(cfg, **{k: v for k, v in kwargs.items()
                                         if k in allowed and k not in dropped})
        self.check(batch, step)
        return batch

    def check(self, batch: SpecBatch, step: int) -> None:
        """Raise if ``batch`` lacks a required input or ``step`` is out of range."""
        cfg = batch.cfg
        batch.require(*self.required(cfg), mode=self.name, condition=self.required_when)
        if self.per_step:
            cfg.check_step(step)

    # ------------------------------------------------------------- metadata
    def build(self, batch: SpecBatch, step: int) -> Metadata:
        """The mode's metadata on a validated ``batch``."""
        raise NotImplementedError

    def window(self, batch: SpecBatch, step: int, window_left: int) -> Metadata:
        """The metadata of a sliding-window layer with left window ``window_left``
        (validated), exact in every key set (`fa3_spec.builders.window`)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- checks
    def read_length(self, batch: SpecBatch, view: BatchView, step: int) -> torch.Tensor:
        """int64 ``[B]``: the request-level call reads positions ``t < length``
        of each request's own ``req_to_token`` row (what checked mode inspects)."""
        raise NotImplementedError

    def flags(self, batch: SpecBatch, view: BatchView, step: int,
              num_pages: Optional[int]) -> torch.Tensor:
        """int32 scalar: the `fa3_spec.checks.ErrorFlag` bits of the mode's own
        inputs (beyond the request triple and the row the request-level call
        reads, which `fa3_spec.error_flags` checks for every mode)."""
        return torch.zeros((), dtype=torch.int32, device=view.seq_lens.device)

    def __repr__(self) -> str:
        return f"Mode({self.name!r})"
