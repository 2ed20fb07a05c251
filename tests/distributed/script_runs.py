"""Run a multi-process test script in bounded time (:func:`tests.forked.run_python`: its
ranks, or the supervisor that starts its workers, forked with their imports done; on
overrun they and what they started are killed by their groups' ids). It saves a list of
per-rank reports (``state``, ``losses``, ...) to the path it is given.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tests.conftest import REPO
from tests.forked import run_python

RUN_TIMEOUT_S = 300


def run_script(module: str, out: Path, *args: str, ranks: int) -> list[Any]:
    """The per-rank reports ``python -m module out *args`` on ``ranks`` processes (started
    as ``torchrun`` starts them) saves to ``out``."""
    return _run(["-m", module, str(out), *args], out, ranks)


def run_supervised(module: str, out: Path, workers: int, timeout_s: float, status: Path,
                   *args: str) -> list[Any]:
    """The per-rank reports of ``module`` run under ``python -m lightning_moe_ckpt.supervise
    --fork-workers --preload module`` (its workers' pids in ``status``)."""
    return _run(["-m", "lightning_moe_ckpt.supervise", "--fork-workers", "--preload", module,
                 "--workers", str(workers), "--timeout-s", str(timeout_s), "--status",
                 str(status), "-m", module, str(out), *args], out, ranks=1)


def _run(command: list[str], out: Path, ranks: int) -> list[Any]:
    done = run_python(command, env=os.environ, cwd=REPO, ranks=ranks, timeout_s=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    reports: list[Any] = torch.load(out, weights_only=False)
    return reports


def assert_equal_runs(expected: list[Any], got: list[Any]) -> None:
    """Every rank's state (parameters, moments) and every loss, bitwise."""
    for a, b in zip(expected, got, strict=True):
        assert a["state"].keys() == b["state"].keys(), a["rank"]
        for name, tensors in a["state"].items():
            for key, tensor in tensors.items():
                assert torch.equal(tensor, b["state"][name][key]), (a["rank"], name, key)
        assert a["losses"].keys() == b["losses"].keys()
        for step, loss in a["losses"].items():
            assert torch.equal(loss, b["losses"][step]), (a["rank"], step)


def merged_state(parts: list[Any]) -> dict[str, dict[str, torch.Tensor]]:
    """The whole model's state from every rank's share of it."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    for part in parts:
        state.update(part["state"])
    return state


def assert_same_model(reference: list[Any], got: list[Any]) -> None:
    """Two layouts of one training run end in the same model bitwise (every parameter and
    moment under the model's own names) with the same losses."""
    expected, actual = merged_state(reference), merged_state(got)
    assert expected.keys() == actual.keys()
    for name, tensors in expected.items():
        for key, tensor in tensors.items():
            assert torch.equal(tensor, actual[name][key]), (name, key)
    assert reference[0]["losses"].keys() == got[0]["losses"].keys()
    for step, loss in reference[0]["losses"].items():
        assert torch.equal(loss, got[0]["losses"][step]), step


def assert_recovered(parts: list[Any], failed: int, scope: list[int]) -> None:
    """The fault fired once, only ``scope`` rolled back, paused ranks ran no pass."""
    for part in parts:
        faults = part["faults"]
        assert faults["failures_injected"] == 1  # the fault fired
        (recovery,) = faults["recoveries"]
        assert recovery["failed_ranks"] == [failed]
        assert recovery["ranks_rolled_back"] == scope
        assert recovery["iterations_replayed"] >= 1
        if part["rank"] not in scope:  # paused: kept its state, ran nothing
            assert part["paused_forward_backward"] == 0
