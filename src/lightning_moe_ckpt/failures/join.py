"""Real failures of a user's LightningModule under a strategy that replaces failed ranks.

Under the supervisor (``python -m lightning_moe_ckpt.supervise``, see
:mod:`~lightning_moe_ckpt.failures.supervisor`) ``SparseCheckpointing`` protects a user's
module against workers that really die or hang (:func:`protect_user_module`): a
:class:`~lightning_moe_ckpt.training.pipeline_module.PipelineTrainable` module under
``TrainerMoEParallelStrategy``, or a module sharded with FSDP2 under Lightning's
``ModelParallelStrategy``. The strategy (or what stands in for it, a
:class:`~lightning_moe_ckpt.core.target.RankReplacement`) re-forms its process groups over
the live model:

* **survivors** run each optimizer step of the Trainer (forward, backward, clipping,
  update) through :meth:`~lightning_moe_ckpt.targets.user_loop.UserLoopTarget.guarded`:
  a collective broken by a dead peer turns into a recovery in the supervisor's next
  generation (process groups re-formed over the live model, then the same
  ``recover(...)`` as injected failures), and the step runs again;
* **a replacement** (a new process, or a warm spare, given the failed rank) keeps its
  Trainer's start-up collectives local, recovers the rank's state from its peers, moves
  its Trainer to the iteration the job resumes at and starts its train DataLoader there
  (:func:`join_running_job`, :class:`JoiningLoader`).

What a replacement cannot take from its peers it takes from the loop's determinism, and
:func:`check_replaceable` refuses at set-up what it could not reproduce: the train
DataLoader must be sized and yield the same batches in a new process (the batches before
the resumed iteration are read again: the replay takes its batches from them, the rest
are dropped), and LR schedulers must step per batch (``interval="step"``) under automatic
optimization (a manually stepped scheduler moves after the snapshot its optimizer step
takes, so a replacement would replay it one step behind).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch.distributed as dist

from lightning_moe_ckpt.checkpointing.coordinator import CheckpointCoordinator
from lightning_moe_ckpt.core.batch_log import BatchRecord
from lightning_moe_ckpt.core.target import RankReplacement
from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.failures.rendezvous import JobStore
from lightning_moe_ckpt.failures.survivor import PeerFailureHandler
from lightning_moe_ckpt.recovery.upstream_log import UpstreamLog
from lightning_moe_ckpt.targets.lightning import (
    LightningTarget,
    align_trainer_step,
    skip_first_sigterm_broadcast,
)


def check_replaceable(trainer: L.Trainer, replacement: RankReplacement | None) -> None:
    """Fail at set-up on what a replacement process could not reproduce (see the module
    docstring); ``replacement``: how the Trainer's strategy replaces a failed rank (None:
    it cannot)."""
    if replacement is None or not replacement.replaces_failed_ranks:
        raise ConfigError(
            "under the supervisor, a user's LightningModule is protected against real "
            "failures when TrainerMoEParallelStrategy splits it (a PipelineTrainable "
            "module) or when Lightning's ModelParallelStrategy runs it sharded by FSDP2 "
            f"(fully_shard in configure_model); this Trainer runs "
            f"strategy={type(trainer.strategy).__name__}")
    if not trainer.lightning_module.automatic_optimization and trainer.lr_scheduler_configs:
        names = ", ".join(type(c.scheduler).__name__ for c in trainer.lr_scheduler_configs)
        raise ConfigError(
            f"automatic_optimization=False with lr_scheduler {names}: the snapshot of an "
            "iteration is taken at optimizer.step(), and a replacement process starts its "
            "LR schedule from it, so a scheduler stepped after that inside training_step "
            "would replay one step behind; under the supervisor use automatic optimization "
            "(interval='step' schedulers), or set optimizer.param_groups' 'lr' yourself "
            "before opt.step() and return no lr_scheduler")
    if trainer.lightning_module.automatic_optimization:
        for config in trainer.lr_scheduler_configs:
            if config.reduce_on_plateau or config.interval != "step":
                kind = "ReduceLROnPlateau" if config.reduce_on_plateau else "interval"
                raise ConfigError(
                    f"lr_scheduler {type(config.scheduler).__name__} ({kind}, "
                    f"interval={config.interval!r}): a replacement process replays the LR "
                    "schedule batch by batch; under the supervisor use interval='step' "
                    "schedulers that do not monitor metrics")
    if not isinstance(trainer.num_training_batches, int):
        raise ConfigError(
            "the train DataLoader has no length: a process replacing a failed worker starts "
            "its loader at the iteration the job resumes, which needs a sized loader that "
            "yields the same batches in a new process (a map-style dataset)")


def protect_user_module(trainer: L.Trainer, target: LightningTarget,
                        coordinator: CheckpointCoordinator, upstream_log: UpstreamLog | None,
                        job: JobStore, strategy: RankReplacement) -> PeerFailureHandler:
    """Hook real-failure recovery into ``target`` (checkpointing attached already) and
    route the Trainer's optimizer steps through it (``strategy``: how the Trainer's
    strategy replaces a failed rank); a replacement joins the job here."""

    def reform_groups() -> None:  # in the order a joining process builds them
        strategy.reform_user_model()
        coordinator.reform_replication()

    def warm_up() -> None:
        strategy.warm_up_user_model(target.sample_batch())
        target.discard_telemetry()  # the warm-up's routing is no iteration's

    handler = PeerFailureHandler(job, target, coordinator, reform_groups, warm_up,
                                 dist.get_backend(), upstream_log,
                                 release_groups=strategy.release_user_model)
    target.hooks.insert(0, handler)  # heartbeat and generation check come first
    strategy.iteration_guard = target
    if job.replaces is not None:
        join_running_job(trainer, target, handler)
    return handler


def join_running_job(trainer: L.Trainer, target: LightningTarget,
                     handler: PeerFailureHandler) -> None:
    """A replacement's first act: recover the failed rank's state with the survivors
    (the replay reading its batches from the train DataLoader again), then stand where
    they resume."""
    loader = trainer.train_dataloader  # as the strategy processed it for a replacement
    if not isinstance(loader, JoiningLoader):
        raise RuntimeError("a replacement's train DataLoader was not set up for joining "
                           f"(got {type(loader).__name__})")
    target.reread = loader.batch_record
    handler.join_as_replacement()
    step = target.step
    align_trainer_step(trainer, step, batches=True, batches_per_epoch=loader.batches_per_epoch())
    loader.start = step
    skip_first_sigterm_broadcast(trainer)


class JoiningLoader:
    """The train loader of a process joining a running job.

    Its first pass starts at :attr:`start`, the iteration the job resumes at (set once the
    process recovered; the batches before it in its epoch are read and dropped); later
    passes are the loader's own. :meth:`batch_record` reads any iteration's batch again
    for the recovery's replay. ``sampler``/``batch_sampler`` are the loader's, so the
    Trainer still sets their epoch.
    """

    def __init__(self, loader: Any, batches_per_epoch: Callable[[], int | float]) -> None:
        self.loader = loader
        self._batches_per_epoch = batches_per_epoch
        self.start: int | None = None
        self._joined = False
        self._reader: tuple[int, int, Iterator[Any]] | None = None  # epoch, next index

    @property
    def sampler(self) -> Any:
        """The loader's sampler."""
        return getattr(self.loader, "sampler", None)

    @property
    def batch_sampler(self) -> Any:
        """The loader's batch sampler."""
        return getattr(self.loader, "batch_sampler", None)

    def __len__(self) -> int:
        return len(self.loader)

    def batches_per_epoch(self) -> int:
        """Iterations per epoch (the Trainer's count; a sized loader is checked at set-up)."""
        count = self._batches_per_epoch()
        assert isinstance(count, int)
        return count

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader) if self._joined else self._first_pass()

    def _first_pass(self) -> Iterator[Any]:
        # A generator: it runs when the loop asks for its first batch, after the recovery.
        if self.start is None:
            raise RuntimeError("the train DataLoader was read before this replacement "
                               "recovered the iteration it joins at")
        self._joined = True
        iterator = iter(self.loader)
        for _ in range(self.start % self.batches_per_epoch()):
            next(iterator)
        yield from iterator

    def batch_record(self, step: int) -> BatchRecord:
        """The batch of iteration ``step``, read again from the loader (reads run forward:
        a replay asks for consecutive iterations)."""
        epoch, index = divmod(step, self.batches_per_epoch())
        if self._reader is None or self._reader[0] != epoch or self._reader[1] > index:
            _set_sampler_epoch(self.loader, epoch)
            self._reader = (epoch, 0, iter(self.loader))
        _, position, iterator = self._reader
        for _ in range(index - position):
            next(iterator)
        batch = next(iterator)
        self._reader = (epoch, index + 1, iterator)
        return BatchRecord(step, batch, index, None, epoch)


def _set_sampler_epoch(loader: Any, epoch: int) -> None:
    """As the Trainer does at each epoch's start (a shuffling sampler's order)."""
    for name in ("sampler", "batch_sampler"):
        set_epoch = getattr(getattr(loader, name, None), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
