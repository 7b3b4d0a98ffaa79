"""Pearson's chi-square goodness-of-fit test and its power, in torch (no scipy).

Shared by the sampling distribution tests (`test_sampling.py`, the loop's in
`test_eagle_sampling.py`). Cells of zero probability are not bins: a draw in
one is a support violation and fails the test outright. Cells whose expected
count is below `MIN_EXPECTED` are pooled into one bin (the textbook rule for
the chi-square approximation); a pooled bin still short of it joins the
smallest regular bin.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

MIN_EXPECTED = 5.0


class ChiSquare(NamedTuple):
    stat: float
    df: int
    p_value: float
    critical: float  # reject when stat > critical
    alpha: float
    support_violations: int  # draws in cells of zero probability

    @property
    def rejects(self) -> bool:
        return self.support_violations > 0 or self.stat > self.critical


def chi2_sf(x: float, df: int) -> float:
    """P(chi2_df > x): the regularised upper incomplete gamma Q(df/2, x/2)."""
    if x <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def chi2_critical(df: int, alpha: float) -> float:
    """The ``1 - alpha`` quantile of chi2_df (bisection on `chi2_sf`)."""
    lo, hi = 0.0, df + 20.0 * math.sqrt(2 * df) + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


def ncx2_sf(x: float, df: int, lam: float) -> float:
    """P(noncentral chi2(df, lam) > x), as a Poisson(lam/2) mixture of central ones."""
    if lam <= 0:
        return chi2_sf(x, df)
    half = lam / 2
    top = int(half + 12 * math.sqrt(half) + 60)
    j = torch.arange(top + 1, dtype=torch.float64)
    log_w = j * math.log(half) - half - torch.lgamma(j + 1)
    q = torch.special.gammaincc((df + 2 * j) / 2, torch.full_like(j, x / 2))
    return float((log_w.exp() * q).sum())


def bins_for(probs: torch.Tensor, n: int) -> torch.Tensor:
    """Bin of each cell (int64, ``-1`` for zero-probability cells) for ``n`` draws."""
    expected = probs.double() * n
    positive = probs > 0
    small = positive & (expected < MIN_EXPECTED)
    big = positive & ~small
    bins = torch.full(probs.shape, -1, dtype=torch.int64)
    bins[big] = torch.arange(int(big.sum()))
    pooled = int(big.sum())
    bins[small] = pooled
    if small.any() and expected[small].sum() < MIN_EXPECTED and big.any():
        smallest = torch.where(big, expected, float("inf")).argmin()
        bins[small] = bins[smallest]
    return bins


def chi_square(counts: torch.Tensor, probs: torch.Tensor, alpha: float) -> ChiSquare:
    """Test observed ``counts`` (per cell) against the cell ``probs`` at level ``alpha``."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    n = int(counts.sum())
    bins = bins_for(probs, n)
    violations = int(counts[bins < 0].sum())
    nb = int(bins.max()) + 1
    obs = torch.zeros(nb, dtype=torch.float64).index_add_(0, bins[bins >= 0], counts[bins >= 0])
    exp = torch.zeros(nb, dtype=torch.float64).index_add_(0, bins[bins >= 0], probs[bins >= 0] * n)
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = max(nb - 1, 1)
    return ChiSquare(stat, df, chi2_sf(stat, df), chi2_critical(df, alpha), alpha, violations)


def power(probs: torch.Tensor, alt: torch.Tensor, n: int, alpha: float) -> float:
    """Power of `chi_square` (``n`` draws, level ``alpha``) against a sampler whose
    exact cell distribution is ``alt``: 1 if ``alt`` puts mass where ``probs`` has
    none (one draw there in ``n`` with probability ``1 - (1 - mass)^n``, taken as 1
    past 1 - 1e-12), else the noncentral chi-square approximation with
    ``lam = n * sum_bins (alt_b - p_b)^2 / p_b``."""
    probs, alt = probs.double().flatten(), alt.double().flatten()
    bins = bins_for(probs, n)
    outside = float(alt[bins < 0].sum())
    nb = int(bins.max()) + 1
    p = torch.zeros(nb, dtype=torch.float64).index_add_(0, bins[bins >= 0], probs[bins >= 0])
    q = torch.zeros(nb, dtype=torch.float64).index_add_(0, bins[bins >= 0], alt[bins >= 0])
    lam = n * float(((q - p) ** 2 / p).sum())
    df = max(nb - 1, 1)
    central = ncx2_sf(chi2_critical(df, alpha), df, lam)
    return max(central, 1.0 - (1.0 - outside) ** n)
