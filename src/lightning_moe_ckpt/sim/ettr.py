"""ETTR of a policy over a run: the analytic expected trajectory and Monte-Carlo runs.

Analytic (paper §2.4 / Appendix C), failures a Poisson process of rate ``1 / MTBF``::

    ETTR = 1 / (1 + T_ckpt / (T_iter x interval)) x 1 / (1 + E[R] / MTBF)

For a policy whose parameters change after failures (MoC raising K) the analytic value
follows the expected trajectory: one cycle of ``MTBF`` working time plus ``E[R]`` per
failure, each cycle in the regime then in force; its mean overhead is the extra working
time per useful iteration over the run (the paper's "average per-iteration overhead",
which grows with MoC's K). Monte-Carlo runs the same renewal process with random
failures: working periods are exponential with mean MTBF (failures strike working time,
as the formula assumes), every recovery is drawn from the policy's recovery model, and a
run's ETTR is its useful time over its wall time. A failure trace (times in seconds)
replaces the exponential draws; a failure during a recovery restarts that recovery.
Results carry the mean and the spread over runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lightning_moe_ckpt.errors import require
from lightning_moe_ckpt.planning.intervals import ettr_formula

if TYPE_CHECKING:
    from lightning_moe_ckpt.sim.regime import Policy


@dataclass(frozen=True)
class AnalyticResult:
    """The expected ETTR of a policy over a run (:func:`analytic_ettr`).

    Attributes:
        ettr: Expected effective training time ratio.
        failures: Expected failures in the run.
        total_recovery_s: Expected recovery time summed over the run.
        final_note: The regime in force at the end (e.g. MoC's final K).
        mean_overhead: Runtime overhead averaged over the run's useful iterations.
    """

    ettr: float
    failures: float
    total_recovery_s: float
    final_note: str
    mean_overhead: float


def _expected_cycles(policy: Policy, mtbf_s: float, run_s: float,
                     rng: np.random.Generator | None) -> AnalyticResult:
    """One trajectory of expected-length renewal cycles; ``rng`` draws each failure's
    state transition (None: the expected transition)."""
    state = policy.initial_state()
    elapsed, useful, working, recovering, failures = 0.0, 0.0, 0.0, 0.0, 0.0
    regime = policy.regime(state)
    while elapsed < run_s:
        regime = policy.regime(state)
        recovery = regime.recovery.expected_s
        cycle = mtbf_s + recovery
        weight = min(1.0, (run_s - elapsed) / cycle)  # the last cycle may be cut short
        useful += weight * mtbf_s / (1.0 + regime.overhead)
        working += weight * mtbf_s
        recovering += weight * recovery
        failures += weight
        elapsed += weight * cycle
        state = policy.after_failure(state, rng)
    return AnalyticResult(useful / run_s, failures, recovering, regime.note,
                          working / useful - 1.0)


def analytic_ettr(policy: Policy, mtbf_s: float, run_s: float,
                  transition_draws: int = 32) -> AnalyticResult:
    """Expected ETTR of ``policy`` over a run of ``run_s`` seconds.

    A renewal cycle is ``MTBF`` of work (slowed by the runtime overhead) plus one expected
    recovery; the run holds ``run_s / cycle`` of them, the last one fractionally. With a
    single regime this is exactly the §2.4 formula. A dynamic policy moves to its next
    regime after each cycle's failure; where that move depends on what the failure costs
    (MoC's lost tokens, bursty under popularity skew), the result is the mean over
    ``transition_draws`` trajectories with seeded draws of it (fixed seed: deterministic),
    since a threshold on accumulated losses reacts to bursts, not only to their mean.

    Args:
        policy: The planned policy.
        mtbf_s: Mean time between failures, seconds (> 0).
        run_s: The run's length, seconds.
        transition_draws: Trajectories averaged for a dynamic policy.

    Returns:
        The expected ETTR, failures, recovery time and overhead.

    Raises:
        ConfigError: ``mtbf_s`` is not > 0.
    """
    require(mtbf_s > 0, f"MTBF must be > 0 seconds, got {mtbf_s}")
    if not policy.dynamic:
        regime = policy.regime(policy.initial_state())
        recovery = regime.recovery.expected_s
        failures = run_s / (mtbf_s + recovery)
        ettr = ettr_formula(regime.overhead_s_per_iteration, regime.iteration_s, 1, recovery,
                            mtbf_s)
        return AnalyticResult(float(ettr), failures, failures * recovery, regime.note,
                              regime.overhead)
    rng = np.random.default_rng(0)
    paths = [_expected_cycles(policy, mtbf_s, run_s, rng) for _ in range(transition_draws)]
    return AnalyticResult(float(np.mean([p.ettr for p in paths])),
                          float(np.mean([p.failures for p in paths])),
                          float(np.mean([p.total_recovery_s for p in paths])),
                          _most_common(p.final_note for p in paths),
                          float(np.mean([p.mean_overhead for p in paths])))


def _most_common(notes: Iterable[str]) -> str:
    """The note most trajectories end with (the regime a run most likely ends in)."""
    counts: dict[str, int] = {}
    for note in notes:
        counts[note] = counts.get(note, 0) + 1
    return max(counts, key=lambda n: counts[n]) if counts else ""


@dataclass(frozen=True)
class MonteCarloResult:
    """ETTR and recovery statistics over independent runs.

    Attributes:
        ettr: ETTR of each run.
        total_recovery_s: Recovery time of each run, seconds.
        failures: Failures in each run.
    """

    ettr: np.ndarray
    total_recovery_s: np.ndarray
    failures: np.ndarray

    @property
    def mean(self) -> float:
        return float(self.ettr.mean())

    @property
    def std(self) -> float:
        return float(self.ettr.std(ddof=1)) if self.ettr.size > 1 else 0.0

    @property
    def stderr(self) -> float:
        return self.std / np.sqrt(max(self.ettr.size, 1))

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.ettr, q))


def _static_runs(policy: Policy, mtbf_s: float, run_s: float, runs: int,
                 rng: np.random.Generator) -> MonteCarloResult:
    """Vectorised renewal process for a policy whose regime never changes."""
    regime = policy.regime(policy.initial_state())
    # Draw failure cycles until every run outlasts run_s (one extension is almost never
    # needed: the first batch covers the mean count plus eight standard deviations).
    cycles = int(run_s / mtbf_s + 8 * np.sqrt(run_s / mtbf_s + 1) + 16)
    work = np.empty((runs, 0))
    recovery = np.empty((runs, 0))
    while work.shape[1] == 0 or (work + recovery).sum(axis=1).min() < run_s:
        work = np.hstack([work, rng.exponential(mtbf_s, size=(runs, cycles))])
        drawn, _ = regime.recovery.sample(rng, runs * cycles)
        recovery = np.hstack([recovery, drawn.reshape(runs, cycles)])
    ends = np.cumsum(work + recovery, axis=1)
    starts = ends - work - recovery
    worked = np.clip(run_s - starts, 0.0, work)
    recovering = np.clip(run_s - starts - work, 0.0, recovery)
    failed = (starts + work) < run_s
    useful = worked.sum(axis=1) / (1.0 + regime.overhead)
    return MonteCarloResult(useful / run_s, recovering.sum(axis=1), failed.sum(axis=1))


def monte_carlo_ettr(policy: Policy, mtbf_s: float, run_s: float, runs: int,
                     rng: np.random.Generator) -> MonteCarloResult:
    """ETTR over ``runs`` runs of ``run_s`` seconds with Poisson failures.

    Args:
        policy: The planned policy.
        mtbf_s: Mean time between failures, seconds (> 0).
        run_s: Each run's length, seconds.
        runs: Independent runs (>= 1).
        rng: Draws the failure times and the recovery costs.

    Returns:
        Per-run ETTR, recovery time and failure count.

    Raises:
        ConfigError: ``mtbf_s`` is not > 0 or ``runs`` is below 1.
    """
    require(mtbf_s > 0, f"MTBF must be > 0 seconds, got {mtbf_s}")
    require(runs >= 1, f"Monte-Carlo runs={runs} must be >= 1")
    if not policy.dynamic:
        return _static_runs(policy, mtbf_s, run_s, runs, rng)
    ettr, totals, counts = np.empty(runs), np.empty(runs), np.empty(runs)
    for run in range(runs):
        state, elapsed, useful, recovering, count = policy.initial_state(), 0.0, 0.0, 0.0, 0
        while True:
            regime = policy.regime(state)
            work = min(rng.exponential(mtbf_s), run_s - elapsed)
            useful += work / (1.0 + regime.overhead)
            elapsed += work
            if elapsed >= run_s:
                break
            recovery = min(regime.recovery.sample_one(rng), run_s - elapsed)
            recovering, elapsed, count = recovering + recovery, elapsed + recovery, count + 1
            state = policy.after_failure(state, rng)
        ettr[run], totals[run], counts[run] = useful / run_s, recovering, count
    return MonteCarloResult(ettr, totals, counts)


def trace_ettr(policy: Policy, failure_times_s: Sequence[float], run_s: float,
               rng: np.random.Generator, runs: int = 1) -> MonteCarloResult:
    """ETTR when failures strike at the given wall-clock times (a failure trace). Recovery
    costs are still random (where in the checkpoint cycle each failure lands).

    Args:
        policy: The planned policy.
        failure_times_s: Failure times, seconds from the start of the run; those outside
            ``[0, run_s)`` are ignored.
        run_s: The run's length, seconds.
        rng: Draws the recovery costs.
        runs: Runs over the same trace.

    Returns:
        Per-run ETTR, recovery time and failure count.
    """
    times = sorted(float(t) for t in failure_times_s if 0 <= t < run_s)
    ettr, totals, counts = np.empty(runs), np.empty(runs), np.empty(runs)
    for run in range(runs):
        state, resume, useful, recovering = policy.initial_state(), 0.0, 0.0, 0.0
        for at in times:
            regime = policy.regime(state)
            if at >= resume:  # failure during work: bank the work done since resuming
                useful += (at - resume) / (1.0 + regime.overhead)
            else:  # failure during a recovery: that recovery starts over
                recovering -= min(resume, run_s) - at
            resume = at + regime.recovery.sample_one(rng)
            recovering += min(resume, run_s) - at
            state = policy.after_failure(state, rng)
        regime = policy.regime(state)
        useful += max(run_s - resume, 0.0) / (1.0 + regime.overhead)
        ettr[run], totals[run], counts[run] = useful / run_s, recovering, len(times)
    return MonteCarloResult(ettr, totals, counts)
