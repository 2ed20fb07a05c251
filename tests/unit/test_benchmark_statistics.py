"""The median's distribution-free confidence interval that the benchmark reports."""

from __future__ import annotations

import math
import random

import pytest

from moe_recipes.statistics import median_interval


def _coverage(n: int, k: int) -> float:
    """Probability that [x_(k), x_(n-k+1)] of n draws covers the median."""
    return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2**n


@pytest.mark.parametrize("n", range(1, 40))
def test_interval_is_the_narrowest_reaching_the_confidence(n: int) -> None:
    values = [float(v) for v in range(1, n + 1)]
    random.Random(n).shuffle(values)  # the order the repeats came in does not matter
    bounds = median_interval(values)
    if n < 6:  # even the widest interval, min to max, covers the median less than 95%
        assert bounds is None and _coverage(n, 1) < 0.95
        return
    assert bounds is not None
    k = int(bounds[0])  # the values are their own ranks
    assert bounds == (float(k), float(n - k + 1))
    assert _coverage(n, k) >= 0.95
    assert k == n // 2 or _coverage(n, k + 1) < 0.95  # one rank further in falls short


def test_nine_repeats_take_the_second_smallest_and_second_largest() -> None:
    ratios = [1.054, 1.076, 1.004, 1.183, 1.017, 1.044, 1.158, 1.070, 1.101]
    assert median_interval(ratios) == (1.017, 1.158)
    # 50%: the third from either end (82% coverage; the fourth would give 49%).
    assert median_interval(ratios, confidence=0.5) == (1.044, 1.101)


@pytest.mark.parametrize("confidence", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_confidence_outside_the_open_unit_interval_is_refused(confidence: float) -> None:
    with pytest.raises(ValueError, match="confidence="):
        median_interval([1.0] * 10, confidence)
