"""Run a command that may start processes of its own (Fabric ranks, supervised workers)
in bounded time.

The command runs in a fresh session; when it overruns, its whole process group (it and
every process it started) is killed by the group's id, which is the command's pid, and
the test fails with the end of its output. The limit stays below pytest-timeout's, so a
hung run is ended here, with its children, rather than by pytest with them left running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from tests.conftest import REPO

RUN_TIMEOUT_S = 480.0  # pytest-timeout is 600 s (pyproject.toml)


def run_bounded(command: Sequence[str], *, timeout_s: float = RUN_TIMEOUT_S,
                env: Mapping[str, str] | None = None, cwd: Path = REPO,
                merge_stderr: bool = False, terminate_first: bool = False
                ) -> subprocess.CompletedProcess[str]:
    """``command``'s exit status and output, or a test failure once ``timeout_s`` passed.
    ``terminate_first``: on overrun the command gets a SIGTERM (and 30 s) first, for one
    that ends processes outside its group itself (``recipes/cluster.py``'s nodes)."""
    process = subprocess.Popen(list(command), cwd=cwd, env=None if env is None else dict(env),
                               stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        if terminate_first:
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.communicate(timeout=30)
        os.killpg(process.pid, signal.SIGKILL)  # the run's own group: it and its ranks
        stdout, stderr = process.communicate()
        pytest.fail(f"{list(command)} overran {timeout_s:g} s:\n{stdout[-3000:]}\n"
                    f"{(stderr or '')[-3000:]}")
    return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr or "")
