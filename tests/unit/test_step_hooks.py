"""The end of an iteration: hooks that record what a replay needs see it first, and a
collective that breaks in another hook (a peer died after the update) is handed to the
recovery while the iteration itself stands."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from typing_extensions import override

from lightning_moe_ckpt.core.target import StepHooks, StepResult
from lightning_moe_ckpt.training.engine import TrainingEngine
from moe_recipes.settings import settings_from_config

BROKEN = "Connection reset by peer"


class _Recorder(StepHooks):
    records_for_replay = True

    def __init__(self, calls: list[tuple[str, int]]) -> None:
        self.calls = calls

    @override
    def after_optimizer_step(self, step: int, result: StepResult) -> None:
        self.calls.append(("recorded", step))


class _BrokenCollective(StepHooks):
    @override
    def after_optimizer_step(self, step: int, result: StepResult) -> None:
        raise RuntimeError(BROKEN)


class _Recovers(StepHooks):
    """Stands for the real-failure handler: the job recovered, this rank kept its state."""

    def __init__(self, calls: list[tuple[str, int]]) -> None:
        self.calls = calls

    @override
    def iteration_failed(self, step: int, error: BaseException) -> bool:
        self.calls.append(("recovered", step))
        return True


def _engine_and_batch() -> tuple[TrainingEngine, torch.Tensor]:
    settings = settings_from_config(OmegaConf.create({
        "model": {"max_seq_len": 16}, "data": {"seq_len": 16},
        "trainer": {"global_batch": 8, "max_steps": 4}}))
    tokens = torch.randint(0, 256, (2, 4, 17), generator=torch.Generator().manual_seed(3))
    return TrainingEngine.local(settings), tokens


def test_recorders_see_the_iteration_before_a_hook_whose_collective_breaks() -> None:
    engine, tokens = _engine_and_batch()
    calls: list[tuple[str, int]] = []
    # The recorder is listed last and still records first.
    engine.hooks[:] = [_BrokenCollective(), _Recovers(calls), _Recorder(calls)]
    result = engine.train_iteration(tokens[..., :-1], tokens[..., 1:])
    assert calls == [("recorded", 0), ("recovered", 1)]
    assert engine.step == 1  # the iteration stands: the loop goes on at step 1
    assert torch.isfinite(result.loss)


def test_without_a_recovery_the_broken_collective_propagates() -> None:
    engine, tokens = _engine_and_batch()
    calls: list[tuple[str, int]] = []
    engine.hooks[:] = [_BrokenCollective(), _Recorder(calls)]
    with pytest.raises(RuntimeError, match=BROKEN):
        engine.train_iteration(tokens[..., :-1], tokens[..., 1:])
    assert calls == [("recorded", 0)] and engine.step == 1
