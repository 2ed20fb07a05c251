"""Dense checkpoint policies: Gemini (in-memory, oracle interval) and CheckFreq (storage).

Both capture every operator's master state in one iteration (window 1) and recover by
rolling every rank back (global rollback: every rank restarts and re-runs full iterations
with their pipeline bubbles).

* **Gemini** streams each GPU's share of the checkpoint to ``r`` peers' host memory during
  the next iteration, in the NIC time training leaves free; whatever does not fit before
  that iteration's optimizer step stalls training, and the traffic slows training while
  it flows (interference, spread over the interval). Its interval is the *oracle* choice:
  the argmax of the analytic ETTR for the given MTBF (paper §5.2), an upper bound on what
  Gemini can achieve. As clusters grow, the training's own inter-node traffic leaves less
  NIC time for replication, so the stall grows and the oracle interval lengthens.
* **CheckFreq** snapshots to local host memory and persists a checkpoint file to durable
  storage in the background; a new snapshot waits until the previous one is persisted.
  Its policy (CheckFreq §4) profiles the stall each checkpoint causes and picks the
  shortest interval whose stall stays within a cap (3% in the paper, §5.2): persisting
  must take at most ``interval x T_iter`` plus the cap. Recovery reloads the last
  completed checkpoint, as the paper's recovery times count it (half an interval of
  re-execution on average).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lightning_moe_ckpt.planning.intervals import (
    ettr_formula,
    oracle_interval,
    smallest_interval_within,
)
from lightning_moe_ckpt.sim.job import SimJob
from lightning_moe_ckpt.sim.recovery import global_rollback_model
from lightning_moe_ckpt.sim.regime import Regime, StaticPolicy


def gemini_stall_s(job: SimJob) -> float:
    """Stall of one dense in-memory checkpoint: the transfer beyond one iteration."""
    nbytes = job.dense_bytes_per_gpu
    transfer = max(job.to_host_s(nbytes), job.to_peers_s(nbytes))
    return max(0.0, transfer - job.overlap_window_s)


def gemini_interference(job: SimJob, interval: Any) -> Any:
    """Slowdown from one dense checkpoint's PCIe and replication traffic every
    ``interval`` iterations (an array of intervals gives one value each)."""
    nbytes = job.dense_bytes_per_gpu
    return job.interference(nbytes / interval, nbytes * job.spec.replicas / interval)


def gemini_load_s(job: SimJob) -> float:
    """Reloading a Gemini checkpoint: the replacement node pulls its GPUs' shares from
    peers' host memory while the other ranks reload from their own."""
    nbytes = job.dense_bytes_per_gpu
    return max(job.node_fetch_s(nbytes), job.to_host_s(nbytes))


def gemini_regime(job: SimJob, interval: int) -> Regime:
    """Gemini checkpointing every ``interval`` iterations."""
    recovery = global_rollback_model(job.iteration_s, interval, gemini_load_s(job),
                               job.global_restart_s)
    return Regime(interval, 1, gemini_stall_s(job), job.iteration_s, recovery,
                  job.dense_bytes_per_gpu, interference=float(gemini_interference(job, interval)))


def plan_gemini(job: SimJob, mtbf_s: float, max_interval: int) -> StaticPolicy:
    """Gemini with the ETTR-maximising interval for ``mtbf_s`` (hindsight oracle)."""

    stall, fixed = gemini_stall_s(job), gemini_load_s(job) + job.global_restart_s

    def ettr_of(intervals: np.ndarray) -> np.ndarray:
        # E[R] of a global rollback without lag: load + restart + interval x T_iter / 2.
        recovery = fixed + 0.5 * intervals * job.iteration_s
        per_iteration = (stall / intervals
                         + gemini_interference(job, intervals) * job.iteration_s)
        return np.asarray(ettr_formula(per_iteration, job.iteration_s, 1, recovery, mtbf_s))

    interval, _ = oracle_interval(ettr_of, max_interval)
    return StaticPolicy("gemini", gemini_regime(job, interval))


def checkfreq_persist_s(job: SimJob) -> float:
    """Time to persist one dense checkpoint of the whole job to durable storage."""
    return job.calibration.persist_latency_s + job.storage_s(job.dense_bytes_total)


def checkfreq_regime(job: SimJob, interval: int) -> Regime:
    """CheckFreq checkpointing every ``interval`` iterations."""
    nbytes = job.dense_bytes_per_gpu
    persist = checkfreq_persist_s(job)
    snapshot_stall = max(0.0, job.to_host_s(nbytes) - job.overlap_window_s)
    # One snapshot buffer: the next snapshot waits for the previous persist to finish.
    persist_wait = max(0.0, persist - interval * job.iteration_s)
    recovery = global_rollback_model(job.iteration_s, interval,
                               load_s=job.node_storage_s(nbytes), restart_s=job.global_restart_s)
    # The persist streams each GPU's share through the NIC once per interval.
    interference = job.interference(nbytes / interval, nbytes / interval)
    return Regime(interval, 1, snapshot_stall + persist_wait, job.iteration_s, recovery, nbytes,
                  note=f"persist {persist:.0f}s", interference=float(interference))


def plan_checkfreq(job: SimJob, max_overhead: float, max_interval: int) -> StaticPolicy:
    """CheckFreq's policy: the shortest interval whose profiled stall stays within
    ``max_overhead`` of the iteration time (the longest searched if none does)."""
    # The stall share only falls as the interval grows (the persist wait shrinks and the
    # snapshot is amortised), so the first interval within the cap is the answer: the
    # runtime planner's rule (lightning_moe_ckpt.planning.intervals).
    interval = smallest_interval_within(
        lambda k: checkfreq_regime(job, k).stall_overhead, max_overhead, max_interval)
    return StaticPolicy("checkfreq", checkfreq_regime(job, interval))
