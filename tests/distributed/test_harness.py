"""The multi-process harness ends a hung run in bounded time and kills its ranks by pid."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.conftest import alive
from tests.distributed import harness


def _hang(pid_dir: str) -> None:
    (Path(pid_dir) / str(os.getpid())).touch()
    time.sleep(3600)


def test_a_hung_run_fails_and_its_ranks_are_killed(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Long enough for a cold fork server to import what the ranks need and fork them.
    monkeypatch.setattr(harness, "RUN_TIMEOUT_S", 15.0)
    with pytest.raises(pytest.fail.Exception, match="overran"):
        harness.run_distributed(2, _hang, str(tmp_path))
    pids = [int(path.name) for path in tmp_path.iterdir()]
    assert len(pids) == 2  # both ranks were really running
    assert not any(alive(pid) for pid in pids)
