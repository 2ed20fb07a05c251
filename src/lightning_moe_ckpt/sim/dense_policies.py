"""Dense checkpoint policies: Gemini (in-memory, oracle interval) and CheckFreq (storage).

Both capture every operator's master state in one iteration (window 1) and recover by
rolling every rank back (global rollback, re-running full iterations with their pipeline
bubbles).

* **Gemini** streams each GPU's share of the checkpoint to ``r`` peers' host memory during
  the next iteration; whatever does not fit before that iteration's optimizer step stalls
  training. Its interval is the *oracle* choice: the argmax of the analytic ETTR for the
  given MTBF (paper §5.2), an upper bound on what Gemini can achieve.
* **CheckFreq** snapshots to local host memory and persists to durable storage in the
  background; a new snapshot waits until the previous one is persisted. Its policy picks
  the shortest interval whose overhead stays within a cap (3% in the paper, §5.2, §5.7).
  A failed node's host memory is gone, so recovery reloads the last *persisted*
  checkpoint from storage: the rollback reaches back ``persist time + u x interval``.
"""

from __future__ import annotations

import numpy as np

from lightning_moe_ckpt.errors import require
from lightning_moe_ckpt.ettr_formulas import ettr_formula, oracle_interval
from lightning_moe_ckpt.sim.job import SimJob
from lightning_moe_ckpt.sim.recovery import global_rollback
from lightning_moe_ckpt.sim.regime import Regime, StaticPolicy


def gemini_stall_s(job: SimJob) -> float:
    """Stall of one dense in-memory checkpoint: the transfer beyond one iteration."""
    nbytes = job.dense_bytes_per_gpu
    transfer = max(job.to_host_s(nbytes), job.to_peers_s(nbytes))
    return max(0.0, transfer - job.overlap_window_s)


def gemini_load_s(job: SimJob) -> float:
    """Reloading a Gemini checkpoint: the replacement node pulls its GPUs' shares from
    peers' host memory while the other ranks reload from their own."""
    nbytes = job.dense_bytes_per_gpu
    return max(job.node_fetch_s(nbytes), job.to_host_s(nbytes))


def gemini_regime(job: SimJob, interval: int) -> Regime:
    """Gemini checkpointing every ``interval`` iterations."""
    recovery = global_rollback(job.iteration_s, interval, gemini_load_s(job), job.spec.restart_s)
    return Regime(interval, 1, gemini_stall_s(job), job.iteration_s, recovery,
                  job.dense_bytes_per_gpu)


def plan_gemini(job: SimJob, mtbf_s: float, max_interval: int) -> StaticPolicy:
    """Gemini with the ETTR-maximising interval for ``mtbf_s`` (hindsight oracle)."""

    stall, fixed = gemini_stall_s(job), gemini_load_s(job) + job.spec.restart_s

    def ettr_of(intervals: np.ndarray) -> np.ndarray:
        # E[R] of a global rollback without lag: load + restart + interval x T_iter / 2.
        recovery = fixed + 0.5 * intervals * job.iteration_s
        return ettr_formula(stall, job.iteration_s, intervals, recovery, mtbf_s)

    interval, _ = oracle_interval(ettr_of, max_interval)
    return StaticPolicy("gemini", gemini_regime(job, interval))


def checkfreq_persist_s(job: SimJob) -> float:
    """Time to persist one dense checkpoint of the whole job to durable storage."""
    return job.storage_s(job.dense_bytes_total)


def checkfreq_regime(job: SimJob, interval: int) -> Regime:
    """CheckFreq checkpointing every ``interval`` iterations."""
    nbytes = job.dense_bytes_per_gpu
    persist = checkfreq_persist_s(job)
    snapshot_stall = max(0.0, job.to_host_s(nbytes) - job.overlap_window_s)
    # One snapshot buffer: the next snapshot waits for the previous persist to finish.
    persist_wait = max(0.0, persist - interval * job.iteration_s)
    recovery = global_rollback(job.iteration_s, interval, load_s=persist,
                               restart_s=job.spec.restart_s, lag_s=persist)
    return Regime(interval, 1, snapshot_stall + persist_wait, job.iteration_s, recovery, nbytes,
                  note=f"persist {persist:.0f}s")


def plan_checkfreq(job: SimJob, max_overhead: float, max_interval: int) -> StaticPolicy:
    """CheckFreq at the shortest interval whose overhead is within ``max_overhead``; if none
    up to ``max_interval`` is, the interval with the least overhead."""
    require(0 < max_overhead < 1,
            f"sim.policy.checkfreq.max_overhead={max_overhead} must be in (0, 1)")
    best = checkfreq_regime(job, 1)
    for interval in range(1, max_interval + 1):
        regime = checkfreq_regime(job, interval)
        if regime.overhead <= max_overhead:
            return StaticPolicy("checkfreq", regime)
        if regime.overhead < best.overhead:
            best = regime
    return StaticPolicy("checkfreq", best)
