"""Last resort of a recovery: the durable dense checkpoint, or a clear error.

When no checkpoint window is usable (every replica of some piece lost or corrupt, or every
rank failed at once, so no host memory survived), recovery falls back to the newest
durable checkpoint that every rank wrote before the failure (``checkpoint.durable_every``,
written through the Trainer's checkpoint IO by :class:`SparseCheckpointing`): every rank
loads its file (model, master weights and optimizer state, LR schedule, step, RNG) and
replays,
all operators active, up to the failed iteration. Without one, the run stops with
:class:`NoUsableCheckpointError` saying what was missing; it never continues from an
inconsistent state.
"""

from __future__ import annotations

import re
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_moe_ckpt.core.collectives import all_gather_values
from lightning_moe_ckpt.core.rng import restore_rng
from lightning_moe_ckpt.core.target import TrainingTarget
from lightning_moe_ckpt.errors import NoUsableCheckpointError
from lightning_moe_ckpt.recovery.sparse_to_dense import RecoveryReport

if TYPE_CHECKING:
    import lightning.pytorch as pl

# Key of the RNG states in a durable checkpoint: Lightning's own checkpoint has none, and
# a model with dropout replays (or resumes) exactly only from the RNG of its step.
RNG_KEY = "lightning_moe_ckpt/rng"


def durable_step(path: str) -> int:
    """The step a durable checkpoint resumes at (its ``step=N.ckpt`` name)."""
    match = re.fullmatch(r"step=(\d+)\.ckpt", Path(path).name)
    if match is None:
        raise ValueError(f"{path!r} is not a durable checkpoint name (step=N.ckpt)")
    return int(match.group(1))


def newest_complete_durable(directory: str | Path, world_size: int) -> str | None:
    """The newest durable checkpoint in ``directory`` that every rank wrote whole, or None.

    A checkpoint is ``step=N.ckpt``: one file, or a directory of ``rank<NNNNN>.ckpt`` files
    (one per rank, ``MoEParallelStrategy``). Each file must be a whole zip archive, as
    ``torch.save`` writes it: its members' CRCs are checked (nothing is unpickled), so a
    write cut short by a failure is passed over for the one before it.

    Args:
        directory: The durable directory (``checkpoint.durable_dir``, ``durable_dir=``).
        world_size: The number of ranks whose files a per-rank checkpoint must hold.
    """
    root = Path(directory)
    if not root.is_dir():
        return None
    found = [(durable_step(str(path)), path) for path in root.glob("step=*.ckpt")
             if re.fullmatch(r"step=\d+\.ckpt", path.name)]
    for _, path in sorted(found, reverse=True):
        files = ([path] if path.is_file() else
                 [path / f"rank{rank:05d}.ckpt" for rank in range(world_size)])
        if all(_whole_archive(file) for file in files):
            return str(path)
    return None


def _whole_archive(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip() is None
    except (OSError, zipfile.BadZipFile):
        return False


def agree_on_durable(saved: Sequence[str], failed_step: int) -> str | None:
    """The newest durable checkpoint before ``failed_step`` that every rank wrote
    (collective when a process group is up); ``None`` when there is none."""
    mine = {durable_step(p): p for p in saved if durable_step(p) <= failed_step}
    steps = set(mine)
    if dist.is_available() and dist.is_initialized():
        everyone: list[Any] = all_gather_values(sorted(steps))
        for theirs in everyone:
            steps &= set(theirs)
    return mine[max(steps)] if steps else None


def recover_from_durable(trainer: pl.Trainer | None, engine: TrainingTarget, saved: Sequence[str],
                         failed_step: int, cause: Exception) -> RecoveryReport:
    """Load the agreed durable checkpoint through ``trainer``'s strategy and replay to
    ``failed_step``; raises :class:`NoUsableCheckpointError` (chained to ``cause``) when
    there is no durable checkpoint to fall back to."""
    started = time.perf_counter()
    if trainer is None or (path := agree_on_durable(saved, failed_step)) is None:
        raise NoUsableCheckpointError(
            f"recovery from the failure at step {failed_step} found no usable checkpoint "
            f"window ({cause}) and no durable checkpoint to fall back to (set "
            "checkpoint.durable_every and checkpoint.durable_dir, Trainer API)") from cause
    strategy = trainer.strategy
    strategy.checkpoint_io.teardown()  # asynchronous writes (AsyncCheckpointIO) finish first
    checkpoint = strategy.load_checkpoint(path)
    if RNG_KEY in checkpoint:
        restore_rng(checkpoint[RNG_KEY])
    strategy.load_model_state_dict(checkpoint)
    strategy.load_optimizer_state_dict(checkpoint)
    for config, state in zip(trainer.lr_scheduler_configs, checkpoint["lr_schedulers"],
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
    engine.resume_at(failed_step)
    report.phases_s["replay"] = time.perf_counter() - replaying
    return report
