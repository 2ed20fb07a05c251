"""Partial-expert policies that trade lost tokens for smaller checkpoints: MoC and MoEtion.

Both capture every non-expert operator and only some experts per checkpoint; an expert
not in the checkpoint that recovery restores restarts from an older copy, losing the
updates of the tokens it processed since (lost tokens, counted here in iterations' worth
of a layer's routed tokens).

* **MoC-System** (two-level PEC): every iteration snapshots non-experts + K experts per
  layer (round-robin) into local host memory; the latest snapshot is persisted to durable
  storage whenever the previous persist is done, and that persisted checkpoint is what
  recovery restores (a failed node's host memory is gone). Experts missing from it come
  from older persisted checkpoints. Its Dynamic-K keeps the proportion of lost tokens
  within a budget (3.75% of the run's tokens, MoC §3.1, §5.3): after a failure that
  exceeds it, K doubles, up to every expert; larger K means larger, slower persists.
* **MoEtion**: every iteration replicates non-experts + the S experts with the most
  tokens since their last checkpoint (S as large as the per-iteration budget allows);
  after recovery the lost tokens are reprocessed by boosting the stale experts' capacity
  (MoEtion §6), which costs their expert work on top of the rollback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lightning_moe_ckpt.errors import require
from lightning_moe_ckpt.sim.job import SimJob
from lightning_moe_ckpt.sim.moevement import snapshot_budget_bytes, snapshot_stall_s
from lightning_moe_ckpt.sim.popularity import sample_shares
from lightning_moe_ckpt.sim.recovery import global_rollback
from lightning_moe_ckpt.sim.regime import Policy, Regime, StaticPolicy


def partial_bytes(job: SimJob, experts_per_layer: int) -> tuple[float, float]:
    """(largest per-GPU share, whole-job total) of a checkpoint holding all non-expert
    master state and ``experts_per_layer`` experts of every layer."""
    fraction = experts_per_layer / job.spec.model.n_experts
    per_gpu, total = 0.0, 0.0
    for stage in job.stages:
        nbytes = stage.non_expert_master_state + fraction * stage.expert_master_state
        per_gpu, total = max(per_gpu, nbytes / stage.ranks), total + nbytes
    return per_gpu, total


@dataclass(frozen=True)
class MoCState:
    experts: int  # K: experts per layer per snapshot
    lost_iterations: float  # lost tokens so far, in iterations' worth


class MoCPolicy(Policy):
    """MoC-System with Dynamic-K over a run of ``run_s`` seconds."""

    name = "moc"
    dynamic = True

    def __init__(self, job: SimJob, run_s: float, lost_token_budget: float,
                 initial_fraction: float, seed: int = 0, pool_size: int = 256) -> None:
        require(0 < lost_token_budget < 1,
                f"sim.policy.moc.lost_token_budget={lost_token_budget} must be in (0, 1)")
        require(0 < initial_fraction <= 1,
                f"sim.policy.moc.initial_fraction={initial_fraction} must be in (0, 1]")
        self.job, self.experts = job, job.spec.model.n_experts
        self.initial_experts = min(self.experts, max(1, round(self.experts * initial_fraction)))
        self.budget_iterations = lost_token_budget * run_s / job.iteration_s
        self._rng, self._pool_size = np.random.default_rng(seed), pool_size
        self._regimes: dict[int, Regime] = {}
        self._lost_pools: dict[int, np.ndarray] = {}
        self._persist_intervals: dict[int, int] = {}

    def initial_state(self) -> MoCState:
        return MoCState(self.initial_experts, 0.0)

    def persist_interval(self, experts: int) -> int:
        """Iterations between persisted checkpoints (a persist must finish first)."""
        if experts not in self._persist_intervals:
            _, total = partial_bytes(self.job, experts)
            seconds = self.job.storage_s(total)
            self._persist_intervals[experts] = max(1, math.ceil(seconds / self.job.iteration_s))
        return self._persist_intervals[experts]

    def regime(self, state: object) -> Regime:
        assert isinstance(state, MoCState)
        if state.experts not in self._regimes:
            job, k = self.job, state.experts
            per_gpu, total = partial_bytes(job, k)
            persist_s = job.storage_s(total)
            interval = self.persist_interval(k)
            stall = max(0.0, job.to_host_s(per_gpu) - job.overlap_window_s)
            # The replacement node reloads its whole state from storage; the rest from host
            # memory. Everyone rolls back to the last persisted checkpoint.
            recovery = global_rollback(job.iteration_s, interval,
                                       load_s=job.node_storage_s(job.dense_bytes_per_gpu),
                                       restart_s=job.spec.restart_s, lag_s=persist_s)
            rounds = math.ceil(self.experts / k)
            note = f"K={k}/{self.experts}, persisted every {interval}"
            self._regimes[k] = Regime(1, rounds * interval, stall, job.iteration_s, recovery,
                                      per_gpu, note)
        return self._regimes[state.experts]

    def expected_lost(self, experts: int) -> float:
        """Mean lost tokens per failure: round-robin ages 0..G-1 persists, whatever the
        popularity (the failure's round-robin phase is uniform)."""
        rounds = math.ceil(self.experts / experts)
        return (rounds - 1) / 2 * self.persist_interval(experts)

    def _lost_pool(self, experts: int) -> np.ndarray:
        """Sampled lost tokens per failure under the job's popularity skew (bursts when a
        popular expert happens to be stale)."""
        if experts not in self._lost_pools:
            model = self.job.spec.model
            layers = min(model.n_layers, 8)
            shares = sample_shares(self.job.spec.popularity_alpha, layers, self.experts,
                                   self._rng, draws=self._pool_size)
            rounds = math.ceil(self.experts / experts)
            group = np.arange(self.experts) // experts
            phase = self._rng.integers(rounds, size=(self._pool_size, 1, 1))
            age = np.mod(phase - group, rounds) * self.persist_interval(experts)
            self._lost_pools[experts] = (shares * age).sum(axis=-1).mean(axis=-1)
        return self._lost_pools[experts]

    def after_failure(self, state: object, rng: np.random.Generator | None) -> MoCState:
        assert isinstance(state, MoCState)
        if rng is None:
            lost = self.expected_lost(state.experts)
        else:
            pool = self._lost_pool(state.experts)
            lost = float(pool[rng.integers(pool.size)])
        total = state.lost_iterations + lost
        experts = state.experts
        if total > self.budget_iterations and experts < self.experts:
            experts = min(self.experts, 2 * experts)
        return MoCState(experts, total)


def unsaved_tokens(shares: np.ndarray, selected: int) -> float:
    """Mean tokens (iterations' worth per layer) not yet checkpointed right after a
    checkpoint, when each checkpoint takes the ``selected`` experts per layer with the most
    tokens since their last checkpoint (MoEtion's selection), in steady state."""
    experts = shares.shape[1]
    if selected >= experts:
        return 0.0
    rounds = math.ceil(experts / selected)
    warmup, measured = 8 * rounds + 8, 8 * rounds + 8
    unsaved = np.zeros_like(shares)
    totals = []
    for step in range(warmup + measured):
        unsaved += shares
        top = np.argpartition(unsaved, experts - selected, axis=1)[:, experts - selected:]
        np.put_along_axis(unsaved, top, 0.0, axis=1)
        if step >= warmup:
            totals.append(unsaved.sum(axis=1).mean())
    return float(np.mean(totals))


def plan_moetion(job: SimJob) -> StaticPolicy:
    """MoEtion with as many experts per snapshot as the per-iteration budget allows."""
    experts = job.spec.model.n_experts
    budget = snapshot_budget_bytes(job, upstream_log=False)
    selected = 1
    for candidate in range(experts, 0, -1):
        if partial_bytes(job, candidate)[0] <= budget:
            selected = candidate
            break
    per_gpu, _ = partial_bytes(job, selected)
    lost = unsaved_tokens(job.shares, selected)
    compensation = lost * job.timing.expert_compute_per_iteration_s()
    load = max(job.node_fetch_s(job.dense_bytes_per_gpu), job.to_host_s(job.dense_bytes_per_gpu))
    recovery = global_rollback(job.iteration_s, 1, load + compensation, job.spec.restart_s)
    return StaticPolicy("moetion", Regime(
        1, math.ceil(experts / selected), snapshot_stall_s(job, per_gpu, upstream_log=False),
        job.iteration_s,
        recovery, per_gpu, note=f"S={selected}/{experts}, {lost:.1f} iters of tokens lost/failure"))
