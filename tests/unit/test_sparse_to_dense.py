"""Sparse-to-dense conversion in one process: after a failure anywhere, recovery from the
persisted window reproduces the run that never failed, bitwise."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from lightning_moe_ckpt.callbacks import SparseCheckpointing
from lightning_moe_ckpt.core.precision import PRECISIONS, Precision
from lightning_moe_ckpt.recovery.sparse_to_dense import recover_from_store
from lightning_moe_ckpt.snapshots.codec import CorruptCheckpointError
from lightning_moe_ckpt.training.consolidate import consolidated_state
from lightning_moe_ckpt.training.engine import TrainingEngine
from moe_recipes.settings import settings_from_config

STEPS, WINDOW = 14, 3


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (2, 4, 17), generator=torch.Generator().manual_seed(step))
    return tokens[..., :-1], tokens[..., 1:]


@torch.no_grad()
def destroy(engine: TrainingEngine) -> None:
    """What a dead worker loses: weights become garbage, optimizer state is gone."""
    for param in engine.model.parameters():
        param.fill_(float("nan"))
    for master in engine.optimizer.master.values():
        master.fill_(float("nan"))
    engine.optimizer.inner.state.clear()


@functools.cache
def golden(precision: Precision) -> tuple[dict[str, Any], list[float]]:
    state, losses, _ = run(precision, None)
    return state, losses


class AgreedWindow:
    """What peers with more operators would agree on: a fixed W, whatever this rank needs."""

    def __init__(self, window: int) -> None:
        self.window, self.proposals = window, 0

    def start(self, window: int) -> None:
        self.proposals += 1

    def result(self) -> int:
        return self.window


def run(precision: Precision, fail_at: int | None, steps: int = STEPS,
        model: dict[str, int] | None = None, agreement: AgreedWindow | None = None
        ) -> tuple[dict[str, Any], list[float], Any]:
    settings = settings_from_config(OmegaConf.create({
        "model": {"max_seq_len": 16, **(model or {})}, "data": {"seq_len": 16},
        "trainer": {"precision": precision, "global_batch": 8, "max_steps": steps}}))
    engine = TrainingEngine.local(settings)
    engine.batch = batch
    checkpointing = SparseCheckpointing("moevement", replicas=0, window=WINDOW)
    coordinator = checkpointing.attach(engine)
    if agreement is not None:
        coordinator.planner.window_agreement = agreement
    losses, report = [], None
    for step in range(steps):
        if step == fail_at:
            coordinator.capture.wait_copies()  # no copy may read the garbage
            destroy(engine)
            assert all(torch.isnan(p).all() for p in engine.model.parameters())
            report = recover_from_store(coordinator, failed_step=step)
        losses.append(float(engine.train_iteration(*batch(step)).loss))
    checkpointing.close()
    return consolidated_state(engine.model, engine.optimizer, STEPS), losses, report


def assert_bitwise(a: dict[str, Any], b: dict[str, Any]) -> None:
    for section in ("model", "compute"):
        for name, tensor in a[section].items():
            assert torch.equal(tensor, b[section][name]), (section, name)
    for name, entries in a["optimizer"].items():
        assert entries.keys() == b["optimizer"][name].keys(), name
        for key, tensor in entries.items():
            assert torch.equal(tensor, b["optimizer"][name][key]), (name, key)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("fail_at", [1, 4, 8, 13],
                         ids=lambda s: f"fail{s}")
def test_recovery_is_bitwise_equal_to_the_fault_free_run(precision: Precision,
                                                         fail_at: int) -> None:
    golden_state, golden_losses = golden(precision)
    state, losses, report = run(precision, fail_at)
    assert report is not None and report.failed_step == fail_at  # the failure fired
    assert_bitwise(golden_state, state)
    assert losses == golden_losses
    # Rolled back at most two windows (plus the snapshot still being checksummed).
    assert 0 <= fail_at - report.window_start <= 2 * WINDOW + 1
    if fail_at < WINDOW:
        assert report.window_start == -1  # before any window persisted: the initial state
    else:
        assert report.window == WINDOW and report.replayed == fail_at - report.window_start - 1


def test_window_agreed_beyond_this_ranks_operators_recovers_bitwise() -> None:
    """Peers (other pipeline stages) agreed on a W larger than this rank's operator count:
    the last turns of each window capture nothing, and recovery is still exact."""
    model = {"n_layers": 1, "n_experts": 2}
    settings = settings_from_config(OmegaConf.create({"model": {"max_seq_len": 16, **model},
                                                      "data": {"seq_len": 16}}))
    probe = SparseCheckpointing("moevement", replicas=0, window=WINDOW)
    operators = len(probe.attach(TrainingEngine.local(settings)).planner.specs)
    probe.close()
    window = operators + 3
    agreement = AgreedWindow(window)
    steps, fail_at = 3 * window + 2, 2 * window + 3
    golden_state, golden_losses, _ = run("32", None, steps, model, AgreedWindow(window))
    state, losses, report = run("32", fail_at, steps, model, agreement)
    assert agreement.proposals > 1  # the planner did consult the agreement
    assert report is not None and report.failed_step == fail_at
    assert report.window == window and report.window_start >= window
    assert report.replayed == fail_at - report.window_start - 1
    assert_bitwise(golden_state, state)
    assert losses == golden_losses


def test_a_piece_corrupted_in_host_memory_is_refused_not_restored() -> None:
    """Local snapshots are verified like fetched replicas: one flipped bit in the host
    store makes recovery fail naming the piece (no replica here to take its place)."""
    settings = settings_from_config(OmegaConf.create({
        "model": {"max_seq_len": 16}, "data": {"seq_len": 16},
        "trainer": {"global_batch": 8, "max_steps": STEPS}}))
    engine = TrainingEngine.local(settings)
    engine.batch = batch
    checkpointing = SparseCheckpointing("moevement", replicas=0, window=WINDOW)
    coordinator = checkpointing.attach(engine)
    for step in range(2 * WINDOW + 1):
        engine.train_iteration(*batch(step))
    coordinator.drain()
    record = coordinator.store.persisted()
    assert record is not None and record.start >= 0
    snapshot = record.snapshots[record.start + 1]
    operator, piece = next(iter(snapshot.pieces.items()))
    flat = next(iter(piece.tensors.values())).view(-1).view(torch.uint8)
    flat[len(flat) // 2] ^= 4
    with pytest.raises(CorruptCheckpointError,
                       match=rf"operator '{operator}', iteration {snapshot.step} fails"):
        recover_from_store(coordinator, failed_step=2 * WINDOW + 1)
    checkpointing.close()
