"""A run's outputs against plain greedy decoding: identical, or apart only from near ties.

The verify forward runs its GEMMs and attention at other shapes than one-token
greedy decoding, so in bf16 the two round differently; where greedy's choice
was a near tie, the run may take the other token, and the two go on
differently from there. A request that differs is explained when its first
differing token is a near tie in the greedy reference's logits ``x`` at that
position::

    |x[greedy's token] - x[the run's token]| <= NEAR_TIE * max(1, |top-1 logit|)

2 % of the top logit, a few bf16 ulps of it (a gap of 0 is an exact bf16 tie).
Float64 runs are identical to greedy decoding.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch

#: The near-tie bound, relative to ``max(1, |top-1 logit|)``.
NEAR_TIE = 0.02

#: The rule in words (the CLI prints it and writes it to its JSON).
NEAR_TIE_RULE = (f"|logit(greedy's token) - logit(the run's token)| <= {NEAR_TIE} * "
                 "max(1, |top-1 logit|), in greedy's logits at the first differing token")


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Where one request's output first leaves greedy decoding's.

    ``tokens``: ``(the run's, greedy's)`` at ``position``, None where one
    output ends there and the other goes on. ``gap``: greedy's logit of its
    own token minus its logit of the run's token (None without two tokens in
    the vocabulary); ``bound``: ``NEAR_TIE * max(1, |top-1 logit|)``.
    """

    request: int
    position: int
    run_len: int
    greedy_len: int
    tokens: Optional[Tuple[int, int]]
    gap: Optional[float]
    bound: Optional[float]
    near_tie: bool


def compare_with_greedy(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]],
                        logits: Sequence[torch.Tensor]) -> List[Divergence]:
    """One `Divergence` per request whose output differs from greedy decoding's.

    Args:
        outputs: the run's tokens per request.
        reference: greedy decoding's tokens per request (`greedy_generate`).
        logits: greedy decoding's logits per step, ``[B, V]`` each (step 0
            after the prompt): what `greedy_generate` puts in ``logits_out``.
    """
    found = []
    for i, (got, want) in enumerate(zip(outputs, reference)):
        if list(got) == list(want):
            continue
        shared = min(len(got), len(want))
        j = next((t for t in range(shared) if got[t] != want[t]), shared)
        tokens = gap = bound = None
        if j < shared:
            tokens = (int(got[j]), int(want[j]))
            row = logits[j][i]
            bound = NEAR_TIE * max(1.0, abs(float(row.max())))
            if all(0 <= t < row.numel() for t in tokens):
                gap = float(row[tokens[1]] - row[tokens[0]])
        found.append(Divergence(i, j, len(got), len(want), tokens, gap, bound,
                                near_tie=gap is not None and abs(gap) <= bound))
    return found
