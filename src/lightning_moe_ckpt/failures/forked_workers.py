"""Worker processes forked with their imports done, for the supervisor.

A worker started as a fresh interpreter imports torch, Lightning and the training script's
modules before it does anything: about 12 s of CPU on a 2-core CPU machine, and for a
replacement that time is on the recovery's critical path while every survivor waits. With
``fork_workers`` the supervisor starts its workers, replacements and warm spares from
multiprocessing's fork server instead. The server imports torch, Lightning and the modules
named in ``preload`` once (the recipe names its own; a user names what their script
imports, never a module that runs the job when it is imported), and each worker forks from
it and runs the script (or ``-m`` module) as ``__main__`` with its own environment and
arguments, as ``python`` would: ``sys.argv``, ``sys.path[0]``, Lightning's rank-zero rank
from ``RANK``, the threads joined and the ``atexit`` handlers run at the end. When the
supervisor's own ``__main__`` is a script, multiprocessing imports it in each worker as
``__mp_main__`` before the worker runs its command (its ``if __name__ == "__main__":``
block does not run then).

What differs from a fresh interpreter: what the server imported saw the supervisor's
environment, not the worker's (a variable read at import must be set for the supervisor;
``OMP_NUM_THREADS`` is the exception, applied to torch's threads in each worker), and a
script that initialises CUDA when it is imported cannot be forked (CUDA does not survive a
fork): run it without ``fork_workers``. Random generators do not start alike: Python's
``random`` reseeds itself at a fork, and each worker reseeds NumPy's global generator from
the OS as a fresh interpreter's import would. The fork server is one per process: started
by the first worker, it keeps the preload it started with. ``recipes/bench.py`` starts its
training runs the same way, each in a directory and with its output in a log file of its
own.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import runpy
import select
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only

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
    """Run ``python *arguments`` in this process, set up as ``python`` would set it up
    (``sys.argv``, ``sys.path[0]``, Lightning's rank-zero rank from the environment), then
    leave as its interpreter would: an uncaught exception's traceback first, then the
    non-daemon threads joined, then the ``atexit`` handlers (a multiprocessing process
    leaves by ``os._exit()`` and would skip them)."""
    module = arguments[0] == "-m"
    sys.argv = list(arguments[1:] if module else arguments)  # run_module puts its path first
    sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.abspath(arguments[0]))
    # Lightning read it at import, in the server; it sets it this way too.
    rank_zero_only.rank = int(os.environ.get("RANK", 0))  # type: ignore[attr-defined]
    try:
        if module:
            runpy.run_module(arguments[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(arguments[0], run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:
        sys.excepthook(*sys.exc_info())
        raise SystemExit(1) from None
    finally:
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter calls
        atexit._run_exitfuncs()


def enter_process(environment: dict[str, str], cwd: str | None = None,
                  stdout: str | None = None, stderr: str | None = None) -> None:
    """In a forked process: take ``environment`` (and nothing else of the server's), the
    directory ``cwd`` and the files ``stdout``/``stderr`` (appended to, created if need
    be; one path may name both), for this process and any it starts, and a NumPy global
    generator of its own. The environment's ``OMP_NUM_THREADS`` sets torch's intra-op
    threads, as it would in a fresh interpreter: OpenMP read the server's at import, and
    a kernel's reductions split by thread count, so two runs that should be bitwise equal
    must run with the threads their environments name."""
    os.environ.clear()
    os.environ.update(environment)
    threads = environment.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    if cwd is not None:
        os.chdir(cwd)
    for stream, path in ((sys.stdout, stdout), (sys.stderr, stderr)):
        if path is not None:
            file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(file, stream.fileno())
            os.close(file)
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # Python's ``random`` reseeds itself at a fork; NumPy's does not
        numpy.random.seed()  # from the OS's entropy, as a fresh interpreter's import seeds it


def _worker(arguments: list[str], environment: dict[str, str], cwd: str | None,
            output: str | None) -> None:
    enter_process(environment, cwd, output, output)
    run_as_main(arguments)


class WorkerForker:
    """Forks ``command``'s workers from this process's fork server, which imports torch,
    Lightning and ``preload`` when the first worker starts."""

    def __init__(self, command: Sequence[str], preload: Sequence[str] = ()) -> None:
        self.arguments = python_arguments(command)
        self.preload = [*PRELOAD, *preload]
        self.context = multiprocessing.get_context("forkserver")

    def start(self, environment: dict[str, str], *, cwd: Path | None = None,
              output: Path | None = None) -> ForkedWorker:
        """A worker running the command with ``environment`` (and nothing else of ours), in
        ``cwd`` (default: the fork server's, this process's when it started), its stdout
        and stderr appended to ``output`` (default: this process's). Relative paths are
        this process's: the worker opens ``output`` after it changed to ``cwd``."""
        self.context.set_forkserver_preload(self.preload)  # used once the server starts
        process = self.context.Process(
            target=_worker, name=f"worker {environment.get('RANK', 'spare')}",
            args=(self.arguments, environment, None if cwd is None else str(cwd.resolve()),
                  None if output is None else str(output.resolve())))
        process.start()
        return ForkedWorker(process)


class ForkedWorker:
    """A forked worker, with the calls of ``subprocess.Popen`` the supervisor makes. The
    fork server, not the supervisor, is its parent and reaps it at once, so its pid could
    be reused after it ended: it is signalled through a pidfd, which names this process
    only."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process = process
        assert process.pid is not None  # started
        self.pid: int = process.pid
        try:
            self._pidfd: int | None = os.pidfd_open(self.pid)
        except ProcessLookupError:  # it ended, and its fork server reaped it, already
            self._pidfd = None

    def poll(self) -> int | None:
        """The exit code (negative: the signal that ended it), or None while it runs. The
        fork server reports it; a server that is gone reports every worker ended, which
        the pidfd tells apart: then nothing about the workers can be known, an error."""
        code = self.process.exitcode
        if code is None or self._pidfd is None:
            return code
        if not _ended(self._pidfd, timeout_ms=0):
            raise RuntimeError(f"the fork server that started worker pid {self.pid} is gone "
                               "while the worker runs: its exit can no longer be observed")
        os.close(self._pidfd)
        self._pidfd = None
        return code

    def kill(self) -> None:
        """SIGKILL, unless it has ended."""
        if self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):  # it ended, not reported yet
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def wait(self) -> int:
        """Its exit code, once it ended: watched through its pidfd, so that this returns
        once it ended even where its fork server is gone."""
        if self._pidfd is not None:
            _ended(self._pidfd, timeout_ms=None)
        self.process.join()
        code = self.poll()
        assert code is not None
        return code


def _ended(pidfd: int, timeout_ms: int | None) -> bool:
    """Whether the process behind ``pidfd`` ended (its pidfd is readable then), waiting
    up to ``timeout_ms`` (None: until it ends). ``poll``, not ``select``: a descriptor
    numbered 1024 or more is refused by ``select``."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(timeout_ms))
