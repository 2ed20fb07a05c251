"""End-of-run artifacts: ``final_state.pt``, ``metrics.json`` and the training plot.

``final_state.pt`` is the consolidated dense state keyed by layout-independent parameter
FQNs (:mod:`lightning_moe_ckpt.training.consolidate`), exactly as DESIGN.md's recipe
contract specifies::

    {"step": int, "model": {fqn: fp32 master}, "compute": {fqn: compute weight},
     "optimizer": {fqn: {"exp_avg", "exp_avg_sq", "step"}}}

Two runs that must agree produce files whose tensors are ``torch.equal``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt
import torch.distributed as dist

from lightning_moe_ckpt.core.files import write_atomically
from lightning_moe_ckpt.training.history import TrainingHistory
from moe_recipes.settings import RunSettings

FINAL_STATE = "final_state.pt"
METRICS = "metrics.json"
PLOT = "training.png"
STRUCK_FAULTS = "faults_struck.jsonl"  # real faults as they struck (a resumed job skips them)
WORKERS = "workers.json"  # the supervisor's live view: store address, pid of every rank


def gather_cpu_ms(history: TrainingHistory) -> dict[str, Any]:
    """Every rank's median CPU milliseconds per iteration, all threads (``per_rank``) and
    the training thread's own (``training_thread_per_rank``), with their sums over the ranks
    (None when some rank measured none), on rank 0: the ``cpu_ms_per_iteration`` of
    ``metrics.json``. Collective when a process group exists; the other ranks get ``{}``."""
    mine = history.median_cpu_ms()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        gathered: list[tuple[float, float] | None] = [mine]
    else:
        gathered = [None] * dist.get_world_size()
        dist.gather_object(mine, gathered if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() != 0:
            return {}
    process = [None if g is None else g[0] for g in gathered]
    thread = [None if g is None else g[1] for g in gathered]
    return {"per_rank": process, "total": _total(process),
            "training_thread_per_rank": thread, "training_thread_total": _total(thread)}


def _total(per_rank: list[float | None]) -> float | None:
    return None if None in per_rank else sum(v for v in per_rank if v is not None)


def write_metrics(path: Path, settings: RunSettings, history: TrainingHistory,
                  extra: dict[str, Any]) -> dict[str, Any]:
    """Write ``metrics.json`` and return what was written."""
    losses = history.loss_values()
    iteration_ms = [s * 1e3 for s in history.iteration_seconds]
    load = history.expert_load_total
    loop_s = sum(history.iteration_seconds)
    metrics: dict[str, Any] = {
        "api": settings.api,
        "accelerator": settings.hardware.accelerator,
        "model": settings.model.name,
        "precision": settings.precision,
        "layout": {"pp": settings.layout.pp, "dp": settings.layout.dp,
                   "dp_shard": settings.layout.dp_shard, "ep": settings.layout.ep,
                   "microbatches": settings.layout.microbatches},
        "steps": len(losses),
        "global_batch": settings.global_batch,
        "tokens_per_step": settings.global_batch * settings.data.seq_len,
        "failures_injected": 0,
        "failures_before_resume": 0,
        "recoveries": [],
        "checkpoint_policy": "none",
        "checkpoint_overhead_pct": 0.0,
        "stall_ms": 0.0,
        "snapshot_bytes_per_iter": 0,
        "window": None,
        "loss": losses,
        "aux_loss": history.aux_losses.tolist(),
        "clip_coef": history.clip_coefs.tolist(),
        "dropped_assignments": 0 if history.dropped_total is None
        else int(history.dropped_total),
        "validation": [vars(v) for v in history.validation],
        "memory": history.memory,
        "iteration_ms": {
            "mean": statistics.fmean(iteration_ms) if iteration_ms else None,
            "median": statistics.median(iteration_ms) if iteration_ms else None,
            "per_step": iteration_ms,  # recoveries inside the iteration they interrupted
        },
        "expert_load": load.tolist() if load is not None else [],
    }
    metrics.update(extra)
    if settings.checkpoint.paired_blocks is not None:  # the bench pairs the blocks' steps
        metrics["paired_blocks"] = settings.checkpoint.paired_blocks
    metrics["ettr"] = loop_ettr(loop_s, metrics)
    text = json.dumps(metrics, indent=2).encode()
    write_atomically(path, lambda file: file.write(text))
    return metrics


def loop_ettr(loop_s: float, metrics: dict[str, Any]) -> float | None:
    """The run's own ETTR: the share of its training-loop time (the sum of iteration times,
    recoveries included since they run inside the iteration they interrupt) spent neither
    recovering nor stalled on a checkpoint copy. It cannot see slowdowns that are not
    stalls (a copy thread competing with compute); ``recipes/bench.py`` measures those
    against a checkpoint-free run."""
    if loop_s <= 0:
        return None
    recovery_s = sum(r["timings_s"]["total"] for r in metrics.get("recoveries", []))
    stall_s = metrics.get("stall_ms", 0.0) / 1e3
    return max(loop_s - recovery_s - stall_s, 0.0) / loop_s


def plot_training(path: Path, history: TrainingHistory, title: str) -> None:
    """Loss curve (train and validation) and the layer x expert popularity heatmap."""
    losses = history.loss_values()
    fig, (ax_loss, ax_heat) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_loss.plot(range(1, len(losses) + 1), losses, label="train", linewidth=1)
    if history.validation:
        ax_loss.plot([v.step for v in history.validation], [v.loss for v in history.validation],
                     "o-", label="validation")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy (nats/byte)")
    ax_loss.set_title(f"loss — {title}")
    ax_loss.legend()
    if history.expert_load_total is not None:
        load = history.expert_load_total.float().cpu()
        share = load / load.sum(dim=1, keepdim=True).clamp(min=1)
        image = ax_heat.imshow(share.numpy(), aspect="auto", cmap="viridis")
        ax_heat.set_xticks(range(share.shape[1]))
        ax_heat.set_yticks(range(share.shape[0]))
        ax_heat.set_xlabel("expert")
        ax_heat.set_ylabel("layer")
        ax_heat.set_title("expert popularity (share of routed tokens)")
        fig.colorbar(image, ax=ax_heat)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
