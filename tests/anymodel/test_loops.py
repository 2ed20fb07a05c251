"""The same core under other loops: a Fabric loop, and DDP with two CPU processes."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_moe_ckpt.callbacks import FailureInjector, SparseCheckpointing
from lightning_moe_ckpt.recovery import AtSchedule
from tests.anymodel.harness import FAIL_AT, STEPS, WINDOW, optimizer_state
from tests.anymodel.models import qwen3_moe, random_token_loader, train_step
from tests.bounded import run_bounded

REPO = Path(__file__).resolve().parents[2]


def _fabric_run(fail_at: int | None, max_norm: float | None = None) -> dict[str, Any]:
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = qwen3_moe(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    checkpointing = SparseCheckpointing("moevement", replicas=0, window=WINDOW)
    norms: list[torch.Tensor] = []

    def backward(loss: torch.Tensor) -> None:
        fabric.backward(loss)
        if max_norm is not None:  # Fabric's own call, between backward and step
            norms.append(fabric.clip_gradients(model, optimizer, max_norm=max_norm))

    step = checkpointing.protect(
        fabric, model, optimizer, lambda batch: train_step(model, optimizer, batch,
                                                           backward=backward))
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
    command = [sys.executable, str(REPO / "tests" / "anymodel" / "ddp_workload.py"), str(out)]
    done = run_bounded(command + ([] if fail_at is None else [str(fail_at)]), env=env,
                       timeout_s=300, merge_stderr=True)  # the launcher and its rank
    assert done.returncode == 0, done.stdout[-4000:]
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
