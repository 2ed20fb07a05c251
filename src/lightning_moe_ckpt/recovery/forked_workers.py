"""Worker processes forked with their imports done, for the supervisor.

A worker started as a fresh interpreter imports torch, Lightning and the training script's
modules before it does anything: about 12 s of CPU on a 2-core CPU machine, and for a
replacement that time is on the recovery's critical path while every survivor waits. With
``fork_workers`` the supervisor starts its workers, replacements and warm spares from
multiprocessing's fork server instead. The server imports torch, Lightning and the script
once (a ``-m`` module by its name; the supervisor's own script, when the workers run the
same one, as ``__mp_main__``, so its ``if __name__ == "__main__":`` block does not run),
and each worker forks from it and runs the script as ``__main__`` with its own environment
and arguments, as ``python`` would.

What differs from a fresh interpreter: what the server imported saw the supervisor's
environment, not the worker's (set per-worker variables that a library reads at import,
such as ``OMP_NUM_THREADS``, in the supervisor's environment); and a script that
initialises CUDA when it is imported cannot be forked (CUDA does not survive a fork): run
such a script without ``fork_workers``.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import sys
from collections.abc import Sequence
from typing import Protocol

from lightning_moe_ckpt.errors import require

PRELOAD = ("torch", "lightning")  # what every worker imports, whatever its script


class WorkerProcess(Protocol):
    """What the supervisor needs of a worker process (``subprocess.Popen`` has it)."""

    pid: int

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self) -> int: ...


def python_arguments(command: Sequence[str]) -> list[str]:
    """The arguments after ``python`` in ``command`` (``script *args`` or ``-m module
    *args``), refusing a command a forked worker cannot run."""
    module = len(command) >= 3 and command[1] == "-m"
    script = len(command) >= 2 and not command[1].startswith("-")
    require(bool(command) and command[0] == sys.executable and (module or script),
            f"fork_workers runs `{sys.executable} SCRIPT ...` or `{sys.executable} -m MODULE "
            f"...` in the forked workers; got the command {list(command)}")
    return list(command[1:])


def run_as_main(arguments: Sequence[str]) -> None:
    """Run ``python *arguments`` in this process: the script (or ``-m`` module) as
    ``__main__`` with ``sys.argv`` as ``python`` sets it, then the exit handlers a fresh
    interpreter would run as it exits (``atexit``; multiprocessing's processes skip them)."""
    try:
        if arguments[0] == "-m":
            sys.argv = list(arguments[1:])  # run_module puts the module's path first
            runpy.run_module(arguments[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(arguments)
            runpy.run_path(arguments[0], run_name="__main__")
    finally:
        # The one way to run them: a multiprocessing process leaves by os._exit().
        atexit._run_exitfuncs()


def _worker(arguments: list[str], environment: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environment)
    run_as_main(arguments)


class WorkerForker:
    """Forks ``command``'s workers from the fork server, which imports torch, Lightning and
    the command's script when the first worker starts."""

    def __init__(self, command: Sequence[str]) -> None:
        self.arguments = python_arguments(command)
        self.context = multiprocessing.get_context("forkserver")
        module = [self.arguments[1]] if self.arguments[0] == "-m" else []
        # Global to this process; the server starts with the first worker.
        self.context.set_forkserver_preload([*PRELOAD, *module])

    def start(self, environment: dict[str, str]) -> ForkedWorker:
        """A worker running the command with ``environment`` (and nothing else of ours)."""
        process = self.context.Process(target=_worker, args=(self.arguments, environment),
                                       name=f"worker {environment.get('RANK', 'spare')}")
        process.start()
        return ForkedWorker(process)


class ForkedWorker:
    """A forked worker, with the calls of ``subprocess.Popen`` the supervisor makes."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process = process
        assert process.pid is not None  # started
        self.pid: int = process.pid

    def poll(self) -> int | None:
        """The exit code (negative: the signal that ended it), or None while it runs."""
        return self.process.exitcode

    def kill(self) -> None:
        """SIGKILL, by its pid."""
        self.process.kill()

    def wait(self) -> int:
        """Its exit code, once it ended."""
        self.process.join()
        code = self.process.exitcode
        assert code is not None
        return code
