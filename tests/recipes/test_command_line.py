"""A bad command line of the training recipe: one line naming key and value, exit 2."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from lightning_moe_ckpt.callbacks import SparseCheckpointing
from lightning_moe_ckpt.errors import ConfigError
from moe_recipes.command_line import EXIT_USAGE, command_line_problem, out_dir_problem
from tests.bounded import run_bounded
from tests.conftest import CONF_DIR, REPO

BAD = [  # (override, what the one line must say)
    ("nosuch.key=1", "nosuch.key=1: no such setting"),
    ("checkpoint.bogus=1", "checkpoint.bogus=1: no such setting"),
    ("model=nosuch", "model=nosuch: no such option; choose one of deepseek_moe, gpt_moe"),
    ("checkpoint.window=0", "checkpoint.window=0 must be an integer >= 1"),
    ("parallel.pp=0", "parallel.pp=0 must be an integer >= 1"),
    ("trainer.precision=bogus", "trainer.precision='bogus' is not supported"),
    ("trainer.max_steps=abc", "trainer.max_steps='abc' must be an integer >= 1"),
    ("recovery.timeout_s=-1", "recovery.timeout_s=-1 must be > 0 seconds"),
    ("checkpoint.durable_every=0", "checkpoint.durable_every=0 must be an integer >= 1"),
    ("checkpoint.durable_keep=0", "checkpoint.durable_keep=0 must be an integer >= 1"),
    ("api=x", "api='x' must be 'trainer' or 'fabric'"),
    ("trainer.max_steps=[1", "cannot read the command line: no viable alternative"),
]


@pytest.mark.parametrize(("override", "expected"), BAD, ids=[bad for bad, _ in BAD])
def test_each_bad_override_is_one_line_naming_key_and_value(override: str, expected: str,
                                                            tmp_path: Path) -> None:
    problem = command_line_problem([f"out_dir={tmp_path}", override], CONF_DIR)
    assert problem is not None and problem.startswith(expected), problem
    assert "\n" not in problem


def test_a_good_command_line_has_no_problem(tmp_path: Path) -> None:
    assert command_line_problem([f"out_dir={tmp_path}", "trainer.max_steps=3"], CONF_DIR) is None


def test_an_out_dir_that_cannot_be_written_names_out_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    problem = out_dir_problem(str(blocker / "run"))
    assert problem is not None and problem.startswith(f"out_dir='{blocker / 'run'}' cannot be "
                                                      "written: Not a directory"), problem
    assert out_dir_problem(str(tmp_path / "new" / "run")) is None
    assert (tmp_path / "new" / "run").is_dir() and not any((tmp_path / "new" / "run").iterdir())


def test_the_full_error_setting_gives_the_traceback(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ConfigError, match=r"checkpoint\.window=0"):
        command_line_problem([f"out_dir={tmp_path}", "checkpoint.window=0"], CONF_DIR)


def test_the_callback_checks_its_own_arguments_when_built() -> None:
    """Refused in the constructor, before any process starts, not at ``fit``."""
    with pytest.raises(ConfigError, match=r"checkpoint\.window=0 must be an integer >= 1"):
        SparseCheckpointing(window=0)
    with pytest.raises(ConfigError, match=r"checkpoint=gemini needs checkpoint\.interval"):
        SparseCheckpointing(policy="gemini", replicas=0)
    with pytest.raises(ConfigError, match=r"checkpoint\.durable_every=0"):
        SparseCheckpointing(durable_every=0, durable_dir="d")
    SparseCheckpointing(window=3)  # a good one is taken


@pytest.mark.slow
def test_the_recipe_prints_one_line_and_exits_2_within_seconds(tmp_path: Path) -> None:
    """As a user runs it: the unknown key and an unwritable out_dir, each one line on
    stderr, exit 2, before anything trains (no traceback, no output directory)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {key: value for key, value in os.environ.items() if key != "HYDRA_FULL_ERROR"}
    for override, expected in (("nosuch.key=1", "error: nosuch.key=1: no such setting"),
                               (f"out_dir={blocker / 'run'}", f"error: out_dir='{blocker}")):
        done = run_bounded([sys.executable, str(REPO / "recipes" / "train.py"),
                            f"out_dir={tmp_path / 'out'}", override], env=env, timeout_s=60)
        assert done.returncode == EXIT_USAGE, done.stderr[-2000:]
        assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
        assert done.stderr.startswith(expected), done.stderr
    assert not (tmp_path / "out" / "final_state.pt").exists()
