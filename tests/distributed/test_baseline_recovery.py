"""The baselines' recovery, contrasted on one layout and one failure (gloo, 2 processes):
MoEvement, Gemini and CheckFreq end bitwise equal to the fault-free run, Gemini after
replaying more iterations than MoEvement; MoC and MoEtion restore stale experts and go on,
diverging from the fault-free run and reporting the tokens they lost; MoEtion boosts the
capacity of its stale experts in the model."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.baseline_workloads import baseline_runs, capacity_settings
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed

LAYOUT, STEPS, FAIL_STEP, FAILED = (1, 1, 2), 14, 11, [1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    settings = capacity_settings(*LAYOUT, steps=STEPS)
    disk = str(tmp_path_factory.mktemp("checkfreq"))
    scenarios = [
        ("moevement", "moevement", {"window": 2}),
        ("gemini", "gemini", {"interval": 6}),
        ("checkfreq", "checkfreq", {"durable_dir": disk}),
        ("moc", "moc", {}),
        ("moetion", "moetion", {}),
    ]
    results: dict[str, dict[str, Any]] = run_distributed(
        settings.layout.world_size, baseline_runs, settings, scenarios, FAIL_STEP, FAILED)
    results["checkfreq"]["disk"] = sorted(p.name for p in Path(disk).rglob("*.snapshot"))
    return results


def _differences(state: dict[str, Any], golden: dict[str, Any]) -> list[str]:
    return [f"{section}:{name}" for section in ("model", "compute")
            for name, tensor in golden[section].items()
            if not torch.equal(state[section][name], tensor)]


def _assert_bitwise(result: dict[str, Any], golden: dict[str, Any]) -> None:
    assert result["losses"] == golden["losses"]
    assert _differences(result["state"], golden["state"]) == []
    for name, entries in golden["state"]["optimizer"].items():
        for key, tensor in entries.items():
            assert torch.equal(result["state"]["optimizer"][name][key], tensor), (name, key)


def _recovery(result: dict[str, Any]) -> dict[str, Any]:
    assert result["failures"] == 1  # the failure fired
    (recovery,) = result["recoveries"]
    assert recovery["failed_step"] == FAIL_STEP and recovery["failed_ranks"] == FAILED
    assert recovery["ranks_rolled_back"] == [0, 1]  # baselines roll back every rank
    return recovery


def test_dense_baselines_are_exact_but_replay_more(runs: dict[str, dict[str, Any]]) -> None:
    golden = runs["golden"]
    moevement, gemini = _recovery(runs["moevement"]), _recovery(runs["gemini"])
    _assert_bitwise(runs["moevement"], golden)
    _assert_bitwise(runs["gemini"], golden)
    # Gemini's checkpoint (every 6 iterations) is at 6: it replays 7..10; MoEvement's
    # newest persisted window (W=2) starts at 8.
    assert gemini["window_start"] == 6 and gemini["window"] == 1
    assert gemini["iterations_replayed"] == FAIL_STEP - 6 - 1
    assert gemini["iterations_replayed"] > moevement["iterations_replayed"]
    assert gemini["lost_tokens"] == moevement["lost_tokens"] == 0
    # CheckFreq: the failed rank read its own file back from its own directory.
    checkfreq = _recovery(runs["checkfreq"])
    _assert_bitwise(runs["checkfreq"], golden)
    assert checkfreq["lost_tokens"] == 0 and checkfreq["window"] == 1
    assert runs["checkfreq"]["disk"] and all(name.startswith("step=")
                                             for name in runs["checkfreq"]["disk"])


def test_moc_restores_stale_experts_and_diverges(runs: dict[str, dict[str, Any]]) -> None:
    golden, moc = runs["golden"], runs["moc"]
    recovery = _recovery(moc)
    assert recovery["window_start"] == FAIL_STEP - 1 and recovery["iterations_replayed"] == 0
    assert recovery["lost_tokens"] > 0 and 0 < recovery["lost_token_portion"] < 1
    assert recovery["stale_experts"]
    assert moc["losses"][:FAIL_STEP] == golden["losses"][:FAIL_STEP]
    assert moc["losses"][FAIL_STEP:] != golden["losses"][FAIL_STEP:]
    assert all(math.isfinite(loss) for loss in moc["losses"])
    different = _differences(moc["state"], golden["state"])
    assert different and any(".experts." in name for name in different)


def test_moetion_restores_and_boosts_stale_experts(runs: dict[str, dict[str, Any]]) -> None:
    moetion = runs["moetion"]
    recovery = _recovery(moetion)
    assert recovery["lost_tokens"] > 0 and recovery["stale_experts"]
    assert all(math.isfinite(loss) for loss in moetion["losses"])
    after = moetion["after"]
    # The boost reached the model: stale experts accept ceil(1.1 x base) per sequence.
    assert after["boosted"] and set(after["boosted"]) == set(after["stale"])
    assert set(after["stale"]) <= set(recovery["stale_experts"])
    assert set(after["boosted"].values()) == {math.ceil(1.1 * after["base_capacity"])}
    assert runs["moc"]["after"]["boosted"] == {}  # MoC has no boost
