"""A user's own HF MoE LightningModule under ``TrainerMoEParallelStrategy``, with failures.

Each run is ``tests/distributed/trainer_user_parallel.py`` in fresh processes (the Trainer
launches its ranks), ended by its process group's id when it overruns. A pure pipeline
layout equals the one-process run bitwise; expert-parallel layouts match it to rounding
(the tolerances of ``test_user_model_parallel.py``). In every layout a simulated failure
in the middle of a window is recovered bitwise against the fault-free run of the same
layout; with pp=2 only the failed stage's ranks roll back and the paused ones run no
forward/backward pass during the recovery. A torchtitan-style grouped-experts model takes
the same path through its own ``parallelize_fn``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import REPO

pytestmark = pytest.mark.distributed
pytest.importorskip("transformers")

RUN_TIMEOUT_S = 300


def _run(tmp: Path, model: str, pp: int, ep: int, shards: int, fail: str | None = None
         ) -> list[Any]:
    out = tmp / f"{model}-pp{pp}ep{ep}s{shards}{'-' + fail.replace(':', '_') if fail else ''}.pt"
    command = [sys.executable, "-m", "tests.distributed.trainer_user_parallel", model, str(pp),
               str(ep), str(shards), str(out), *([fail] if fail else [])]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the run's own group: it and its ranks
        output, _ = process.communicate()
        pytest.fail(f"{command} overran {RUN_TIMEOUT_S} s:\n{output[-4000:]}")
    assert process.returncode == 0, output[-4000:]
    parts: list[Any] = torch.load(out, weights_only=False)
    return parts


Runs = Callable[..., list[Any]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """``runs(pp, ep, shards, fail=None, model="qwen3_moe")``: each distinct run once."""
    tmp = tmp_path_factory.mktemp("user-trainer")
    done: dict[tuple[Any, ...], list[Any]] = {}

    def run(pp: int, ep: int, shards: int, fail: str | None = None,
            model: str = "qwen3_moe") -> list[Any]:
        key = (model, pp, ep, shards, fail)
        if key not in done:
            done[key] = _run(tmp, *key)
        return done[key]
    return run


def _merged(parts: list[Any]) -> dict[str, dict[str, torch.Tensor]]:
    state: dict[str, dict[str, torch.Tensor]] = {}
    for part in parts:
        state.update(part["state"])
    return state


def _assert_equal_runs(expected: list[Any], got: list[Any]) -> None:
    for a, b in zip(expected, got, strict=True):
        assert a["state"].keys() == b["state"].keys(), a["rank"]
        for name, tensors in a["state"].items():
            for key, tensor in tensors.items():
                assert torch.equal(tensor, b["state"][name][key]), (a["rank"], name, key)
        assert a["losses"].keys() == b["losses"].keys()
        for step, loss in a["losses"].items():
            assert torch.equal(loss, b["losses"][step]), (a["rank"], step)


def test_pipeline_of_a_users_module_equals_one_process_bitwise(runs: Runs) -> None:
    reference, pipelined = runs(1, 1, 1), runs(2, 1, 1)
    expected, got = _merged(reference), _merged(pipelined)
    assert expected.keys() == got.keys()
    for name, tensors in expected.items():
        for key, tensor in tensors.items():
            assert torch.equal(tensor, got[name][key]), (name, key)
    assert all(torch.equal(reference[0]["losses"][s], pipelined[0]["losses"][s])
               for s in reference[0]["losses"])


@pytest.mark.parametrize(("pp", "ep"), [(1, 2), (2, 2)], ids=["ep2", "pp2xep2"])
def test_expert_parallel_users_module_matches_one_process_to_rounding(runs: Runs, pp: int,
                                                                      ep: int) -> None:
    expected, got = _merged(runs(1, 1, ep)), _merged(runs(pp, ep, 1))
    assert expected.keys() == got.keys()
    for name, tensors in expected.items():
        for key, tensor in tensors.items():
            torch.testing.assert_close(got[name][key], tensor, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("model", "pp", "ep", "failed", "scope"),
                         [("qwen3_moe", 2, 1, 1, [1]), ("qwen3_moe", 1, 2, 0, [0, 1]),
                          ("qwen3_moe", 2, 2, 2, [2, 3]), ("grouped_experts", 2, 2, 0, [0, 1])],
                         ids=["pp2-last-stage", "ep2", "pp2xep2-last-stage",
                              "grouped-experts-pp2xep2-first-stage"])
def test_a_failure_mid_window_recovers_bitwise(runs: Runs, model: str, pp: int, ep: int,
                                               failed: int, scope: list[int]) -> None:
    golden = runs(pp, ep, 1, model=model)
    recovered = runs(pp, ep, 1, f"5:{failed}", model=model)
    _assert_equal_runs(golden, recovered)
    for part in recovered:
        faults = part["faults"]
        assert faults["failures_injected"] == 1  # the fault fired
        (recovery,) = faults["recoveries"]
        assert recovery["failed_ranks"] == [failed]
        assert recovery["ranks_rolled_back"] == scope
        assert recovery["iterations_replayed"] >= 1
        if part["rank"] not in scope:  # paused: kept its state, ran nothing
            assert part["paused_forward_backward"] == 0
