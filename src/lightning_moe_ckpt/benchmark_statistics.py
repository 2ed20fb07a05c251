"""How far a benchmark's median ratio can be trusted: a distribution-free confidence interval.

``recipes/bench.py`` pairs each policy's run with the ``none`` run of the same repeat and
reports the median of the per-repeat ratios. On shared cores a single ratio moves by several
percent between repeats, so the median alone cannot say whether a policy is within a bound
such as 1.03x. :func:`median_interval` gives the interval that holds the true median with at
least the asked confidence whatever the ratios' distribution (the sign-test interval: two
order statistics, chosen from the binomial distribution of how many ratios fall below the
median). It needs no assumption of normality, which the occasional slow repeat breaks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def median_interval(values: Sequence[float], confidence: float = 0.95
                    ) -> tuple[float, float] | None:
    """The narrowest order-statistic interval ``(low, high)`` covering the median of the
    distribution ``values`` were drawn from with probability at least ``confidence``; None
    when there are too few values for any interval to reach it (fewer than 6 at 95%)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} must lie strictly between 0 and 1")
    ordered = sorted(values)
    n = len(ordered)
    # [x_(k), x_(n-k+1)] misses the median when fewer than k values lie below it or fewer
    # than k above it: probability 2 * P(Binomial(n, 1/2) <= k - 1).
    below = 0.0  # P(Binomial(n, 1/2) <= k - 1)
    best = None
    for k in range(1, n // 2 + 1):
        below += math.comb(n, k - 1) / 2**n
        if 1.0 - 2.0 * below < confidence:
            break
        best = k
    if best is None:
        return None
    return ordered[best - 1], ordered[n - best]
