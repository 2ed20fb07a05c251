"""The same core under other loops: a Fabric loop, and DDP with two CPU processes."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch

from lightning_moe_ckpt.callbacks import SparseCheckpointing
from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.testing import AtSchedule, FailureInjector
from tests.anymodel.harness import FAIL_AT, STEPS, WINDOW, optimizer_state
from tests.anymodel.models import lm_loss, qwen3_moe, random_token_loader, train_step
from tests.forked import run_python

REPO = Path(__file__).resolve().parents[2]


def _fabric_run(fail_at: int | None, max_norm: float | None = None,
                randomness: bool = False) -> dict[str, Any]:
    """``randomness``: a LambdaLR stepped inside the step function (handed over), and a
    random crop of every batch drawn from Python's ``random`` and NumPy."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = qwen3_moe(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    checkpointing = SparseCheckpointing("moevement", replicas=0, window=WINDOW)
    norms: list[torch.Tensor] = []
    schedulers = [torch.optim.lr_scheduler.LambdaLR(
        optimizer.optimizer, lambda t: 1.0 / (1 + t))] if randomness else []
    random.seed(0)
    np.random.seed(0)

    def backward(loss: torch.Tensor) -> None:
        fabric.backward(loss)
        if max_norm is not None:  # Fabric's own call, between backward and step
            norms.append(fabric.clip_gradients(model, optimizer, max_norm=max_norm))

    def step_fn(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if randomness:  # a user's augmentation: a random window of the sequence
            start = random.randint(0, 4) + int(np.random.randint(0, 4))
            batch = {"input_ids": batch["input_ids"][:, start:]}
        loss = train_step(model, optimizer, batch, backward=backward)
        for scheduler in schedulers:
            scheduler.step()
        return loss

    step = checkpointing.protect(fabric, model, optimizer, step_fn, schedulers)
    injector = None
    if fail_at is not None:
        injector = FailureInjector(AtSchedule([{"step": fail_at, "rank": 0}]), checkpointing)
        assert checkpointing.target is not None
        injector.attach(checkpointing.target)
    losses = {}
    for index, batch in enumerate(random_token_loader(n_batches=STEPS)):
        losses[index] = step(fabric.to_device(batch))
    checkpointing.close()
    module = model.module
    return {"params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "lr": [group["lr"] for group in optimizer.param_groups],
            "optimizer": optimizer_state(module, optimizer.optimizer), "losses": losses,
            "fired": 0 if injector is None else injector.counter.total,
            "recoveries": [] if injector is None else injector.recoveries,
            "metrics": checkpointing.metrics(1.0), "norms": norms}


def _assert_same(reference: dict[str, Any], failed: dict[str, Any]) -> None:
    for name, value in reference["params"].items():
        assert torch.equal(value, failed["params"][name]), name
    assert reference["optimizer"].keys() == failed["optimizer"].keys()
    for name, state in reference["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(value, failed["optimizer"][name][key]), (name, key)
    for step in range(FAIL_AT, STEPS):
        assert torch.equal(reference["losses"][step], failed["losses"][step]), step


def test_fabric_loop_recovers_bitwise() -> None:
    reference, failed = _fabric_run(None), _fabric_run(FAIL_AT)
    assert failed["fired"] == 1 and failed["recoveries"][0]["iterations_replayed"] == WINDOW
    _assert_same(reference, failed)
    assert failed["metrics"]["snapshot_bytes_per_iter"] < failed["metrics"]["dense_state_bytes"]


def test_fabric_step_with_a_scheduler_and_python_and_numpy_randomness_recovers_bitwise(
        ) -> None:
    reference, failed = _fabric_run(None, randomness=True), _fabric_run(FAIL_AT,
                                                                        randomness=True)
    assert failed["fired"] == 1 and failed["recoveries"][0]["iterations_replayed"] == WINDOW
    _assert_same(reference, failed)
    assert reference["lr"] == failed["lr"] != [1e-2]  # the schedule moved, and alike


def test_fabric_step_function_misuse_is_named() -> None:
    """A scheduler driving the optimizer but not handed over warns; a step function that
    runs no optimizer step (gradient accumulation across calls) is an error."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model, optimizer = fabric.setup(*(lambda m: (m, torch.optim.AdamW(m.parameters())))(
        qwen3_moe(seed=0)))
    torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda t: 1.0)
    checkpointing = SparseCheckpointing("moevement", replicas=0, window=WINDOW)

    def accumulate(batch: dict[str, torch.Tensor]) -> None:
        fabric.backward(lm_loss(model, batch["input_ids"]))  # no optimizer.step()

    with pytest.warns(UserWarning, match=r"protect\(\) got no schedulers=\[\.\.\.\]"):
        step = checkpointing.protect(fabric, model, optimizer, accumulate)
    with pytest.raises(ConfigError, match="ran 0 optimizer steps on one batch"):
        step(next(iter(random_token_loader(n_batches=1))))
    checkpointing.close()


def test_fabric_clip_gradients_replays_the_logged_coefficient() -> None:
    """``fabric.clip_gradients(max_norm=...)`` in the user's step: recomputed from the
    replay's partly frozen gradients the coefficient would differ; it is logged instead."""
    reference, failed = _fabric_run(None, 0.05), _fabric_run(FAIL_AT, 0.05)
    assert failed["fired"] == 1
    assert all(float(norm) > 0.05 for norm in reference["norms"])  # every step clipped
    _assert_same(reference, failed)


def _ddp(out: Path, fail_at: int | None) -> list[dict[str, Any]]:
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [str(REPO / "tests" / "anymodel" / "ddp_workload.py"), str(out)]
    done = run_python(command + ([] if fail_at is None else [str(fail_at)]), env=env,
                      cwd=REPO, ranks=2, timeout_s=300)  # both ranks, as torchrun starts them
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.distributed
def test_ddp_two_processes_recover_by_global_rollback(tmp_path: Path) -> None:
    reference = _ddp(tmp_path / "reference", None)
    failed = _ddp(tmp_path / "failed", FAIL_AT)
    for rank in range(2):
        assert failed[rank]["fired"] == 1
        (recovery,) = failed[rank]["recoveries"]
        assert recovery["ranks_rolled_back"] == [0, 1]  # global rollback
        assert failed[rank]["frozen_during_replay"][0] > 0  # sparse conversion on both
        _assert_same(reference[rank], failed[rank])
