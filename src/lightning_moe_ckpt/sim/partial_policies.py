"""Partial-expert policies that trade lost tokens for smaller checkpoints: MoC and MoEtion.

Both capture every non-expert operator and only some experts per checkpoint; an expert
not in the checkpoint that recovery restores restarts from an older copy, losing the
updates of the tokens it processed since (lost tokens, counted here in iterations' worth
of a layer's routed tokens).

* **MoC-System** (two-level PEC): every iteration snapshots non-experts + K experts per
  layer (round-robin) into local host memory; the latest snapshot is persisted to durable
  storage whenever the previous persist is done, and that persisted checkpoint is what
  recovery restores (a failed node's host memory is gone). Experts missing from it come
  from older persisted checkpoints. Its Dynamic-K keeps the aggregated proportion of lost
  tokens within a budget (3.75% of the tokens trained so far, MoC §3.1, §4.4): after a
  failure that leaves it above, K doubles, up to every expert; larger K means larger
  snapshots that stall more, and larger, slower persists.
* **MoEtion**: every iteration replicates non-experts + the S experts with the most
  tokens since their last checkpoint (S as large as the per-iteration budget allows);
  after recovery the lost tokens are reprocessed by boosting the stale experts' capacity
  (MoEtion §6), which costs their expert work on top of the rollback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from typing_extensions import override

from lightning_moe_ckpt.errors import require
from lightning_moe_ckpt.sim.job import SimJob
from lightning_moe_ckpt.sim.moevement import snapshot_budget_bytes, snapshot_stall_s
from lightning_moe_ckpt.sim.popularity import sample_shares
from lightning_moe_ckpt.sim.recovery import global_rollback_model
from lightning_moe_ckpt.sim.regime import Policy, Regime, StaticPolicy


def partial_bytes(job: SimJob, experts_per_layer: float) -> tuple[float, float]:
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
    experts: float  # K: experts per layer per snapshot (a mean: MoC interleaves layers)
    lost_iterations: float  # lost tokens so far, in iterations' worth
    failures: int = 0  # failures so far
    exhausted: bool = False  # whether the lost-token budget has been overrun


class MoCPolicy(Policy):
    """MoC-System with Dynamic-K, as the MoEvement paper evaluated it.

    Every iteration snapshots the non-experts and ``K`` experts per layer (round-robin,
    interleaved over layers so ``K`` may be fractional), sharded evenly over all ranks,
    into host memory through MoC's own copy path (a calibrated share of PCIe rate: each
    expert shard is copied and serialised on its own). ``K`` starts at ``initial_fraction``
    of the experts for every model, the 12.5% the MoEvement paper reports MoC starting
    from (Fig. 10c), whether or not a larger K would still overlap. What does not fit the
    overlap window stalls, so the overhead grows faster than the snapshot (super-linear
    in K), and the copy slows training while it runs (copy interference). The latest
    snapshot is persisted to storage whenever the previous persist is done, every ``P``
    iterations. A failure restores the persisted checkpoint: an expert saved ``a`` rounds
    ago loses ``a x P`` iterations of its tokens. Dynamic-K (MoC §5.3) watches the
    aggregated proportion of lost tokens, lost so far over tokens trained so far (failures
    x MTBF worth of iterations): once a recovery leaves it above the budget, K doubles at
    that recovery and at every later one until every expert is in the snapshot ("this
    process is reiterated until checkpointing all experts"; MoEvement Fig. 10c: 12.5% to
    100%). The run length bounds how many failures, hence doublings, a run sees.
    """

    name = "moc"
    dynamic = True

    def __init__(self, job: SimJob, mtbf_s: float, lost_token_budget: float,
                 initial_fraction: float, seed: int = 0, pool_size: int = 256) -> None:
        require(0 < lost_token_budget < 1,
                f"sim.policy.moc.lost_token_budget={lost_token_budget} must be in (0, 1)")
        require(0 < initial_fraction <= 1,
                f"sim.policy.moc.initial_fraction={initial_fraction} must be in (0, 1]")
        require(mtbf_s > 0, f"MTBF must be > 0, got {mtbf_s} s")
        self.job, self.experts = job, job.spec.model.n_experts
        self.initial_experts = self.experts * initial_fraction
        self.budget = lost_token_budget
        self.mtbf_iterations = mtbf_s / job.iteration_s
        self._rng, self._pool_size = np.random.default_rng(seed), pool_size
        self._regimes: dict[float, Regime] = {}
        self._lost_pools: dict[float, np.ndarray] = {}

    @override
    def initial_state(self) -> MoCState:
        return MoCState(self.initial_experts, 0.0)

    def copy_s(self, experts: float) -> float:
        """Seconds one GPU's share of a K-expert snapshot takes on MoC's copy path (MoC
        shards every checkpoint evenly over all ranks: the job's bytes over the world)."""
        _, total = partial_bytes(self.job, experts)
        return self.job.to_host_s(total / self.job.plan.world_size) / \
            self.job.calibration.partial_snapshot_efficiency

    def rounds(self, experts: float) -> int:
        """Snapshots until every expert has been saved once."""
        return math.ceil(self.experts / experts - 1e-9)

    def persist_interval(self, experts: float) -> int:
        """Iterations between persisted checkpoints (a persist must finish first)."""
        _, total = partial_bytes(self.job, experts)
        seconds = self.job.calibration.persist_latency_s + self.job.storage_s(total)
        return max(1, math.ceil(seconds / self.job.iteration_s))

    @override
    def regime(self, state: object) -> Regime:
        assert isinstance(state, MoCState)
        if state.experts not in self._regimes:
            job, k = self.job, state.experts
            _, total = partial_bytes(job, k)
            per_gpu = total / job.plan.world_size
            interval = self.persist_interval(k)
            copy_s = self.copy_s(k)
            stall = max(0.0, copy_s - job.overlap_window_s)
            # The slow copy keeps the host path busy for copy_s: PCIe-equivalent bytes
            # per_gpu / efficiency. Each GPU's share is persisted every P iterations.
            efficiency = job.calibration.partial_snapshot_efficiency
            interference = float(job.interference(per_gpu / efficiency, per_gpu / interval))
            # Everyone rolls back to the last snapshot; the replacement node reloads its
            # state from storage, the others from their host memory.
            recovery = global_rollback_model(job.iteration_s, 1,
                                       load_s=job.node_storage_s(job.dense_bytes_per_gpu),
                                       restart_s=job.global_restart_s)
            note = f"K={k:g}/{self.experts}, persisted every {interval}"
            self._regimes[k] = Regime(1, self.rounds(k) * interval, stall, job.iteration_s,
                                      recovery, per_gpu, note, interference)
        return self._regimes[state.experts]

    def expected_lost(self, experts: float) -> float:
        """Mean lost tokens per failure: round-robin ages 0..G-1 persists, whatever the
        popularity (the failure's round-robin phase is uniform)."""
        return (self.rounds(experts) - 1) / 2 * self.persist_interval(experts)

    def _lost_pool(self, experts: float) -> np.ndarray:
        """Sampled lost tokens per failure under the job's popularity skew (bursts when a
        popular expert happens to be stale)."""
        if experts not in self._lost_pools:
            model = self.job.spec.model
            layers = min(model.n_layers, 8)
            shares = sample_shares(self.job.spec.popularity_alpha, layers, self.experts,
                                   self._rng, draws=self._pool_size)
            rounds = self.rounds(experts)
            # Interleaved round-robin: expert e of layer l is saved in round (e + l) mod G.
            group = np.add.outer(np.arange(layers), np.arange(self.experts)) % rounds
            phase = self._rng.integers(rounds, size=(self._pool_size, 1, 1))
            age = np.mod(phase - group, rounds) * self.persist_interval(experts)
            self._lost_pools[experts] = (shares * age).sum(axis=-1).mean(axis=-1)
        return self._lost_pools[experts]

    def lost_token_share(self, state: MoCState) -> float:
        """Aggregated proportion of lost tokens after ``state.failures`` failures."""
        trained = state.failures * self.mtbf_iterations
        return state.lost_iterations / trained if trained > 0 else 0.0

    @override
    def after_failure(self, state: object, rng: np.random.Generator | None) -> MoCState:
        assert isinstance(state, MoCState)
        if rng is None:
            lost = self.expected_lost(state.experts)
        else:
            pool = self._lost_pool(state.experts)
            lost = float(pool[rng.integers(pool.size)])
        after = MoCState(state.experts, state.lost_iterations + lost, state.failures + 1,
                         state.exhausted)
        if not (after.exhausted or self.lost_token_share(after) > self.budget):
            return after
        # Once the budget has been overrun it stays spent: every later failure doubles K.
        experts = min(float(self.experts), 2 * state.experts)
        return MoCState(experts, after.lost_iterations, after.failures, exhausted=True)


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
    recovery = global_rollback_model(job.iteration_s, 1, load + compensation, job.global_restart_s)
    return StaticPolicy("moetion", Regime(
        1, math.ceil(experts / selected), snapshot_stall_s(job, per_gpu, upstream_log=False),
        job.iteration_s,
        recovery, per_gpu, note=f"S={selected}/{experts}, {lost:.1f} iters of tokens lost/failure"))
