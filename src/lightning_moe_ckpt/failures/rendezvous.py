"""A worker's side of the supervised job: the store, generations, heartbeat, rendezvous.

Under :mod:`~lightning_moe_ckpt.failures.supervisor` every worker reaches the
supervisor's ``TCPStore`` (``MOE_STORE``). The default process group of generation ``g``
is formed on that generation's own rendezvous store, which the supervisor hosts
(``MASTER_PORT``, torch's ``env://`` rendezvous with ``TORCHELASTIC_USE_AGENT_STORE``), so
the keys of a broken generation never mix with the next one's, and a process started for
generation ``g`` forms the same group whether this module or its strategy (Lightning's)
calls ``init_process_group``. A worker bumps its heartbeat
counter at every iteration (and, while it recovers, from a helper thread, since a
recovery may legitimately wait for a replacement to start).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed import TCPStore, distributed_c10d

from lightning_moe_ckpt.core.nodes import ENV_RANKS_PER_NODE
from lightning_moe_ckpt.core.progress import RECOVERY
from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.failures.protocol import (
    ENV_AGENT_STORE,
    ENV_GENERATION,
    ENV_REPLACES,
    ENV_SECRET,
    ENV_SPARE,
    ENV_STORE,
    EXIT_CONFIG,
    EXIT_FENCED,
    EXIT_PREEMPTED,
    EXIT_SUPERVISOR_LOST,
    EXIT_UNRECOVERABLE,
    FINISHED_KEY,
    GENERATION_KEY,
    LAYOUT_KEY,
    PREEMPT_KEY,
    READY_KEY,
    SIGTERMS_KEY,
    TIMEOUT_KEY,
    ControlChannel,
    failed_key,
    fenced_key,
    finished_key,
    heartbeat_key,
    job_secret,
    rendezvous_key,
    sigterm_key,
    spare_key,
)
from lightning_moe_ckpt.failures.tasks import JobLayout, launcher_task, register, watch_in_parent
from lightning_moe_ckpt.recovery.durable import NoUsableCheckpointError

log = logging.getLogger("lightning_moe_ckpt")

_BUSY_BEAT_S = 0.5
_WATCH_S = 0.1  # how often the heartbeat thread publishes progress and reads the generation
_ARRIVAL_POLL_S = 0.05
_STARTUP_S = 600.0  # how long a launcher's task waits for the supervisor's answer
_SPARE_POLL_S = 0.2  # how often a warm spare asks whether it is needed
_SPARE_STORE_S = 30.0  # a store that does not answer a spare this long is gone


def _client(address: str, timeout: timedelta) -> TCPStore:
    host, port = address.rsplit(":", 1)
    return TCPStore(host, int(port), is_master=False, timeout=timeout)


def supervised() -> bool:
    """Whether this process is a worker of a supervised job."""
    return ENV_STORE in os.environ


def join_as_launcher_task(layout: JobLayout | None = None) -> None:
    """In a task a launcher started for a supervised job (``MOE_STORE`` set, and no
    ``RANK`` from the supervisor, which did not start this process): split off its
    monitor, register, and take the place the task's id gives it, a rank (``RANK``,
    ``WORLD_SIZE``, generation 0's ``MASTER_PORT``) or a spare's index. Task 0 tells the
    supervisor the job's shape (``layout``) when it was not given one. Elsewhere, and once
    done: nothing (see :mod:`~lightning_moe_ckpt.failures.tasks`).

    Raises:
        ConfigError: no launcher says which task this is, or the supervisor refused the
            job's shape, or its world size is not ``layout``'s.
    """
    if ENV_STORE not in os.environ or "RANK" in os.environ or ENV_SPARE in os.environ:
        return
    task = launcher_task()
    if task is None:
        raise ConfigError(f"{ENV_STORE}={os.environ[ENV_STORE]!r} is set, but neither the "
                          "supervisor (RANK) nor a launcher (SLURM_PROCID) gave this "
                          "process its place in the job")
    address = os.environ[ENV_STORE]
    secret = _secret()
    store = _client(address, timedelta(seconds=_STARTUP_S))
    if layout is not None and task.task == 0:
        ControlChannel(store, secret).set(LAYOUT_KEY, json.dumps(asdict(layout)))
    watch_in_parent(address, task.task, secret)  # from here on, the monitor's child
    store = _client(address, timedelta(seconds=_STARTUP_S))  # not the parent's socket
    channel = ControlChannel(store, secret)
    register(channel, task)
    ready = json.loads(channel.wait(READY_KEY, _STARTUP_S))
    if "error" in ready:
        raise ConfigError(ready["error"])
    world = int(ready["world_size"])
    if layout is not None and layout.world_size != world:
        raise ConfigError(f"the supervisor runs a job of {world} ranks; this task's "
                          f"configuration has {layout.world_size}")
    # Lightning's SLURM environment would take the tasks (spares included) for the ranks.
    for key in ("SLURM_NTASKS", "SLURM_PROCID"):
        os.environ[f"MOE_{key}"] = os.environ.pop(key)
    env = {ENV_AGENT_STORE: "True", "MASTER_ADDR": address.rsplit(":", 1)[0],
           "WORLD_SIZE": str(world), "NODE_RANK": "0",
           "MASTER_PORT": channel.wait(rendezvous_key(0), _STARTUP_S)}
    if ready["ranks_per_node"] is not None:
        env[ENV_RANKS_PER_NODE] = str(ready["ranks_per_node"])
    if task.task < world:
        env.update({"RANK": str(task.task), "LOCAL_RANK": str(task.task),
                    ENV_GENERATION: "0"})
    else:
        env[ENV_SPARE] = str(task.task - world)
    os.environ.update(env)


def is_launcher_task() -> bool:
    """Whether this process joined the job as a launcher's task."""
    return "MOE_SLURM_PROCID" in os.environ


def await_assignment() -> bool:
    """In a warm spare: wait until the supervisor hands this process a failed rank and take
    its identity (the environment a replacement would have been started with); ``False``
    when the job ended without needing it. Elsewhere: ``True`` at once. A launcher's task
    joins first (:func:`join_as_launcher_task`)."""
    join_as_launcher_task()
    index = os.environ.pop(ENV_SPARE, None)
    if index is None:
        return True
    # A spare may idle for the whole job, but not past its supervisor: it asks now and
    # then, and a store that stops answering (its machine gone) ends it.
    store = _client(os.environ[ENV_STORE], timedelta(seconds=_SPARE_STORE_S))
    channel = ControlChannel(store, _secret())
    try:
        while (message := channel.read(spare_key(int(index)))) is None:
            time.sleep(_SPARE_POLL_S)
        assignment = json.loads(message)
    except RuntimeError as error:  # torch's store errors: the supervisor is gone
        log.error("spare %s (pid %d): lost the supervisor's store (%s); this spare stops",
                  index, os.getpid(), error)
        logging.shutdown()
        os._exit(EXIT_SUPERVISOR_LOST)
    if assignment is None:
        return False
    generation = str(assignment["generation"])
    os.environ.update({"RANK": str(assignment["rank"]), "LOCAL_RANK": str(assignment["rank"]),
                       ENV_GENERATION: generation, ENV_REPLACES: generation,
                       "MASTER_PORT": str(assignment["master_port"])})
    return True


_THIS_PROCESS: dict[str, JobStore] = {}  # this process's handle, by store address


def _secret() -> str:
    """The job's secret from the environment (the supervisor's, or the batch script's).

    Raises:
        ConfigError: It is not set.
    """
    secret = job_secret()
    if secret is None:
        raise ConfigError(f"{ENV_STORE} is set but {ENV_SECRET} is not: every process of a "
                          "supervised job holds the job's secret (the supervisor sets it for "
                          "the processes it starts; a batch script exports it for srun's "
                          "tasks and the supervisor alike)")
    return secret


@contextmanager
def exit_on_error() -> Iterator[None]:
    """Turn an exception escaping a worker into an immediate exit after its traceback:
    code 1, or ``EXIT_UNRECOVERABLE`` when nothing is left to recover from (the supervisor
    then stops the job instead of replacing the worker).

    A worker that raised still holds process groups whose peers are alive and a heartbeat
    thread; tearing those down in interpreter finalization can abort the process (SIGABRT,
    exit -6), which would hide the real cause from the supervisor and the user. The worker
    holds nothing that must be saved (its peers keep the state), so it leaves at once.
    """
    try:
        yield
    except BaseException as error:  # every escape ends the worker the same way
        if (isinstance(error, SystemExit) and error.code in (0, None)
                and not isinstance(error, SIGTERMException)):  # (a SystemExit of code None)
            raise
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_code(error))


def _exit_code(error: BaseException) -> int:
    """What a worker that stopped on ``error`` tells the supervisor by its exit code."""
    if isinstance(error, SIGTERMException):  # the job was preempted: this rank saved
        return EXIT_PREEMPTED
    if isinstance(error, NoUsableCheckpointError):
        return EXIT_UNRECOVERABLE
    return EXIT_CONFIG if isinstance(error, ConfigError) else 1


def _stop_job_on_config_error() -> None:
    """In a supervised worker, an uncaught :class:`ConfigError` (a set-up error of the
    user's script, such as a layout that cannot be protected) exits with
    ``EXIT_CONFIG``, so that the supervisor stops the job instead of replacing the worker,
    which would stop on it again."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, trace: Any) -> None:
        previous(kind, error, trace)
        if isinstance(error, ConfigError):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_CONFIG)

    sys.excepthook = hook


@dataclass
class JobStore:
    """This worker's handle on the supervised job."""

    store: TCPStore
    address: str
    rank: int
    world_size: int
    generation: int  # the generation this process's process groups belong to
    replaces: int | None  # the generation a replacement joins (None: an original worker)
    timeout: timedelta  # store operations and the rendezvous of a new generation
    collective_timeout: timedelta  # a collective stuck on a dead peer errors after this
    channel: ControlChannel  # the supervisor's sealed messages, on ``store``
    hang_timeout_s: float = 60.0  # the supervisor's (--timeout-s), exactly as it gave it
    _arrived_at: set[int] = field(default_factory=set)  # generations this process joined
    _iterations: int = 0  # iterations begun (bumped by the training thread)
    _newest_seen: int = 0  # the newest generation the heartbeat thread saw
    _newest_sealed: int = 0  # the newest generation current_generation() read
    _watcher: threading.Thread | None = None
    _stop_watch: threading.Event = field(default_factory=threading.Event)
    _sigterm: bool = False  # this process received a SIGTERM (set by its signal handler)
    _sigterm_reported: bool = False
    preempt_requested: bool = False  # the supervisor preempted the job (seen by the watcher)

    @classmethod
    def from_env(cls, timeout_s: float | None = None) -> JobStore | None:
        """The job store when this process runs under the supervisor, else ``None``.

        ``timeout_s`` is ``recovery.timeout_s``, the supervisor's hang timeout (None: the
        supervisor's own, ``--timeout-s``). Collectives give up after a third of it, so a
        survivor blocked on a dead peer notices (and keeps its heartbeat while it
        recovers) well before it could be taken for hung; a new generation's rendezvous
        waits three times as long, for a replacement to start.

        Raises:
            ConfigError: ``timeout_s`` differs from the supervisor's hang timeout.
        """
        address = os.environ.get(ENV_STORE)
        if address is None:
            return None
        # One handle per process: the strategy forms the groups, the training loop
        # recovers, and both must see the generation this process is in.
        job = _THIS_PROCESS.get(address)
        if job is None:
            _stop_job_on_config_error()
            replaces = os.environ.get(ENV_REPLACES)
            store = _client(address, timedelta(seconds=3 * (timeout_s or 60.0)))
            channel = ControlChannel(store, _secret())
            supervisor_s = float(channel.wait(TIMEOUT_KEY, 3 * (timeout_s or 60.0)))
            timeout = timedelta(seconds=3 * supervisor_s)
            store.set_timeout(timeout)
            job = cls(store, address, int(os.environ["RANK"]),
                      int(os.environ["WORLD_SIZE"]), int(os.environ.get(ENV_GENERATION, "0")),
                      None if replaces is None else int(replaces), timeout,
                      timedelta(seconds=supervisor_s / 3), channel, supervisor_s)
            _THIS_PROCESS[address] = job
        # Compared as given: a third of it in a timedelta is rounded to microseconds.
        supervisor_s = job.hang_timeout_s
        if timeout_s is not None and abs(supervisor_s - float(timeout_s)) > 1e-6:
            raise ConfigError(
                f"recovery_timeout_s={timeout_s} (recovery.timeout_s) differs from the "
                f"supervisor's hang timeout {supervisor_s:g} s (--timeout-s): collectives "
                "must give up on a dead peer well before the supervisor takes a "
                "recovering worker for hung; use the same value for both")
        return job

    def current_generation(self) -> int:
        """The newest generation the supervisor opened (a forged value is ignored: the
        newest sealed one seen stays)."""
        message = self.channel.read(GENERATION_KEY)
        if message is not None:
            self._newest_sealed = max(self._newest_sealed, int(message))
        return max(self._newest_sealed, self.generation)

    def failed_ranks(self, generation: int) -> tuple[int, ...]:
        """The ranks whose failure opened ``generation``."""
        return tuple(json.loads(self.channel.wait(failed_key(generation),
                                                  self.timeout.total_seconds())))

    def heartbeat(self) -> None:
        """Progress: this worker is about to run another iteration.

        The training thread only bumps a counter; a helper thread publishes it to the
        store (the supervisor's hang detection reads it there) and watches for a newer
        generation, so an iteration costs no store round trip. A hung training thread
        stops the counter, and the helper then publishes nothing."""
        self._iterations += 1
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="job-heartbeat",
                                             daemon=True)
            self._watcher.start()

    def note_sigterm(self) -> None:
        """This process received a SIGTERM (safe in a signal handler: it only sets a flag;
        the heartbeat thread reports it to the supervisor, which decides whether the job
        is preempted or this rank alone failed)."""
        self._sigterm = True

    def newer_generation_seen(self) -> bool:
        """Whether the heartbeat thread saw the supervisor open a newer generation than
        this process's (cheap: no store access on the caller's thread)."""
        return self._newest_seen > self.generation

    def _watch(self) -> None:
        try:
            store = _client(self.address, self.timeout)  # its own connection: thread-safe
            channel = self.channel.on(store)
            key = heartbeat_key(self.rank, os.getpid())
            published = 0
            while not self._stop_watch.wait(_WATCH_S):
                done = self._iterations  # an int written by the training thread
                if done != published:
                    store.add(key, done - published)
                    published = done
                message = channel.read(GENERATION_KEY)
                if message is not None:  # (a forged one is ignored)
                    self._newest_seen = max(self._newest_seen, int(message))
                if self._newest_seen > self.generation:  # it may have replaced this one
                    self._stop_if_fenced(channel)
                if self._sigterm and not self._sigterm_reported:
                    channel.set(sigterm_key(self.rank, os.getpid()), "1")
                    store.add(SIGTERMS_KEY, 1)
                    self._sigterm_reported = True
                if not self.preempt_requested and channel.read(PREEMPT_KEY) is not None:
                    self.preempt_requested = True
        except (RuntimeError, OSError) as error:  # torch's store errors are RuntimeErrors
            if self._stop_watch.is_set():
                return  # training is over: the supervisor may be gone by now
            # The store lives in the supervisor: it is gone, so no failure could be
            # recovered and nobody would collect this worker's results. An orphan
            # training on for hours helps no one.
            log.error("rank %d (pid %d): lost the supervisor's store (%s); this worker "
                      "stops", self.rank, os.getpid(), error)
            logging.shutdown()  # flush before the hard exit
            os._exit(EXIT_SUPERVISOR_LOST)

    def _stop_if_fenced(self, channel: ControlChannel) -> None:
        """Exit (``EXIT_FENCED``) when the supervisor gave up on this process and replaced
        it: cut off or frozen for a while, it must take no part in a newer generation."""
        message = channel.read(fenced_key(self.rank, os.getpid()))
        if message is None:
            return
        fence = json.loads(message)
        if fence.get("host") not in (None, socket.gethostname()):
            return  # another machine's process of the same rank and pid
        log.error("rank %d (pid %d): the supervisor gave up on this process and replaced it "
                  "in generation %s (its machine was cut off or stalled); it stops",
                  self.rank, os.getpid(), fence.get("generation"))
        logging.shutdown()
        os._exit(EXIT_FENCED)

    def training_finished(self) -> None:
        """This worker's training loop ended: the supervisor times the job's training
        and no longer expects its heartbeat."""
        self.channel.set(finished_key(self.rank, os.getpid()), "1")
        self.store.add(FINISHED_KEY, 1)

    def stop_heartbeat(self) -> None:
        """Training is over: stop the heartbeat thread (before the interpreter exits, so
        no store call is cut off mid-way)."""
        self._stop_watch.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None

    def join(self, generation: int, backend: str) -> None:
        """Form the default process group of ``generation`` or of a newer one (collective
        over the world).

        Everyone first arrives on the store (waiting as long as a replacement may take to
        start); a rank still waiting when another failure opens a newer generation moves
        on to that one, so failures that follow each other end in one rendezvous. The
        group is formed on the generation's rendezvous store through torch's ``env://``
        rendezvous, as a strategy would form it (``MASTER_PORT`` of this process becomes
        the generation's), with the short collective timeout, which also bounds a
        point-to-point receive from a peer that died (gloo takes it from the group's
        creation), so every group built in this process gets it."""
        if dist.is_initialized():
            dist.destroy_process_group()
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not self._all_arrived(generation):
            RECOVERY.mark()  # waiting for the others (bounded by the deadline) is progress
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: not every rank joined generation "
                                   f"{generation} within {self.timeout.total_seconds():.0f} s")
            generation = max(generation, self.current_generation())
        distributed_c10d.default_pg_timeout = self.collective_timeout  # new_group's default
        os.environ.update({"MASTER_ADDR": self.address.rsplit(":", 1)[0], ENV_AGENT_STORE: "True",
                           "MASTER_PORT": self.channel.wait(rendezvous_key(generation),
                                                            self.timeout.total_seconds())})
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size,
                                timeout=self.collective_timeout)
        self.generation = generation

    def arrive(self, generation: int) -> None:
        """Count this process in at ``generation`` without forming a group: a process
        whose strategy forms the default group itself (Lightning's) arrives here first,
        so that the survivors waiting in :meth:`join` go on to the rendezvous."""
        self._all_arrived(generation, wait=False)

    def _all_arrived(self, generation: int, wait: bool = True) -> bool:
        """Arrive at ``generation`` (once) and wait a moment for the others; whether all
        ``world_size`` ranks are there."""
        arrived = f"gen{generation}/arrived"
        if generation not in self._arrived_at:
            self._stop_if_fenced(self.channel)  # a fenced process never counts in
            self._arrived_at.add(generation)
            self.store.add(arrived, 1)
        for _ in range(20 if wait else 0):
            if int(self.store.add(arrived, 0)) >= self.world_size:
                return True
            time.sleep(_ARRIVAL_POLL_S)
        return False

    def await_new_generation(self) -> bool:
        """Wait (heartbeat kept) for the supervisor to open a generation newer than this
        process's; ``False`` when none opened within the rendezvous timeout."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        with self.busy():
            while self.current_generation() == self.generation:
                RECOVERY.mark()  # waiting for the supervisor (bounded) is progress
                if time.monotonic() > deadline:
                    return False
                time.sleep(_ARRIVAL_POLL_S)
        return True

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Keep the heartbeat going while this worker recovers and its recovery makes
        progress (:data:`~lightning_moe_ckpt.core.progress.RECOVERY`): waits for the
        others (each bounded by its own deadline), fetches, replayed iterations. A recovery
        that makes none for the hang timeout is hung: the heartbeat stops (logged), and
        the supervisor ends the worker as it ends a hung one, one hang timeout later."""
        stop = threading.Event()
        store = _client(self.address, self.timeout)  # its own connection: thread-safe

        key = heartbeat_key(self.rank, os.getpid())
        RECOVERY.mark()

        def beat() -> None:
            stalled = False
            while not stop.wait(_BUSY_BEAT_S):
                idle = RECOVERY.idle_s()
                if idle < self.hang_timeout_s:
                    store.add(key, 1)
                    stalled = False
                elif not stalled:
                    stalled = True
                    log.error("rank %d (pid %d): the recovery made no progress for %.0f s; "
                              "its heartbeat stops, so the supervisor ends this worker as "
                              "hung", self.rank, os.getpid(), idle)

        thread = threading.Thread(target=beat, name="recovery-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
