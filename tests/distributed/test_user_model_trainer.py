"""A user's own HF MoE LightningModule under ``TrainerMoEParallelStrategy``, with failures.

Each run is ``tests/distributed/trainer_user_parallel.py`` in fresh processes (the Trainer
launches its ranks, or the supervisor does) in bounded time (``script_runs``). A pure
pipeline layout equals the one-process run bitwise; expert-parallel layouts match it to
rounding (the tolerances of ``test_user_model_parallel.py``). In every layout a simulated
failure in the middle of a window, and a real SIGKILL of a worker under the supervisor,
are recovered bitwise against the fault-free run of the same layout; with pp=2 only the
failed stage's ranks roll back and the paused ones run no forward/backward pass during the
recovery. A torchtitan-style grouped-experts model takes the same path through its own
``parallelize_fn``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import alive
from tests.distributed.script_runs import (
    assert_equal_runs,
    assert_recovered,
    assert_same_model,
    merged_state,
    run_script,
    run_supervised,
)

pytestmark = pytest.mark.distributed
pytest.importorskip("transformers")


def _run(tmp: Path, model: str, pp: int, ep: int, shards: int, fail: str | None = None
         ) -> list[Any]:
    out = tmp / f"{model}-pp{pp}ep{ep}s{shards}{'-' + fail.replace(':', '_') if fail else ''}.pt"
    return run_script("tests.distributed.trainer_user_parallel", out, model, str(pp), str(ep),
                      str(shards), *([fail] if fail else []), ranks=pp * ep)


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


def test_pipeline_of_a_users_module_equals_one_process_bitwise(runs: Runs) -> None:
    assert_same_model(runs(1, 1, 1), runs(2, 1, 1))


@pytest.mark.parametrize(("pp", "ep"), [(1, 2), (2, 2)], ids=["ep2", "pp2xep2"])
def test_expert_parallel_users_module_matches_one_process_to_rounding(runs: Runs, pp: int,
                                                                      ep: int) -> None:
    expected, got = merged_state(runs(1, 1, ep)), merged_state(runs(pp, ep, 1))
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
    assert_equal_runs(golden, recovered)
    assert_recovered(recovered, failed, scope)


@pytest.mark.parametrize(("pp", "ep", "failed", "scope"),
                         [(2, 1, 1, [1]), (1, 2, 0, [0, 1]), (2, 2, 2, [2, 3])],
                         ids=["pp2-last-stage", "ep2", "pp2xep2-last-stage"])
def test_a_worker_killed_mid_window_is_replaced_and_recovers_bitwise(
        runs: Runs, tmp_path: Path, pp: int, ep: int, failed: int, scope: list[int]) -> None:
    """The failing worker SIGKILLs itself at step 5 (mid-window); the supervisor starts a
    replacement, which recovers the rank from its peers and joins the survivors, who kept
    their processes. Final state bitwise; every survivor's loss, and the replacement's
    from the step it joined at."""
    from tests.distributed.trainer_user_parallel import SUPERVISED_TIMEOUT_S

    golden = runs(pp, ep, 1)
    status = tmp_path / "workers.json"
    recovered = run_supervised("tests.distributed.trainer_user_parallel",
                               tmp_path / "killed.pt", pp * ep, SUPERVISED_TIMEOUT_S, status,
                               "qwen3_moe", str(pp), str(ep), "1", f"5:{failed}:kill")
    view = json.loads(status.read_text())
    (replacement,) = view["replacements"]
    assert replacement["rank"] == failed and replacement["cause"] == "exit -9"
    assert not alive(replacement["dead_pid"])  # the fault fired: that process is gone
    for part, expected in zip(recovered, golden, strict=True):
        rank = part["rank"]
        if rank == failed:
            assert part["pid"] == replacement["new_pid"]
            assert sorted(part["losses"]) == list(range(5, 8))  # from the step it joined
        else:  # survivors kept their processes
            assert view["worker_pids"][str(rank)] == [part["pid"]]
            assert part["losses"].keys() == expected["losses"].keys()
        for step, loss in part["losses"].items():
            assert torch.equal(loss, expected["losses"][step]), (rank, step)
        for name, tensors in expected["state"].items():
            for key, tensor in tensors.items():
                assert torch.equal(tensor, part["state"][name][key]), (rank, name, key)
        (recovery,) = part["real_recoveries"]
        assert recovery["failed_step"] == 5 and recovery["failed_ranks"] == [failed]
        if rank != failed:  # no survivor, even one blocked on another, waited out its
            # collective timeout (SUPERVISED_TIMEOUT_S / 3) to learn of the failure
            assert recovery["timings_s"]["detect"] < SUPERVISED_TIMEOUT_S / 6, recovery
        assert recovery["ranks_rolled_back"] == scope
        assert recovery["replacement"] == (rank == failed)
        if rank in scope:
            assert recovery["iterations_replayed"] >= 1
        paused = recovery["paused_forward_backward"]
        assert set(map(int, paused)) == set(range(pp * ep)) - set(scope)
        assert all(calls == 0 for calls in paused.values()), paused
