"""The MoEvement policy: sparse snapshots every iteration, localized sparse-to-dense replay.

Each iteration snapshots one slice of the stage's operators (master state) plus the
compute weights of the slices still waiting, sized by the runtime's Algorithm 1 to the
per-iteration budget of the slowest tier: host memory over PCIe within the overlap window
(shared with the upstream log the same GPU writes), and ``r`` peers' host memory in the
NIC time training leaves free, which must keep up with one snapshot per iteration.
Snapshots that fit add no stall, but their traffic still slows training a little while it
flows (copy and network interference, every iteration). On a failure only the failed
stage's ``dp x ep`` group recovers: its replacement node fetches the last persisted window
from peers, converts it to a dense checkpoint by replaying ``W`` iterations with frozen
operators, then replays up to the failure, all from the neighbours' logs.
"""

from __future__ import annotations

import math

from lightning_moe_ckpt.sim.job import SimJob
from lightning_moe_ckpt.sim.recovery import localized_replay_model
from lightning_moe_ckpt.sim.regime import Regime, StaticPolicy
from lightning_moe_ckpt.sim.schedule import SparseSchedule, find_window, fixed_window


def snapshot_budget_bytes(job: SimJob, upstream_log: bool = True) -> float:
    """Largest snapshot one GPU can move per iteration without stalling (sharing PCIe with
    the upstream log when the policy keeps one)."""
    log = job.log_bytes_per_iteration if upstream_log else 0.0
    host = job.overlap_window_s * job.cluster.pcie_bytes_per_s - log
    peers = math.inf
    if job.spec.replicas > 0:
        peers = job.iteration_s * job.host_copy_per_gpu / job.spec.replicas
    return max(0.0, min(host, peers))


def snapshot_stall_s(job: SimJob, nbytes: float, upstream_log: bool = True) -> float:
    """Stall of one per-iteration snapshot of ``nbytes`` (zero when it fits the budget)."""
    log = job.log_bytes_per_iteration if upstream_log else 0.0
    to_host = job.to_host_s(nbytes + log) - job.overlap_window_s
    to_peers = job.to_peers_s(nbytes) - job.iteration_s
    return max(0.0, to_host, to_peers)


def snapshot_interference(job: SimJob, nbytes: float, upstream_log: bool = True) -> float:
    """Slowdown from snapshotting ``nbytes`` per iteration (plus the upstream log over
    PCIe) and replicating them to ``r`` peers."""
    log = job.log_bytes_per_iteration if upstream_log else 0.0
    return float(job.interference(nbytes + log, nbytes * job.spec.replicas))


def stage_schedules(job: SimJob, window: int | None = None) -> tuple[SparseSchedule, ...]:
    """One schedule per pipeline stage (each stage checkpoints its own operators), sized by
    Algorithm 1 or, given ``window``, with that many snapshots per window."""
    if window is not None:
        return tuple(fixed_window(stage.operators, stage.ranks, window) for stage in job.stages)
    budget = snapshot_budget_bytes(job)
    return tuple(find_window(stage.operators, stage.ranks, budget) for stage in job.stages)


def plan_moevement(job: SimJob, window: int | None = None) -> StaticPolicy:
    """MoEvement's regime for ``job``; ``window`` forces W (e.g. the W a real run chose)."""
    schedules = stage_schedules(job, window)
    conversion, full, fetch = [], [], []
    for stage, schedule in zip(job.stages, schedules, strict=True):
        conversion.append(sum(job.timing.replay_iteration_s(stage, schedule.frozen_after(j))
                              for j in range(schedule.window)))
        full.append(job.timing.replay_iteration_s(stage))
        fetch.append(job.node_fetch_s(schedule.window_bytes))
    recovery = localized_replay_model([s.window for s in schedules], conversion, full, fetch,
                                job.spec.restart_s)
    largest = max(s.largest_bytes for s in schedules)
    mean = max(s.window_bytes / s.window for s in schedules)  # bytes per iteration
    window = max(s.window for s in schedules)
    return StaticPolicy("moevement", Regime(
        interval=1, window=window, stall_s=snapshot_stall_s(job, largest),
        iteration_s=job.iteration_s, recovery=recovery, snapshot_bytes_per_gpu=largest,
        note=f"W={window}", interference=snapshot_interference(job, mean)))
