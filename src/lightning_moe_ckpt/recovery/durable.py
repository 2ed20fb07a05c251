"""Last resort of a recovery, and what a job started again resumes from: the newest
committed durable checkpoint that verifies.

Durable checkpoints are committed by their manifests
(:mod:`~lightning_moe_ckpt.recovery.manifest`). :func:`newest_committed_durable` finds the
newest one whose every file verifies against its manifest, skipping (and logging) the
damaged ones; it refuses one of another parallel layout, and when checkpoints are there
but none is usable it raises :class:`NoUsableCheckpointError` instead of letting a run
start afresh. When no checkpoint window is usable (every replica of some piece lost or
corrupt, or every rank failed at once, so no host memory survived), recovery loads the
newest committed durable checkpoint before the failure that every rank verified (each rank
reads a share of its files) and replays, all operators active, up to the failed
iteration. Without one, the run stops with :class:`NoUsableCheckpointError` saying what was
missing; it never continues from an inconsistent state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_moe_ckpt.core.collectives import all_gather_values
from lightning_moe_ckpt.core.progress import RECOVERY
from lightning_moe_ckpt.core.rng import restore_rng
from lightning_moe_ckpt.core.target import TrainingTarget
from lightning_moe_ckpt.errors import ConfigError, CorruptCheckpointError, NoUsableCheckpointError
from lightning_moe_ckpt.recovery.manifest import (
    Manifest,
    checkpoint_path,
    committed_steps,
    read_manifest,
    verify,
)
from lightning_moe_ckpt.recovery.sparse_to_dense import RecoveryReport

__all__ = ["RNG_KEY", "DurableSource", "check_layout", "describe_checkpoint_layout",
           "newest_committed_durable", "recover_from_durable", "verify_collectively"]

log = logging.getLogger("lightning_moe_ckpt")

# Key of the RNG states in a durable checkpoint: Lightning's own checkpoint has none, and
# a model with dropout replays (or resumes) exactly only from the RNG of its step.
RNG_KEY = "lightning_moe_ckpt/rng"

# The layout keys of a checkpoint with one file per rank (MoEParallelStrategy): it resumes
# only at that layout. Other checkpoints (one file; a DCP directory) name the world size.
_PER_RANK_KEYS = ("pp", "dp", "dp_shard", "ep")


def describe_checkpoint_layout(layout: Mapping[str, Any]) -> str:
    """A layout as a manifest records it, for messages."""
    if all(key in layout for key in _PER_RANK_KEYS):
        parts = [f"pp={layout['pp']}", f"dp={layout['dp']}"]
        if layout["dp_shard"] != 1:
            parts.append(f"dp_shard={layout['dp_shard']}")
        parts.append(f"ep={layout['ep']}")
        return f"{' x '.join(parts)} ({layout['world_size']} ranks)"
    return f"{layout.get('world_size', '?')} rank(s)"


def check_layout(checkpoint: str | Path, manifest: Manifest,
                 layout: Mapping[str, Any]) -> None:
    """Refuse ``checkpoint`` when it cannot be resumed at ``layout`` (one file per rank of
    another layout, or the other way round).

    Raises:
        ConfigError: One line naming both layouts.
    """
    written = manifest.layout
    per_rank = any(key in written for key in _PER_RANK_KEYS) or any(
        key in layout for key in _PER_RANK_KEYS)
    if per_rank and {k: written.get(k) for k in (*_PER_RANK_KEYS, "world_size")} != {
            k: layout.get(k) for k in (*_PER_RANK_KEYS, "world_size")}:
        raise ConfigError(
            f"durable checkpoint {checkpoint} was written by the layout "
            f"{describe_checkpoint_layout(written)}; this run's is "
            f"{describe_checkpoint_layout(layout)}: resume it at its own layout (resuming at "
            "another layout is not supported yet), or start afresh with another "
            "checkpoint.durable_dir")


def newest_committed_durable(directory: str | Path, layout: Mapping[str, Any] | None = None,
                             before: int | None = None) -> str | None:
    """The newest committed durable checkpoint in ``directory`` (at step ``before`` or
    earlier, when given) whose every file verifies against its manifest, or ``None`` when
    none is committed there. A damaged one is skipped for the next older, logged with the
    reason.

    Args:
        directory: The durable directory (``checkpoint.durable_dir``, ``durable_dir=``).
        layout: The layout this run resumes at (``None``: not checked); a checkpoint
            written by another is refused.
        before: Only checkpoints of this step or earlier.

    Raises:
        NoUsableCheckpointError: Committed checkpoints are there but none verifies.
        ConfigError: The newest verified checkpoint was written by another layout.
    """
    steps = [s for s in committed_steps(directory) if before is None or s <= before]
    problems: list[str] = []
    for step in reversed(steps):
        path = checkpoint_path(directory, step)
        try:
            manifest = verify(path)
        except CorruptCheckpointError as error:
            log.warning("durable tier: skipping %s: %s", path.name, error)
            problems.append(str(error))
            continue
        if layout is not None:
            check_layout(path, manifest, layout)
        return str(path)
    if problems:
        raise NoUsableCheckpointError(
            f"checkpoint.durable_dir={str(directory)!r} holds {len(problems)} committed "
            f"durable checkpoint(s) and none verifies ({'; '.join(problems)}): refusing to "
            "start afresh over them; restore the files, or move them away to start afresh")
    return None


def verify_collectively(checkpoint: str | Path) -> str | None:
    """Verify ``checkpoint`` with every rank of the default process group reading a share
    of its files (collective when a group is up); what failed, or ``None`` when every
    file verified on every rank."""
    path = Path(checkpoint)
    rank, world = 0, 1
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    problem: str | None = None
    try:
        names = sorted(read_manifest(path).files)
        verify(path, only=names[rank::world])
    except CorruptCheckpointError as error:
        problem = str(error)
    if world == 1:
        return problem
    found = [p for p in all_gather_values(problem) if p is not None]
    return found[0] if found else None


@dataclass(frozen=True)
class DurableSource:
    """Where a recovery finds durable checkpoints, and how it loads one.

    Args:
        trainer: The Lightning Trainer whose strategy loads them.
        directory: The durable directory.
        drain: Finishes this rank's durable writes in flight (their commits) first.
    """

    trainer: Any
    directory: str
    drain: Callable[[], None] = lambda: None


def _agreed_checkpoint(directory: str, failed_step: int) -> tuple[str | None, list[str]]:
    """The newest committed checkpoint at or before ``failed_step`` that verifies on every
    rank (collective), and what failed for the newer ones."""
    skipped: list[str] = []
    for step in reversed([s for s in committed_steps(directory) if s <= failed_step]):
        path = str(checkpoint_path(directory, step))
        problem = verify_collectively(path)
        if problem is None:
            return path, skipped
        log.warning("durable tier: skipping %s: %s", Path(path).name, problem)
        skipped.append(problem)
    return None, skipped


def recover_from_durable(source: DurableSource | None, engine: TrainingTarget,
                         failed_step: int, cause: Exception) -> RecoveryReport:
    """Load the newest committed durable checkpoint every rank verified through the
    Trainer's strategy and replay to ``failed_step``; raises
    :class:`NoUsableCheckpointError` (chained to ``cause``) when there is none."""
    started = time.perf_counter()
    path: str | None = None
    skipped: list[str] = []
    if source is not None:
        source.drain()
        path, skipped = _agreed_checkpoint(source.directory, failed_step)
    if source is None or path is None:
        damaged = f"; damaged: {'; '.join(skipped)}" if skipped else ""
        raise NoUsableCheckpointError(
            f"recovery from the failure at step {failed_step} found no usable checkpoint "
            f"window ({cause}) and no committed durable checkpoint to fall back to{damaged} "
            "(set checkpoint.durable_every and checkpoint.durable_dir)") from cause
    strategy = source.trainer.strategy
    checkpoint = strategy.load_checkpoint(path)
    if RNG_KEY in checkpoint:
        restore_rng(checkpoint[RNG_KEY])
    strategy.load_model_state_dict(checkpoint)
    strategy.load_optimizer_state_dict(checkpoint)
    for config, state in zip(source.trainer.lr_scheduler_configs, checkpoint["lr_schedulers"],
                             strict=True):
        config.scheduler.load_state_dict(state)
    start = int(checkpoint["global_step"])
    report = RecoveryReport(start, 0, failed_step)
    report.phases_s["fetch"] = time.perf_counter() - started
    engine.registry.set_frozen(engine.registry.names, frozen=False)
    engine.set_step(start)
    replaying = time.perf_counter()
    with engine.hooks_suspended():  # replay re-takes no snapshots
        for step in range(start, failed_step):
            engine.replay_iteration(step, None)
            report.replayed += 1
            RECOVERY.mark()
    engine.resume_at(failed_step)
    report.phases_s["replay"] = time.perf_counter() - replaying
    return report
