"""Runs a user's LightningModule with sparse checkpointing, with and without a failure.

One function, :func:`fit`, trains a fresh model with ``L.Trainer`` and the library's
``SparseCheckpointing`` (plus a ``FailureInjector`` when a failure is scheduled) and
returns what the tests compare: every parameter, every optimizer-state tensor, the loss
of every step and the callbacks. Losses are recorded per step at batch end, so the
iterations a recovery replays do not count twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from torch import nn

from lightning_moe_ckpt.callbacks import SparseCheckpointing
from lightning_moe_ckpt.core.target import TrainingTarget
from lightning_moe_ckpt.testing import AtSchedule, FailureInjector
from tests.anymodel.models import LMModule, random_token_loader

STEPS = 10
WINDOW = 3
FAIL_AT = 7  # mid-window: windows start at 0, 3, 6, so SS_3..SS_5 is the persisted one


class StepLosses(L.Callback):
    """The loss of each completed step, and what the replays saw."""

    def __init__(self) -> None:
        self.losses: dict[int, torch.Tensor] = {}
        self.frozen_during_replay: list[int] = []  # frozen operators per replayed step
        self.clip_during_replay: list[float] = []  # the logged clip coefficient applied

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        checkpointing = next(c for c in trainer.callbacks if isinstance(c, SparseCheckpointing))
        target = checkpointing.target
        assert target is not None
        replay = target.replay_iteration

        def spied(step: int, clip: torch.Tensor | None) -> None:
            self.frozen_during_replay.append(len(target.registry.frozen()))
            if clip is not None:
                self.clip_during_replay.append(float(clip))
            replay(step, clip)

        target.replay_iteration = spied  # type: ignore[method-assign]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        module = pl_module
        assert isinstance(module, LMModule)
        self.losses[trainer.global_step - 1] = module.losses[-1]


@dataclass
class Run:
    """What one training run left behind."""

    params: dict[str, torch.Tensor]
    optimizer_state: dict[str, dict[str, torch.Tensor]]
    losses: dict[int, torch.Tensor]
    checkpointing: SparseCheckpointing
    injector: FailureInjector | None
    spy: StepLosses
    metrics: dict[str, Any] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer
                    ) -> dict[str, dict[str, torch.Tensor]]:
    """Optimizer state by parameter name (tensors cloned)."""
    names = {id(p): n for n, p in module.named_parameters()}
    return {names[id(p)]: {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
            for p, s in optimizer.state.items() if s}


def fit(builder: Callable[..., nn.Module], fail_at: int | None = None, *,
        manual: bool = False, precision: str = "32-true", clip: float | None = None,
        steps: int = STEPS, window: int = WINDOW, module_type: type[LMModule] = LMModule,
        batches_per_epoch: int = STEPS + 2, **checkpoint_options: Any) -> Run:
    """Train ``builder()``'s model for ``steps`` steps, failing rank 0 at ``fail_at``."""
    module = module_type(builder(seed=0), manual=manual, clip_val=clip if manual else None)
    checkpointing = SparseCheckpointing("moevement", replicas=0, window=window,
                                        **checkpoint_options)
    spy = StepLosses()
    callbacks: list[L.Callback] = [checkpointing, spy]
    injector = None
    if fail_at is not None:
        injector = FailureInjector(AtSchedule([{"step": fail_at, "rank": 0}]), checkpointing)
        callbacks.insert(1, injector)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, precision=precision,  # type: ignore[arg-type]
                        gradient_clip_val=None if manual else clip, callbacks=callbacks)
    trainer.fit(module, random_token_loader(n_batches=batches_per_epoch))
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    return Run(params, optimizer_state(module, trainer.optimizers[0]), spy.losses,
               checkpointing, injector, spy, checkpointing.metrics(1.0), buffers)


def assert_bitwise(reference: Run, failed: Run, after: int) -> None:
    """Every parameter, buffer, optimizer-state tensor and loss from ``after`` on are
    equal."""
    assert reference.params.keys() == failed.params.keys()
    for name, value in reference.params.items():
        assert torch.equal(value, failed.params[name]), name
    assert reference.buffers.keys() == failed.buffers.keys()
    for name, value in reference.buffers.items():
        assert torch.equal(value, failed.buffers[name]), name
    assert reference.optimizer_state.keys() == failed.optimizer_state.keys()
    for name, state in reference.optimizer_state.items():
        assert state.keys() == failed.optimizer_state[name].keys(), name
        for key, value in state.items():
            assert torch.equal(value, failed.optimizer_state[name][key]), (name, key)
    assert sorted(reference.losses) == sorted(failed.losses)
    for step in range(after, max(reference.losses) + 1):
        assert torch.equal(reference.losses[step], failed.losses[step]), step


def target_of(run: Run) -> TrainingTarget:
    """The training target the run's checkpointing protected."""
    assert run.checkpointing.target is not None
    return run.checkpointing.target
