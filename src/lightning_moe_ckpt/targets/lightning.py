"""A user's LightningModule under ``L.Trainer`` as a :class:`~.base.TrainingTarget`.

Replay runs the module's own ``training_step`` on a logged batch through the Trainer's
strategy, exactly as the fit loop does it:

* automatic optimization: a closure of ``strategy.training_step`` (through the DDP
  wrapper when there is one), ``optimizer_zero_grad`` and ``strategy.backward``, stepped
  by ``LightningModule.optimizer_step`` (so ``on_before_optimizer_step`` and
  ``configure_gradient_clipping`` run as in training);
* manual optimization: ``strategy.training_step``, which steps the optimizer itself.

After a replayed step the target steps the LR schedulers as the Trainer does after an
optimizer step (``interval="step"``, every ``frequency`` batches of the epoch; manual
optimization steps its own inside ``training_step``, which the replay runs).

Gradient clipping by norm (``Trainer(gradient_clip_val=...)`` or
``self.clip_gradients(...)`` in manual optimization) runs through the precision plugin's
``clip_grad_by_norm``, which this target routes through
:meth:`~.user_loop.UserLoopTarget.clip_gradients` so the coefficient is logged and, in
replay, the logged one applied. Configurations the core cannot protect fail at setup with
the setting named: gradient accumulation, several optimizers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_moe_ckpt.core.batch_log import BatchRecord
from lightning_moe_ckpt.core.operators import OperatorOverride
from lightning_moe_ckpt.core.precision import MasterWeightOptimizer
from lightning_moe_ckpt.core.registry import OperatorRegistry
from lightning_moe_ckpt.core.target import IterationAborted
from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.targets.telemetry import RouterParser, RouterTelemetry, configured_top_k
from lightning_moe_ckpt.targets.user_loop import (
    UserLoopTarget,
    full_model_shape,
    user_parallelism,
)


def check_protectable(trainer: L.Trainer) -> None:
    """Fail loudly on a Trainer configuration sparse checkpointing cannot protect."""
    if trainer.accumulate_grad_batches != 1:
        raise ConfigError(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not "
            "supported by SparseCheckpointing: a snapshot follows every optimizer step and "
            "replay reruns one batch per step; use accumulate_grad_batches=1 (larger "
            "batches, or micro-batches inside training_step)")
    precision = str(trainer.precision)
    if precision.startswith("16"):
        raise ConfigError(
            f"Trainer(precision={precision!r}) is not supported by SparseCheckpointing: its "
            "gradient scaler skips optimizer steps, which replay cannot reproduce; use "
            "bf16-mixed, bf16-true or 32-true")
    if len(trainer.optimizers) != 1:
        raise ConfigError(
            f"SparseCheckpointing protects one optimizer; configure_optimizers returned "
            f"{len(trainer.optimizers)}")


class LightningTarget(UserLoopTarget):
    """The Trainer's LightningModule, its one optimizer and its LR schedulers."""

    def __init__(self, trainer: L.Trainer, module: L.LightningModule,
                 override: OperatorOverride | None = None, top_k: int | None = None,
                 router_parser: RouterParser | None = None) -> None:
        check_protectable(trainer)
        # DDP's reducer expects a gradient for every parameter it registered, so frozen
        # parameters keep requires_grad and are restored around the step instead.
        registry = OperatorRegistry(module, override,
                                    freeze_by_restore=isinstance(trainer.strategy, DDPStrategy))
        parallelism = user_parallelism(trainer.strategy)
        telemetry = RouterTelemetry(module, registry, configured_top_k(module, top_k),
                                    router_parser, full_model_shape(parallelism))
        super().__init__(module, trainer.optimizers[0], registry,
                         [config.scheduler for config in trainer.lr_scheduler_configs],
                         telemetry if telemetry.active else None, trainer.world_size,
                         parallelism)
        self.trainer = trainer
        self.module = module
        self._route_clipping()

    def _route_clipping(self) -> None:
        plugin = self.trainer.precision_plugin

        def clip_grad_by_norm(optimizer: Any, clip_val: int | float) -> None:
            if isinstance(optimizer, MasterWeightOptimizer):
                optimizer.collect_grads()  # the masters' gradients are what steps
            self.clip_gradients([p.grad for p in plugin.main_params(optimizer)
                                 if p.grad is not None], float(clip_val))

        # An instance attribute: only this Trainer's plugin is rerouted.
        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    @override
    def start_iteration(self, batch: Any, batch_idx: int) -> None:
        step = self.step
        if self.trainer.global_step != step:
            raise RuntimeError(
                f"the Trainer is at step {self.trainer.global_step} but SparseCheckpointing "
                f"counted {step} optimizer steps: an optimizer step ran outside the "
                "protected optimizer, or was skipped")
        try:
            super().start_iteration(batch, batch_idx)
        except IterationAborted:  # a peer failed, and this rank had run past that step
            self.catch_up(step)

    @override
    def loop_epoch(self) -> int:
        return self.trainer.current_epoch

    @override
    def advance_schedule(self, batch_idx: int) -> None:
        if not self.module.automatic_optimization:
            return
        for config in self.trainer.lr_scheduler_configs:
            if (config.interval == "step" and not config.reduce_on_plateau
                    and (batch_idx + 1) % config.frequency == 0):
                self.module.lr_scheduler_step(config.scheduler, None)

    @override
    def run_step(self, record: BatchRecord) -> None:
        with trainer_counters_at(self.trainer, self.step, record.epoch):
            self._run_step(record)

    def _run_step(self, record: BatchRecord) -> None:
        trainer, strategy = self.trainer, self.trainer.strategy
        batch = strategy.batch_to_device(record.batch)
        if not self.module.automatic_optimization:
            strategy.training_step(batch, record.batch_idx)
            return
        optimizer = self.module.optimizers()
        assert not isinstance(optimizer, list)

        def closure() -> torch.Tensor | None:
            output = strategy.training_step(batch, record.batch_idx)
            loss = output["loss"] if isinstance(output, Mapping) else output
            self.module.optimizer_zero_grad(trainer.current_epoch, record.batch_idx,
                                            optimizer.optimizer)
            if loss is not None:
                strategy.backward(loss, optimizer.optimizer)
            return loss

        self.module.optimizer_step(trainer.current_epoch, record.batch_idx, optimizer,
                                   closure)


_COUNTERS = ("ready", "started", "processed", "completed")


def _optimizer_step_progress(trainer: L.Trainer) -> Any:
    """The Trainer's count of optimizer steps (``global_step`` reads its ``completed``)."""
    loop = trainer.fit_loop.epoch_loop
    if trainer.lightning_module.automatic_optimization:
        return loop.automatic_optimization.optim_progress.optimizer.step.total
    return loop.manual_optimization.optim_step_progress.total


@contextmanager
def trainer_counters_at(trainer: L.Trainer, step: int, epoch: int) -> Iterator[None]:
    """While a logged iteration runs again, ``trainer.global_step`` and
    ``trainer.current_epoch`` (and the logging step) read what they read when it ran
    first, for a ``training_step`` that depends on them (a curriculum, a warm-up); the
    Trainer's own counts are put back afterwards."""
    progress = _optimizer_step_progress(trainer)
    loop = trainer.fit_loop.epoch_loop
    epochs = trainer.fit_loop.epoch_progress.current
    saved = progress.ready, progress.completed, epochs.completed, loop._batches_that_stepped
    progress.ready = progress.completed = step
    epochs.completed = epoch
    loop._batches_that_stepped = step
    try:
        yield
    finally:
        progress.ready, progress.completed, epochs.completed, loop._batches_that_stepped = saved


def align_trainer_step(trainer: L.Trainer, step: int, batches: bool,
                       batches_per_epoch: int | None = None) -> None:
    """Make the Trainer count ``step`` optimizer steps (and, with ``batches``, ``step``
    batches run), as if it had run them.

    A replacement joins a running job at ``step`` before its first batch: both counts are
    set (and, given ``batches_per_epoch``, the epoch and the position in it). A survivor
    whose iteration a peer's failure aborted (possibly after its optimizer stepped)
    retries it inside the same batch: only the optimizer steps are set back, the batch it
    is in counts once. Data position, validation and ``max_steps`` follow these counters,
    and they must agree on every rank."""
    loop = trainer.fit_loop.epoch_loop
    optimizer_steps = _optimizer_step_progress(trainer)
    optimizer_steps.ready = optimizer_steps.completed = step
    if not batches:
        return
    for counter in _COUNTERS:
        setattr(loop.batch_progress.total, counter, step)
    loop._batches_that_stepped = step  # the logging step
    if batches_per_epoch is not None:
        epoch, index = divmod(step, batches_per_epoch)
        for counter in _COUNTERS:
            setattr(loop.batch_progress.current, counter, index)
            setattr(trainer.fit_loop.epoch_progress.current, counter, epoch)
            setattr(trainer.fit_loop.epoch_progress.total, counter, epoch)


def skip_first_sigterm_broadcast(trainer: L.Trainer) -> None:
    """Lightning broadcasts a SIGTERM flag from rank 0 before every batch (outside the
    strategy). The survivors made that broadcast for the batch the failure interrupted and
    retry it inside that batch, so a replacement joining at that batch skips it once."""
    loop = trainer.fit_loop.epoch_loop
    broadcast = loop._broadcast_sigterm_tensor

    def skip_once() -> None:
        loop._broadcast_sigterm_tensor = broadcast  # type: ignore[method-assign]

    loop._broadcast_sigterm_tensor = skip_once  # type: ignore[method-assign]


def request_stop(trainer: L.Trainer) -> None:
    """Stop training at the end of this batch, as a SIGTERM to this process would in
    Lightning: its epoch loop raises ``SIGTERMException`` at the end of a batch during
    which the flag was set. Set here on the training thread, at a batch boundary, instead
    of by Lightning's signal handler (which broadcasts from inside the handler). Lightning
    keeps the flag on its signal connector (no public setter)."""
    trainer._signal_connector.received_sigterm = True


def stop_peers(trainer: L.Trainer) -> None:
    """On rank 0, once it stopped on :func:`request_stop`: make the broadcast the other
    ranks wait in at the start of their next batch (Lightning's per-batch broadcast of
    rank 0's SIGTERM flag, which stops them with ``SIGTERMException`` before they run it)
    and its barrier, as Lightning's loop does on rank 0 when the flag is set before a
    batch. Every rank then stops at the same step."""
    flag = torch.tensor([1], device=trainer.strategy.root_device)
    torch.distributed.broadcast(flag, src=0)
    torch.distributed.barrier()
