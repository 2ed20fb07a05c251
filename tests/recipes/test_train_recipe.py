"""End-to-end runs of ``recipes/train.py``: artifacts, learning, Trainer/Fabric identity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from lightning_moe_ckpt.errors import ConfigError
from moe_recipes.settings import settings_from_config
from moe_recipes.supervised import needs_supervisor
from tests.bounded import run_bounded
from tests.conftest import CONF_DIR, REPO
from tests.forked import run_python

pytestmark = pytest.mark.slow

TRAIN = REPO / "recipes" / "train.py"


def run_recipe(out_dir: Path, *overrides: str, launch: str = "forked",
               full_error: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the training recipe as a user would. ``launch="python"``: ``python
    recipes/train.py`` in a fresh interpreter, whose Lightning launcher starts the other
    ranks. ``"forked"``: every rank started at once as ``torchrun`` starts them, each forked
    with its imports done (:mod:`tests.forked`); a supervised job's one process starts its
    workers itself. ``full_error``: a bad setting's traceback (``HYDRA_FULL_ERROR=1``)
    instead of the one line a user sees."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "1" if full_error else "0"}
    args = [f"out_dir={out_dir}", "trainer.progress_bar=false", *overrides]
    if launch == "python":
        return run_bounded([sys.executable, str(TRAIN), *args], env=env)
    assert launch == "forked", launch
    return run_python([str(TRAIN), *args], env=env, cwd=REPO, ranks=_ranks_to_start(args))


def _ranks_to_start(args: list[str]) -> int:
    """The processes ``torchrun`` would start for the recipe with ``args``: one per rank, or
    one when the job runs under the supervisor (or its config is refused, which that one
    process then reports, as the test expects)."""
    try:
        with initialize_config_dir(str(CONF_DIR), version_base=None):
            settings = settings_from_config(compose("train", overrides=args))
        return 1 if needs_supervisor(settings) else settings.layout.world_size
    except (ConfigError, HydraException, OmegaConfBaseException):
        return 1


def assert_states_equal(path_a: Path, path_b: Path) -> None:
    """Bitwise equality of two ``final_state.pt`` files."""
    a, b = torch.load(path_a), torch.load(path_b)
    assert a["step"] == b["step"]
    for section in ("model", "compute"):
        assert a[section].keys() == b[section].keys()
        for name, tensor in a[section].items():
            assert torch.equal(tensor, b[section][name]), (section, name)
    assert a["optimizer"].keys() == b["optimizer"].keys()
    for name, entries in a["optimizer"].items():
        assert entries.keys() == b["optimizer"][name].keys()
        for key, tensor in entries.items():
            assert torch.equal(tensor, b["optimizer"][name][key]), (name, key)


def test_default_run_learns_and_writes_artifacts(tmp_path: Path) -> None:
    result = run_recipe(tmp_path, "trainer.max_steps=60", "trainer.val_every=30",
                        launch="python")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["steps"] == 60 and len(metrics["loss"]) == 60
    first, last = sum(metrics["loss"][:5]) / 5, sum(metrics["loss"][-5:]) / 5
    assert last < first - 1.0, (first, last)  # bytes: ln(256)=5.55 falls well below 4.5
    assert [v["step"] for v in metrics["validation"]] == [30, 60]
    assert metrics["failures_injected"] == 0 and metrics["recoveries"] == []
    assert len(metrics["expert_load"]) == 4 and len(metrics["expert_load"][0]) == 8
    state = torch.load(tmp_path / "final_state.pt")
    assert state["step"] == 60
    assert set(state) == {"step", "model", "compute", "optimizer"}
    assert state["model"]["layers.3.moe.experts.7.w1.weight"].dtype == torch.float32
    assert set(state["optimizer"]["embed.tok.weight"]) == {"exp_avg", "exp_avg_sq", "step"}
    png = (tmp_path / "training.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    csv = next((tmp_path / "csv").rglob("metrics.csv")).read_text()
    assert "train/loss" in csv.splitlines()[0] and "load/layer0_cv" in csv.splitlines()[0]


@pytest.mark.parametrize("precision", ["32", "bf16-master"])
def test_trainer_and_fabric_are_bitwise_identical(tmp_path: Path, precision: str) -> None:
    runs = {}
    for api in ("trainer", "fabric"):
        out = tmp_path / api
        result = run_recipe(out, f"api={api}", "trainer.max_steps=12", "trainer.val_every=6",
                            f"trainer.precision={precision}", "trainer.seed=99")
        assert result.returncode == 0, result.stderr[-3000:]
        runs[api] = out
    assert_states_equal(runs["trainer"] / "final_state.pt", runs["fabric"] / "final_state.pt")
    losses = [json.loads((runs[api] / "metrics.json").read_text())["loss"] for api in runs]
    assert losses[0] == losses[1]


def test_different_seed_changes_the_result(tmp_path: Path) -> None:
    for seed in (1, 2):
        result = run_recipe(tmp_path / str(seed), "api=fabric", "trainer.max_steps=2",
                            f"trainer.seed={seed}")
        assert result.returncode == 0, result.stderr[-3000:]
    with pytest.raises(AssertionError):
        assert_states_equal(tmp_path / "1" / "final_state.pt", tmp_path / "2" / "final_state.pt")


def test_bad_input_fails_before_training(tmp_path: Path) -> None:
    result = run_recipe(tmp_path, "model.top_k=9")
    assert result.returncode != 0
    assert "model.top_k=9 must be <= model.n_experts=8" in result.stderr
    assert not (tmp_path / "final_state.pt").exists()
    result = run_recipe(tmp_path, "model=no_such_model")
    assert result.returncode != 0 and "model/no_such_model" in result.stderr
