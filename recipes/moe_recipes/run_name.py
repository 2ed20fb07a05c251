"""The default name of a run's output directory: one every task of a job agrees on.

``conf/train.yaml`` puts a run under ``outputs/train/${moe_run_name:}``. Under SLURM that
is ``job-<SLURM_JOB_ID>`` (``job-<array job>_<task>`` for an array task): every task of the
job (spares included) writes into the same directory, and a requeued job, which keeps its
id, finds its durable checkpoints there again. Elsewhere it is the start time to the
second, as Hydra's ``now`` would give.
"""

from __future__ import annotations

import os
from datetime import datetime

from omegaconf import OmegaConf

__all__ = ["register", "run_name"]


def run_name() -> str:
    """``job-<id>`` of the SLURM job this process belongs to, else the time now."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"job-{array}_{task}"
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        return f"job-{job}"
    return datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def register() -> None:
    """Make ``${moe_run_name:}`` resolvable (resolved once per process)."""
    if not OmegaConf.has_resolver("moe_run_name"):
        OmegaConf.register_new_resolver("moe_run_name", run_name, use_cache=True)
