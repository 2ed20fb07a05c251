"""How far a benchmark's median ratio can be trusted: a distribution-free confidence interval.

``recipes/bench.py`` pairs each policy's run with the ``none`` run of the same repeat and
reports the median of the per-repeat ratios. On shared cores a single ratio moves by several
percent between repeats, so the median alone cannot say whether a policy is within a bound
such as 1.03x. :func:`median_interval` gives the interval that holds the true median with at
least the asked confidence whatever the ratios' distribution (the sign-test interval: two
order statistics, chosen from the binomial distribution of how many ratios fall below the
median). It needs no assumption of normality, which the occasional slow repeat breaks.

Runs minutes apart still see the machine at different speeds. :func:`paired_block_ratios`
pairs within one run instead: a run with ``checkpoint.paired_blocks`` takes snapshots in
alternate blocks of steps, and each cycle of a block with and a block without them gives one
ratio, from steps seconds apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import groupby, pairwise
from statistics import fmean
from typing import Any

from lightning_moe_ckpt.errors import fmt, require


def require_paired_blocks(blocks: object) -> None:
    """Refuse a ``checkpoint.paired_blocks`` that is neither None (off) nor an integer >= 1."""
    require(blocks is None or (isinstance(blocks, int) and not isinstance(blocks, bool)
                               and blocks >= 1),
            f"{fmt('checkpoint.paired_blocks', blocks)} must be an integer >= 1 (steps per "
            "block; or null: a snapshot at every step the policy plans one)")


class PairedBlocks:
    """A window filter (``SparseCheckpointing.window_filter``) taking snapshots in
    alternate blocks of about ``blocks`` steps: a window is taken when its first step falls
    in an even block, so blocks switch only where a window starts and every window taken
    is whole."""

    def __init__(self, blocks: int) -> None:
        require_paired_blocks(blocks)
        self.blocks = blocks

    def __call__(self, plan: Any) -> bool:
        return bool((plan.iteration // self.blocks) % 2 == 0)


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


def paired_block_ratios(iteration_ms: Sequence[float], taken: Sequence[int],
                        settle: int = 2) -> list[float]:
    """Per cycle of a block of steps with snapshots and the block without them after it,
    the ratio of their mean iteration times.

    ``taken[i]`` says whether step ``i`` took a snapshot. Step ``i``'s time counts for the
    blocks with snapshots when both it and the step before took one (its own snapshot's
    issue, and the copy of the one before running behind it), for the blocks without when
    neither did; the steps of a switch, mixed, count for neither, nor do the first
    ``settle`` steps of each block, and an unfinished last cycle is dropped."""
    if len(iteration_ms) != len(taken):
        raise ValueError(f"{len(iteration_ms)} iteration times for {len(taken)} steps")
    # Step i: True (with snapshots), False (without) or None (a switch), then blocks of
    # consecutive steps alike.
    phases = [bool(taken[i]) if i and taken[i] == taken[i - 1] else None
              for i in range(len(taken))]
    blocks = [(phase, [iteration_ms[i] for i, _ in steps][settle:])
              for phase, steps in groupby(enumerate(phases), key=lambda item: item[1])
              if phase is not None]
    blocks = [(phase, times) for phase, times in blocks if times]
    ratios = []
    for (phase, times), (next_phase, next_times) in pairwise(blocks):
        if phase and not next_phase:
            ratios.append(fmean(times) / fmean(next_times))
    return ratios
