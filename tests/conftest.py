"""Shared fixtures: small model configs, a reference batch, the repository paths, and
whether a process is alive."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_moe_ckpt.failures.protocol import ControlChannel
from lightning_moe_ckpt.models import MoEModelConfig

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
# The job secret of the tests' supervised jobs (a batch script would export its own): the
# processes the tests start inherit it, as a job's tasks do.
os.environ.setdefault("MOE_JOB_SECRET", "9" * 64)


def job_channel(store: object) -> ControlChannel:
    """Sealed messages on ``store`` with the tests' job secret."""
    return ControlChannel(store, os.environ["MOE_JOB_SECRET"])  # type: ignore[arg-type]


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (real-failure tests: a killed worker is gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def tiny_cfg() -> MoEModelConfig:
    """The tiny preset's shape with a short sequence for fast unit tests."""
    return MoEModelConfig(max_seq_len=16)


@pytest.fixture
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two micro-batches of 4 random byte sequences of length 16: ``[M, b, S]``."""
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (2, 4, 17), generator=generator)
    return tokens[..., :-1], tokens[..., 1:]
