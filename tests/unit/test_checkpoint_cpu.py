"""What a rank's checkpointing reports of its own CPU cost: the training thread's time in
the step hooks is CPU time, and its wait for the snapshot copies (the stall) is not."""

from __future__ import annotations

import time

import pytest
import torch
from omegaconf import OmegaConf

from lightning_moe_ckpt.callbacks import SparseCheckpointing
from lightning_moe_ckpt.replication.replicator import Replicator
from lightning_moe_ckpt.training.engine import TrainingEngine
from moe_recipes.settings import settings_from_config

COPY_DELAY_S = 0.3


def test_step_hooks_report_their_cpu_time_without_the_wait_for_the_copies() -> None:
    settings = settings_from_config(OmegaConf.create({
        "model": {"max_seq_len": 16}, "data": {"seq_len": 16},
        "trainer": {"global_batch": 4, "max_steps": 2}}))
    engine = TrainingEngine.local(settings)
    checkpointing = SparseCheckpointing("moevement", replicas=0, window=1)
    coordinator = checkpointing.attach(engine)
    generator = torch.Generator().manual_seed(0)
    for step in range(2):
        if step == 1:  # the copy of this step's snapshot sleeps first
            coordinator.capture.copy_delay_s = COPY_DELAY_S
        tokens = torch.randint(0, 256, (1, 4, 17), generator=generator)
        engine.train_iteration(tokens[..., :-1], tokens[..., 1:])
    # The next optimizer step's hook, at once: it waits for that copy.
    before = coordinator.measured.hooks_cpu_s
    coordinator.before_optimizer_step(2)
    waited_s = coordinator.measured.stall_per_step[-1]
    checkpointing.close()
    assert waited_s >= 0.5 * COPY_DELAY_S
    # The wait is the stall, not CPU time: the hook's CPU is far below it.
    assert coordinator.measured.hooks_cpu_s - before < 0.2 * waited_s
    # Planning and issuing the snapshots of two steps did take CPU, and it is reported.
    metrics = coordinator.metrics(1.0)
    hooks_ms = metrics["checkpoint_thread_cpu_ms_per_iter"]["training_hooks"]
    steps = len(coordinator.measured.bytes_per_step)  # the iterations trained: 2
    hooks_cpu_s = coordinator.measured.hooks_cpu_s
    assert hooks_ms > 0 and hooks_ms == pytest.approx(1e3 * hooks_cpu_s / steps)


def test_filing_between_snapshots_counts_as_replication_cpu() -> None:
    """The replication thread files its sources' snapshots between its own (polling for a
    confirmation): that CPU time is the snapshots' cost too, so it is in the thread's
    figure. (A bare replicator: no group is needed to file nothing but a busy loop.)"""
    replicator = Replicator.__new__(Replicator)
    replicator.thread_cpu_s = 0.0

    def busy_filing() -> None:
        started = time.thread_time()
        while time.thread_time() - started < 0.05:
            pass

    replicator._file_sources = busy_filing  # type: ignore[method-assign]
    replicator._file_idle()
    assert replicator.thread_cpu_s >= 0.05
