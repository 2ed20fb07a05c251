"""Measured ETTR of real runs with injected failures, and the simulator's prediction of it.

``recipes/bench.py`` trains one job without checkpointing or failures (``checkpoint=none``)
and once per policy with ``faults=mtbf``, all over the same steps, data, model and layout
and the same seeded failure schedule; this module turns their ``metrics.json`` into
measured ETTR and asks the simulator, calibrated with the same runs, what it predicts.

**Measured.** All times are training-loop time, the sum of the iteration wall times (process
start-up, validation and the final save are outside it). A failure's recovery (detection to
resume: drain, fetch, sparse-to-dense conversion, replay) runs inside the iteration it
interrupted, so the loop time ``T`` of a run holds it; ``R`` is each recovery's measured
total and ``work = T - sum(R)`` the run's own steps with checkpointing. The useful time
``U`` is what the ``checkpoint=none`` fault-free run needs for the same steps: its first
iteration (start-up costs every run pays) plus the remaining steps at its median iteration
time, which is its loop time without the bursts other processes cause on a shared machine
(a burst in the baseline would otherwise inflate every policy's ETTR, even above 1). Then
``ETTR = U / T`` = runtime factor ``U / work`` (every checkpoint cost: stalls, and copy
threads competing with compute) x recovery factor ``work / T`` (recovery, including the
lost progress it re-executes as replayed iterations). MoC's lost tokens (routed token
assignments whose expert updates a partial checkpoint cannot restore) are reported beside
ETTR as a share of the run's routed assignments, not deducted from it, as in the simulator
and the paper.

**Predicted.** The simulator's job for the same model, layout and batch, calibrated with
the profile (iteration time ``U / steps``, measured stage, optimizer and copy figures),
each policy planned with the knobs the run used (MoEvement's W, Gemini's interval, MoC's
K) and with ``T_ckpt`` set to the run's measured runtime overhead ``work / U - 1`` (floored
at 0), so what the comparison tests is the recovery model and the failure process. MTBF
in seconds is ``mtbf_steps x work / steps`` (failures strike working steps). Three
predictions: *analytic*, the §2.4 / Appendix C formula at that MTBF; *same failures*, the
run's own failure steps each costing the simulator's expected recovery ``E[R]`` of the
regime then in force, ``U / (work + sum E[R])``, which separates the recovery model from a
short run's luck of the draw; *Monte-Carlo*, runs as long as the measured one (mean and
5th/95th percentiles). The gap is ``(predicted - measured) / measured`` (paper Table 4).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_moe_ckpt.errors import ConfigError, require
from lightning_moe_ckpt.sim.dense_policies import (
    checkfreq_regime,
    gemini_regime,
    plan_checkfreq,
    plan_gemini,
)
from lightning_moe_ckpt.sim.ettr import analytic_ettr, monte_carlo_ettr
from lightning_moe_ckpt.sim.job import SimJob
from lightning_moe_ckpt.sim.moevement import plan_moevement
from lightning_moe_ckpt.sim.partial_policies import MoCPolicy, plan_moetion
from lightning_moe_ckpt.sim.policies import PolicySettings
from lightning_moe_ckpt.sim.regime import Policy, Regime, StaticPolicy


def loop_seconds(metrics: Mapping[str, Any], key: str) -> float:
    """Training-loop time of a run: mean iteration time x steps (``key`` names the run)."""
    steps = metrics.get("steps")
    mean_ms = (metrics.get("iteration_ms") or {}).get("mean")
    if not (isinstance(steps, int) and steps > 0 and isinstance(mean_ms, (int, float))):
        raise ConfigError(f"{key}: metrics.json lacks steps or iteration_ms.mean")
    return float(mean_ms) * steps / 1e3


def useful_seconds(metrics: Mapping[str, Any], key: str) -> float:
    """Useful time of a fault-free checkpoint-free run: its first iteration plus the other
    steps at their median (see the module doc); without per-step times, its loop time."""
    per_step = (metrics.get("iteration_ms") or {}).get("per_step")
    if not per_step:
        return loop_seconds(metrics, key)
    rest = per_step[1:]
    return (per_step[0] + len(rest) * (statistics.median(rest) if rest else 0.0)) / 1e3


@dataclass(frozen=True)
class MeasuredRun:
    """One training run with injected failures, from its ``metrics.json``."""

    policy: str
    steps: int
    loop_s: float
    failures: int  # failure events injected (several ranks at one step: one recovery)
    failure_steps: tuple[int, ...]  # one per recovery
    recovery_s: tuple[float, ...]  # measured total of each recovery
    replayed: tuple[int, ...]  # iterations each recovery re-executed
    lost_tokens: float  # routed token assignments whose expert updates were lost
    routed: float  # token assignments the run routed to experts (all MoE layers)
    window: int | None
    interval: int | None
    losses: tuple[float, ...]

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Any], key: str) -> MeasuredRun:
        """Read a run; ``key`` names it in errors."""
        recoveries = metrics.get("recoveries")
        if not isinstance(recoveries, list):
            raise ConfigError(f"{key}: metrics.json lacks 'recoveries' (was it run with faults?)")
        loop_s = loop_seconds(metrics, key)
        steps = int(metrics["steps"])
        return cls(
            policy=str(metrics.get("checkpoint_policy", key)), steps=steps, loop_s=loop_s,
            failures=int(metrics.get("failures_injected", len(recoveries))),
            failure_steps=tuple(int(r["failed_step"]) for r in recoveries),
            recovery_s=tuple(float(r["timings_s"]["total"]) for r in recoveries),
            replayed=tuple(int(r.get("iterations_replayed", 0)) for r in recoveries),
            lost_tokens=float(sum(r.get("lost_tokens", 0) or 0 for r in recoveries)),
            routed=float(np.sum(metrics.get("expert_load") or 0.0)),
            window=metrics.get("window"), interval=metrics.get("interval"),
            losses=tuple(float(v) for v in metrics.get("loss", [])))

    @property
    def work_s(self) -> float:
        """Loop time outside recoveries: the run's steps, with checkpointing."""
        return self.loop_s - sum(self.recovery_s)

    @property
    def lost_token_share(self) -> float:
        """Lost token assignments over the assignments the run routed (0 without any)."""
        return self.lost_tokens / self.routed if self.routed > 0 else 0.0

    @property
    def loss_finite(self) -> bool:
        return all(math.isfinite(v) for v in self.losses)


@dataclass(frozen=True)
class MeasuredETTR:
    ettr: float  # useful / loop
    runtime: float  # useful / work
    recovery: float  # work / loop
    overhead: float  # work / useful - 1: checkpointing's runtime overhead


def measure_ettr(run: MeasuredRun, useful_s: float) -> MeasuredETTR:
    """ETTR of ``run`` against ``useful_s``, the fault-free checkpoint-free loop time."""
    require(useful_s > 0, f"useful time {useful_s} s must be > 0")
    require(run.work_s > 0, f"{run.policy}: recoveries ({sum(run.recovery_s):.3f} s) exceed "
                            f"the loop time ({run.loop_s:.3f} s)")
    return MeasuredETTR(useful_s / run.loop_s, useful_s / run.work_s, run.work_s / run.loop_s,
                        run.work_s / useful_s - 1.0)


class CalibratedPolicy(Policy):
    """``inner`` with every regime's runtime overhead replaced by a measured one."""

    def __init__(self, inner: Policy, overhead: float) -> None:
        require(overhead >= 0, f"calibrated overhead {overhead} must be >= 0")
        self.inner, self.overhead = inner, overhead
        self.name, self.dynamic = inner.name, inner.dynamic

    def initial_state(self) -> object:
        return self.inner.initial_state()

    def regime(self, state: object) -> Regime:
        regime = self.inner.regime(state)
        stall = self.overhead * regime.iteration_s * regime.interval
        return dataclasses.replace(regime, stall_s=stall, interference=0.0)

    def after_failure(self, state: object, rng: np.random.Generator | None) -> object:
        return self.inner.after_failure(state, rng)


@dataclass(frozen=True)
class PolicyKnobs:
    """What a real run's policy used, for planning the simulated one alike."""

    window: int | None = None  # MoEvement's W
    interval: int | None = None  # dense policies' checkpoint interval
    experts_per_layer: int | None = None  # MoC's initial K
    lost_token_budget: float | None = None  # MoC


def plan_measured(name: str, job: SimJob, knobs: PolicyKnobs, mtbf_s: float, run_s: float,
                  settings: PolicySettings | None = None) -> Policy:
    """The simulator's policy ``name`` for ``job``, with the run's knobs where it has them
    (without them, planned as :func:`~lightning_moe_ckpt.sim.policies.make_policy` does for
    ``mtbf_s`` and a run of ``run_s`` seconds)."""
    settings = settings or PolicySettings()
    if name == "moevement":
        return plan_moevement(job, knobs.window)
    if name == "gemini":
        if knobs.interval is None:
            return plan_gemini(job, mtbf_s, settings.max_interval)
        return StaticPolicy("gemini", gemini_regime(job, knobs.interval))
    if name == "checkfreq":
        if knobs.interval is None:
            return plan_checkfreq(job, settings.checkfreq_max_overhead, settings.max_interval)
        return StaticPolicy("checkfreq", checkfreq_regime(job, knobs.interval))
    if name == "moc":
        experts = job.spec.model.n_experts
        fraction = (settings.moc_initial_fraction if knobs.experts_per_layer is None
                    else min(1.0, knobs.experts_per_layer / experts))
        budget = knobs.lost_token_budget or settings.moc_lost_token_budget
        return MoCPolicy(job, mtbf_s, budget, fraction, settings.seed)
    if name == "moetion":
        return plan_moetion(job)
    raise ConfigError(f"policy {name!r} has no simulator model; choose one of checkfreq, "
                      "gemini, moc, moetion, moevement")


def same_failures_ettr(policy: Policy, failure_steps: Sequence[int], steps: int,
                       iteration_s: float) -> tuple[float, float]:
    """(ETTR, total expected recovery seconds) of ``steps`` iterations of ``iteration_s``
    struck at ``failure_steps``, each failure costing the expected recovery of the regime in
    force (dynamic policies take their expected transition after each)."""
    require(steps > 0 and iteration_s > 0, "steps and iteration time must be > 0")
    state, wall, recovering, previous = policy.initial_state(), 0.0, 0.0, 0
    for step in sorted(failure_steps):
        require(0 <= step <= steps, f"failure step {step} lies outside the run's {steps} steps")
        regime = policy.regime(state)
        wall += (step - previous) * iteration_s * (1.0 + regime.overhead)
        recovering += regime.recovery.expected_s
        previous, state = step, policy.after_failure(state, None)
    wall += (steps - previous) * iteration_s * (1.0 + policy.regime(state).overhead)
    return steps * iteration_s / (wall + recovering), recovering


@dataclass(frozen=True)
class Prediction:
    """What the calibrated simulator predicts for one measured run."""

    mtbf_s: float
    modelled_overhead: float  # the simulator's own T_ckpt overhead, before calibration
    expected_recovery_s: float  # E[R] per failure in the initial regime
    expected_recovery_iterations: float
    analytic: float
    same_failures: float
    same_failures_recovery_s: float
    mc_mean: float
    mc_p5: float
    mc_p95: float
    note: str


def predict(policy: Policy, run: MeasuredRun, useful_s: float, mtbf_steps: float,
            mc_runs: int, rng: np.random.Generator) -> Prediction:
    """Calibrate ``policy`` with ``run`` (measured overhead) and predict its ETTR."""
    require(mtbf_steps > 0, f"MTBF {mtbf_steps} steps must be > 0")
    measured = measure_ettr(run, useful_s)
    modelled = policy.regime(policy.initial_state()).overhead
    calibrated = CalibratedPolicy(policy, max(measured.overhead, 0.0))
    mtbf_s = mtbf_steps * run.work_s / run.steps
    regime = calibrated.regime(calibrated.initial_state())
    analytic = analytic_ettr(calibrated, mtbf_s, run.loop_s)
    same, same_recovery = same_failures_ettr(calibrated, run.failure_steps, run.steps,
                                             useful_s / run.steps)
    carlo = monte_carlo_ettr(calibrated, mtbf_s, run.loop_s, mc_runs, rng)
    return Prediction(mtbf_s, modelled, regime.recovery.expected_s,
                      regime.recovery.expected_iterations, analytic.ettr, same, same_recovery,
                      carlo.mean, carlo.percentile(5), carlo.percentile(95), analytic.final_note)


def gap_pct(predicted: float, measured: float) -> float:
    """Relative difference of a prediction from the measurement, in percent."""
    return 100.0 * (predicted - measured) / measured
