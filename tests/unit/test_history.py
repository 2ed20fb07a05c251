"""The run history keeps per-step scalars in order without a tensor object per step, and
tells the training thread's CPU per iteration from the process's."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import torch

from lightning_moe_ckpt.training.history import STEPS_PER_CHUNK, ScalarSeries, TrainingHistory
from lightning_moe_ckpt.training.iteration import IterationResult


def test_series_keeps_every_value_in_order_across_chunks() -> None:
    values = [torch.tensor(float(i) / 7, dtype=torch.float32)
              for i in range(3 * STEPS_PER_CHUNK + 5)]
    series = ScalarSeries()
    for value in values:
        series.append(value)
    assert len(series) == len(values)
    stored = series.tensor()
    assert stored is not None and stored.dtype == torch.float32
    assert torch.equal(stored, torch.stack(values))
    assert series.tolist() == torch.stack(values).tolist()


def test_empty_series() -> None:
    series = ScalarSeries()
    assert len(series) == 0 and series.tensor() is None and series.tolist() == []


def test_series_releases_the_step_tensors_once_a_chunk_is_full() -> None:
    """A long run must not hold one tensor object per step (about 800 host bytes each)."""
    series = ScalarSeries()
    recorded = []
    for i in range(STEPS_PER_CHUNK):
        value = torch.tensor(float(i))
        recorded.append(weakref.ref(value))
        series.append(value)
        del value
    gc.collect()
    assert all(ref() is None for ref in recorded)
    assert series.tolist() == [float(i) for i in range(STEPS_PER_CHUNK)]


def _result(step: int, dropped: float) -> IterationResult:
    scalar = torch.tensor(float(step))
    return IterationResult(loss=scalar, aux_loss=scalar / 2, grad_norm=scalar,
                           clip_coef=torch.tensor(1.0), lr=1e-3,
                           expert_load=torch.ones(2, 4), dropped=torch.tensor(dropped),
                           soft_load=torch.ones(2, 4))


def test_history_records_every_step_and_sums_dropped_exactly_past_float32() -> None:
    history = TrainingHistory()
    steps = STEPS_PER_CHUNK + 3
    for step in range(steps):
        history.start_iteration()
        history.record(_result(step, 2.0**24 if step < 3 else 1.0))
    assert history.loss_values() == [float(step) for step in range(steps)]
    assert history.aux_losses.tolist() == [step / 2 for step in range(steps)]
    assert len(history.clip_coefs) == len(history.iteration_seconds) == steps
    assert history.dropped_total is not None
    assert int(history.dropped_total) == 3 * 2**24 + steps - 3  # float32 would round
    assert history.expert_load_total is not None
    assert torch.equal(history.expert_load_total, torch.full((2, 4), float(steps)))
    # CPU per iteration, between iteration starts: the process's and its training thread's.
    assert len(history.iteration_cpu_seconds) == len(history.iteration_thread_cpu_seconds)
    assert len(history.iteration_cpu_seconds) == steps - 1
    assert history.median_cpu_ms() is not None


def test_cpu_per_iteration_tells_the_training_thread_from_the_process() -> None:
    """Work on another thread (a checkpoint thread's, here a busy loop) counts in the
    process's CPU per iteration and not in the training thread's, which only sleeps."""
    history = TrainingHistory()
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(range(10_000))

    worker = threading.Thread(target=busy, daemon=True)
    worker.start()
    try:
        for _ in range(4):
            history.start_iteration()
            time.sleep(0.05)
    finally:
        stop.set()
        worker.join(timeout=10)
    measured = history.median_cpu_ms()
    assert measured is not None
    process_ms, thread_ms = measured
    assert process_ms > 10.0, measured  # the busy thread ran for much of the 50 ms
    assert thread_ms < 5.0, measured
