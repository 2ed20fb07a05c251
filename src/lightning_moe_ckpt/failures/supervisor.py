"""The supervisor: hosts the job's store, starts the workers and replaces the ones that fail.

A real failure takes a worker process down (killed, exited, raised) or stalls it (hung).
The supervisor is the one process no worker failure can take down: it hosts the
``TCPStore`` the workers rendezvous on and watches every worker:

* a worker that **exits** with a non-zero code failed;
* a worker whose **heartbeat** (a counter in the store it bumps every iteration) has not
  moved for ``timeout_s`` is hung: the supervisor kills it by its pid, and it failed.

For a failure it opens a new **generation** of the job: it publishes the failed ranks
under ``failed/<g>`` and then ``generation = g``, and starts a replacement process with
the failed rank's identity (rank, stage, expert shard, data shard follow from the rank)
and ``MOE_REPLACES=<g>`` in its environment, or, with ``spares`` > 0, hands that identity
to a **warm spare**: a process started with the job (``MOE_SPARE=<i>``) that has its
imports and configuration done and waits on the store key ``spare/<i>`` for a rank.
With ``fork_workers`` every one of these processes is forked from a fork server that has
torch, Lightning and ``preload`` imported
(:mod:`~lightning_moe_ckpt.failures.forked_workers`), so a replacement does not import them
again while the survivors wait.
Each generation's default process group rendezvous on a store of its own, which the
supervisor opens with the generation (``MASTER_ADDR``/``MASTER_PORT`` in the workers'
environment, with ``TORCHELASTIC_USE_AGENT_STORE=True``, as torch elastic's agent does:
every rank connects as a client, so no training rank hosts a store, and any launcher's
``init_process_group`` finds it, Lightning's strategies' included). The survivors see the
new generation (a collective error, or the generation key at their next iteration),
re-form their process groups on its store and recover with the replacement; they keep
their processes and their state. After ``max_restarts`` replacements the job ends with
an error naming the rank and the generation (``EXIT_NO_SPARE``). The job's exit code is 0
when every worker finished training and exited cleanly; a worker that fails after its
training loop ended is reported, not replaced (no generation can form without the ranks
that finished), and the code is then 1; a worker that stopped on a configuration error
ends the job with ``EXIT_CONFIG``, one that found nothing to recover from with
``EXIT_UNRECOVERABLE``.

The workers live no longer than their supervisor: a SIGTERM to it (a scheduler's
cancel) stops them by pid before it exits, and a worker that loses the supervisor's
store (the supervisor was killed) stops itself (exit code ``EXIT_SUPERVISOR_LOST``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore

from lightning_moe_ckpt.core.nodes import ENV_RANKS_PER_NODE
from lightning_moe_ckpt.failures.forked_workers import WorkerForker, WorkerProcess
from lightning_moe_ckpt.failures.protocol import (
    ENV_AGENT_STORE,
    ENV_GENERATION,
    ENV_REPLACES,
    ENV_SECRET,
    ENV_SPARE,
    ENV_STORE,
    EXIT_CONFIG,
    EXIT_NO_SPARE,
    EXIT_PREEMPTED,
    EXIT_UNRECOVERABLE,
    FINISHED_KEY,
    GENERATION_KEY,
    LAYOUT_KEY,
    PREEMPT_GRACE_S,
    PREEMPT_KEY,
    READY_KEY,
    SIGTERMS_KEY,
    STATUS_KEY,
    TIMEOUT_KEY,
    ControlChannel,
    failed_key,
    fenced_key,
    finished_key,
    heartbeat_key,
    hosted_store,
    job_secret,
    kill_key,
    rendezvous_key,
    sigterm_key,
    spare_key,
)
from lightning_moe_ckpt.failures.tasks import JobLayout, TaskProcess, TaskStartError

log = logging.getLogger("lightning_moe_ckpt")

POLL_S = 0.05
# How long the other ranks of a node one rank of which failed are watched for failing too
# (with ranks_per_node): a lost machine's processes are seen to exit one by one.
NODE_LOSS_S = 1.0
# With a rank of a node hung: how much sooner than the hang timeout its node's other
# ranks count as hung with it (the ranks of a stalled machine stop beating a moment apart).
NODE_HANG_SLACK_S = 5.0
# How long a worker's SIGTERM waits for the job's: SIGTERMs to every rank, or to the
# supervisor, within this make a preemption; a SIGTERM to some ranks alone is their failure.
SIGTERM_DECIDE_S = 2.0

@dataclass
class Replacement:
    """One failure and what replaced it."""

    rank: int
    generation: int
    dead_pid: int
    new_pid: int
    cause: str  # "exit <code>", "hang", ...
    detected_s: float  # since the job started
    warm_spare: bool = False  # a spare started with the job took the rank
    node: int | None = None  # the node that ran the rank (with ranks_per_node)
    spare_node: int | None = None  # the spare node that took it (a whole node was lost)


@dataclass
class Supervisor:
    """Starts ``world_size`` workers running ``command`` and keeps the job whole."""

    command: Sequence[str]
    world_size: int
    timeout_s: float = 60.0
    max_restarts: int = 3
    spares: int = 0  # warm spare processes started with the job
    env: dict[str, str] = field(default_factory=dict)
    # Where the live view goes (store address, supervisor and worker pids), rewritten
    # whenever a process changes: for operators and tests that act on a worker by pid.
    status_path: Path | None = None
    # Fork the workers, replacements and spares with torch, Lightning and ``preload``
    # imported once (recovery.forked_workers) instead of starting fresh interpreters.
    fork_workers: bool = False
    # What the fork server imports besides torch and Lightning (modules safe to import:
    # the script's own imports, never a module that runs the job when imported).
    preload: Sequence[str] = ()
    # Ranks per node (node n runs ranks n*R..n*R+R-1), given to the workers as
    # MOE_RANKS_PER_NODE; None: one node runs every rank.
    ranks_per_node: int | None = None
    # Spare nodes started with the job, ranks_per_node warm spares each: a node whose
    # every rank failed at once is taken over by one of them, rank for rank.
    spare_nodes: int = 0
    # Tasks a launcher started (srun, recipes/cluster.py) instead of processes of this
    # supervisor's own (failures.tasks): the first world_size are the ranks, the next
    # spare_nodes x ranks_per_node the spare nodes, the rest single spares. With
    # world_size 0 the job's shape comes from task 0 (JobLayout). None: start them here.
    launcher_tasks: int | None = None
    # Where the job store listens: the host the workers reach it at, and its port (0: a
    # free one; a launcher's tasks are told a fixed one).
    store_host: str = "127.0.0.1"
    store_port: int = 0
    # How long a launcher's tasks may take to start and register.
    startup_timeout_s: float = 600.0
    # After a SIGTERM to the job (a preemption): how long the workers have to commit a
    # durable checkpoint and exit before they are killed.
    preempt_grace_s: float = PREEMPT_GRACE_S
    # Where the job's durable checkpoints go, for the message its end leaves: "" when it
    # takes none; None when not known (a script of the user's).
    durable_dir: str | None = None
    replacements: list[Replacement] = field(default_factory=list)
    _tasks: list[TaskProcess] = field(default_factory=list, repr=False)  # every one attached
    pids: dict[int, list[int]] = field(default_factory=dict)  # every process of each rank
    spare_pids: list[int] = field(default_factory=list)  # the warm spares started
    spare_node_pids: list[list[int]] = field(default_factory=list)  # each spare node's
    # Since the job started: when every rank began its first iteration; and from then to
    # the end of every rank's training loop (recoveries and replacements included; start-up
    # and writing the results not).
    training_started_s: float | None = None
    training_s: float | None = None
    _forker: WorkerForker | None = field(default=None, init=False, repr=False)
    # When the job was preempted (a SIGTERM to the supervisor, or to every rank).
    _preempted_at: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.launcher_tasks is not None:
            if self.fork_workers or self.command:
                raise ValueError("a launcher starts the tasks: no command and no "
                                 "fork_workers for the supervisor")
            if self.world_size == 0:
                return  # the shape comes from task 0; checked when it arrives
        self._check_shape()
        # A command a forked worker cannot run is refused here, before anything starts.
        self._forker = WorkerForker(self.command, self.preload) if self.fork_workers else None

    def _check_shape(self) -> None:
        per_node = self.ranks_per_node
        if per_node is not None and (per_node < 1 or self.world_size % per_node):
            raise ValueError(f"ranks_per_node={per_node} must be >= 1 and divide the world "
                             f"size {self.world_size}")
        if self.spare_nodes < 0 or (self.spare_nodes and per_node is None):
            raise ValueError(f"spare_nodes={self.spare_nodes} must be >= 0, and needs "
                             "ranks_per_node (how many ranks a spare node takes)")
        if self.launcher_tasks is not None:
            layout = JobLayout(self.world_size, self.spares, self.spare_nodes)
            if layout.tasks(per_node or 1) != self.launcher_tasks:
                raise ValueError(
                    f"the launcher started {self.launcher_tasks} tasks; the job needs "
                    f"{layout.tasks(per_node or 1)}: {self.world_size} ranks, "
                    f"{self.spare_nodes} spare nodes of {per_node or 1} and "
                    f"{self.spares} spares")

    def run(self) -> int:
        """Supervise until every worker finished (0) or the job cannot go on (1,
        ``EXIT_UNRECOVERABLE``, ``EXIT_CONFIG`` or ``EXIT_NO_SPARE``). A SIGTERM is a
        preemption: every rank is told to stop, commits a durable checkpoint and exits
        within ``preempt_grace_s`` (``EXIT_PREEMPTED``); those still running then are
        killed (``128 + SIGTERM``). A second SIGTERM stops the workers at once."""
        if threading.current_thread() is not threading.main_thread():
            try:  # signal handlers belong to the main thread
                return self._supervise()
            finally:
                self._name_unconfirmed()
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            return self._supervise()
        finally:
            signal.signal(signal.SIGTERM, previous)
            self._name_unconfirmed()

    def _name_unconfirmed(self) -> None:
        """Say which of a launcher's tasks never reported their end: their machines did
        not answer, so they may still run (each stops by itself once it reads that it was
        fenced, or once it loses the store)."""
        left = [f"task {t.task} (node {t.node}, pid {t.pid})" for t in self._tasks
                if t.unconfirmed]
        if left:
            log.warning("supervisor: the job ends, but %s never reported its end (its "
                        "machine did not answer): it may still run there; it stops by "
                        "itself once it reaches the store (it is fenced) or loses it",
                        ", ".join(left))

    def _on_sigterm(self, signum: int, frame: object) -> None:
        """The job is preempted (the supervisor's loop tells the workers); a second
        SIGTERM ends the supervisor as Ctrl-C would, stopping the workers by pid."""
        if self._preempted_at is not None:
            raise SystemExit(128 + signum)
        self._preempted_at = time.monotonic()

    def _supervise(self) -> int:
        secret = job_secret(create=self.launcher_tasks is None)
        if secret is None:  # a launcher's tasks must hold the same one: the script's
            log.error("supervisor: %s is not set: with --launcher-tasks the batch script "
                      "exports the job's secret for the supervisor and srun's tasks alike "
                      "(export %s=$(python -c 'import secrets; print(secrets.token_hex(32))'))",
                      ENV_SECRET, ENV_SECRET)
            return EXIT_CONFIG
        store = hosted_store(self.store_host, self.store_port,
                             timedelta(seconds=max(30.0, self.timeout_s)))
        self._channel = channel = ControlChannel(store, secret)
        if self.launcher_tasks is not None:
            answered = self._shape_from_tasks(store)
            if answered is not None:
                return answered
        channel.set(TIMEOUT_KEY, repr(float(self.timeout_s)))
        rendezvous = [self._open_rendezvous(store, 0)]  # one store per generation
        channel.set(GENERATION_KEY, "0")
        self.started = time.monotonic()
        base = {**os.environ, **self.env, ENV_STORE: f"{self.store_host}:{store.port}",
                "MASTER_ADDR": self.store_host, ENV_AGENT_STORE: "True",
                "WORLD_SIZE": str(self.world_size), "NODE_RANK": "0"}
        if self.ranks_per_node is not None:
            base[ENV_RANKS_PER_NODE] = str(self.ranks_per_node)
        workers: dict[int, WorkerProcess] = {}
        idle: list[tuple[int, WorkerProcess]] = []
        idle_nodes: list[tuple[int, list[tuple[int, WorkerProcess]]]] = []  # spare nodes
        done: set[int] = set()
        after_training: dict[int, str] = {}  # ranks that failed once their training ended
        generation = 0
        try:  # from the first start on: a start that fails stops those already started
            if self.launcher_tasks is None:
                self._start_all(base, rendezvous[0].port, workers, idle, idle_nodes)
            else:
                try:
                    self._attach_tasks(store, workers, idle, idle_nodes)
                except TaskStartError as error:  # the job cannot start: every task stops
                    for index in range(self.launcher_tasks):
                        channel.set(kill_key(index), "1")  # those not attached too
                    self._stop(_every_process(workers, idle, idle_nodes))
                    log.error("supervisor: %s; the job stops", error)
                    return 1
                misplaced = self._misplaced_tasks(workers, idle, idle_nodes)
                if misplaced:
                    self._stop(_every_process(workers, idle, idle_nodes))
                    log.error("supervisor: %s; the job stops", misplaced)
                    return EXIT_CONFIG
            self.pids = {rank: [process.pid] for rank, process in workers.items()}
            self.spare_pids = [process.pid for _, process in idle]
            self.spare_node_pids = [[p.pid for _, p in spares] for _, spares in idle_nodes]
            self._publish(store, workers, idle, idle_nodes)
            beats = {rank: (-1, time.monotonic()) for rank in workers}
            sigterms = _SigtermWatch()
            preempted: set[int] = set()  # ranks that stopped on the preemption
            finished_ok: set[int] = set()  # ranks that exited 0 (their training ended)
            while len(done) < self.world_size:
                time.sleep(POLL_S)
                lone, everyone = sigterms.poll(channel, workers, done)
                if everyone and self._preempted_at is None:
                    self._preempted_at = time.monotonic()  # every rank got it: the job's
                if self._preempted_at is not None:
                    stopped = self._preemption(store, workers, done, preempted,
                                               finished_ok, idle, idle_nodes)
                    if stopped is not None:
                        return stopped
                    continue
                if self.training_started_s is None and all(b[0] > 0 for b in beats.values()):
                    self.training_started_s = time.monotonic() - self.started
                if (self.training_s is None and self.training_started_s is not None
                        and int(store.add(FINISHED_KEY, 0)) >= self.world_size):
                    self.training_s = (time.monotonic() - self.started
                                       - self.training_started_s)
                failed: dict[int, str] = {}
                for rank in lone:  # a SIGTERM to this rank alone: its failure
                    if rank not in done and workers[rank].poll() is None:
                        workers[rank].kill()
                        workers[rank].wait()
                        failed[rank] = "sigterm"
                for rank, process in workers.items():
                    if rank in done or rank in failed:
                        continue
                    code = process.poll()
                    if code == 0:
                        done.add(rank)
                        finished_ok.add(rank)
                    elif code is not None and self._training_finished(rank, process.pid):
                        # No generation can form without the ranks that finished, and
                        # there is nothing left to train: the failure is reported, not
                        # replaced (see _after_training).
                        done.add(rank)
                        after_training[rank] = f"exit {code}"
                        log.warning("supervisor: rank %d (pid %d) failed after its training "
                                    "loop ended: exit %s; not replaced", rank, process.pid,
                                    code)
                    elif code is not None:
                        failed[rank] = f"exit {code}"
                    elif self._hung(store, rank, process.pid, beats):
                        process.kill()  # a hang becomes a death (SIGKILL, by its pid)
                        process.wait()
                        failed[rank] = "hang"
                if not failed:
                    continue
                if self.ranks_per_node is not None:  # one lost machine, one recovery
                    self._await_node_losses(workers, done, failed, store, beats)
                hopeless = sorted(r for r, why in failed.items()
                                  if why == f"exit {EXIT_UNRECOVERABLE}")
                if hopeless:
                    self._stop(_every_process(workers, idle, idle_nodes))
                    log.error("supervisor: rank(s) %s found nothing to recover from (their "
                              "error is above); the job stops", hopeless)
                    return EXIT_UNRECOVERABLE
                misconfigured = sorted(r for r, why in failed.items()
                                       if why == f"exit {EXIT_CONFIG}")
                if misconfigured:
                    self._stop(_every_process(workers, idle, idle_nodes))
                    log.error("supervisor: rank(s) %s stopped on a configuration error "
                              "(above), which a replacement would stop on too; the job "
                              "stops", misconfigured)
                    return EXIT_CONFIG
                if len(self.replacements) + len(failed) > self.max_restarts:
                    self._stop(_every_process(workers, idle, idle_nodes))
                    ranks = ", ".join(f"rank {r} ({why})" for r, why in sorted(failed.items()))
                    log.error("supervisor: %s failed after %d replacements "
                              "(recovery.max_restarts=%d): no replacement is left, the job "
                              "stops (exit code %d; %s)", ranks, len(self.replacements),
                              self.max_restarts, EXIT_NO_SPARE, self._restart_note())
                    return EXIT_NO_SPARE
                if self.launcher_tasks is not None and not self._spares_cover(
                        failed, idle, idle_nodes):
                    self._stop(_every_process(workers, idle, idle_nodes))
                    ranks = ", ".join(f"rank {r} ({why})" for r, why in sorted(failed.items()))
                    log.error("supervisor: %s failed and no spare task is left to take over "
                              "(the launcher started the tasks: no new one can start); the "
                              "job stops (exit code %d; %s)", ranks, EXIT_NO_SPARE,
                              self._restart_note())
                    return EXIT_NO_SPARE
                generation += 1
                for rank, cause in sorted(failed.items()):
                    log.warning("supervisor: rank %d (pid %d) failed: %s; opening generation "
                                "%d", rank, workers[rank].pid, cause, generation)
                for rank in failed:  # it may still run somewhere: fenced out
                    channel.set(fenced_key(rank, workers[rank].pid), json.dumps(
                        {"generation": generation, "host": _host_of(workers[rank])}))
                channel.set(failed_key(generation), json.dumps(sorted(failed)))
                rendezvous.append(self._open_rendezvous(store, generation))
                channel.set(GENERATION_KEY, str(generation))
                idle = [(index, process) for index, process in idle if process.poll() is None]
                idle_nodes = [(node, spares) for node, spares in idle_nodes
                              if all(process.poll() is None for _, process in spares)]
                by_spare_node = self._spare_nodes_for(failed, idle_nodes)
                for rank, cause in sorted(failed.items()):
                    dead = workers[rank].pid
                    spare_node = None
                    warm = rank in by_spare_node or bool(idle)
                    if warm:  # the rank's identity goes to a spare that is up already
                        if rank in by_spare_node:  # its whole node was lost
                            spare_node, (index, workers[rank]) = by_spare_node[rank]
                        else:
                            index, workers[rank] = idle.pop(0)
                        channel.set(spare_key(index), json.dumps(
                            {"rank": rank, "generation": generation,
                             "master_port": rendezvous[generation].port}))
                    else:
                        workers[rank] = self._start(base, rank, generation, generation,
                                                    rendezvous[generation].port)
                    self.pids[rank].append(workers[rank].pid)
                    beats[rank] = (-1, time.monotonic())
                    self.replacements.append(Replacement(
                        rank, generation, dead, workers[rank].pid, cause,
                        time.monotonic() - self.started, warm,
                        None if self.ranks_per_node is None else rank // self.ranks_per_node,
                        spare_node))
                self._publish(store, workers, idle, idle_nodes)
                store.set(f"replacements/{generation}",
                          json.dumps([vars(r) for r in self.replacements
                                      if r.generation == generation]))
        except BaseException:
            self._stop(_every_process(workers, idle, idle_nodes))
            raise
        if self.training_s is None:  # they finished between two polls
            self.training_s = time.monotonic() - self.started - (self.training_started_s or 0.0)
        unused = idle + [spare for _, spares in idle_nodes for spare in spares]
        for index, _ in unused:  # training is over: the unused spares leave
            channel.set(spare_key(index), json.dumps(None))
        self._stop(_every_process({}, unused), grace_s=self.timeout_s)
        return self._after_training(after_training)

    def _restart_note(self) -> str:
        """What the job does when it is started again, for the messages of its end."""
        if self.durable_dir is None:
            return ("started again, it resumes from its newest committed durable checkpoint, "
                    "if its script takes durable checkpoints")
        if not self.durable_dir:
            return ("the job takes no durable checkpoints (checkpoint.durable_every is not "
                    "set): started again, it starts afresh at step 0")
        return (f"started again, it resumes from its newest committed durable checkpoint in "
                f"{self.durable_dir}")

    def _preemption(self, store: TCPStore, workers: dict[int, WorkerProcess],
                    done: set[int], preempted: set[int], finished: set[int],
                    idle: list[tuple[int, WorkerProcess]],
                    idle_nodes: list[tuple[int, list[tuple[int, WorkerProcess]]]]
                    ) -> int | None:
        """While the job is preempted: tell the workers (once), collect those that
        stopped, and once all did or the grace ran out, the job's exit code
        (``EXIT_PREEMPTED`` when every rank stopped on it, else ``128 + SIGTERM``)."""
        assert self._preempted_at is not None
        if self._channel.read(PREEMPT_KEY) is None:
            self._channel.set(PREEMPT_KEY, "1")
            log.warning("supervisor: the job is preempted (SIGTERM); every rank commits a "
                        "durable checkpoint and stops within %g s", self.preempt_grace_s)
        for rank, process in workers.items():
            code = process.poll()
            if rank not in done and code is not None:
                done.add(rank)
                if code in (EXIT_PREEMPTED, -signal.SIGTERM, 128 + signal.SIGTERM):
                    preempted.add(rank)
                elif code == 0:  # its training had ended: nothing left to save
                    finished.add(rank)
        late = time.monotonic() - self._preempted_at > self.preempt_grace_s
        if len(done) < self.world_size and not late:
            return None
        everyone = _every_process(workers, idle, idle_nodes)
        for index, _ in [*idle, *(spare for _, spares in idle_nodes for spare in spares)]:
            self._channel.set(spare_key(index), json.dumps(None))  # the spares leave
        self._stop(everyone, grace_s=0.0 if late else self.preempt_grace_s)
        if finished == set(workers):
            return 0  # the job was done before the preemption reached it
        missing = sorted(set(workers) - preempted - finished)
        if missing:
            log.error("supervisor: rank(s) %s did not stop on the preemption within %g s "
                      "(killed); the job ends with %d", missing, self.preempt_grace_s,
                      128 + signal.SIGTERM)
            return 128 + int(signal.SIGTERM)
        log.warning("supervisor: every rank stopped on the preemption (exit code %d; %s)",
                    EXIT_PREEMPTED, self._restart_note())
        return EXIT_PREEMPTED

    def _start_all(self, base: dict[str, str], master_port: int,
                   workers: dict[int, WorkerProcess], idle: list[tuple[int, WorkerProcess]],
                   idle_nodes: list[tuple[int, list[tuple[int, WorkerProcess]]]]) -> None:
        """Start the workers, the warm spares and the spare nodes' spares here."""
        for rank in range(self.world_size):
            workers[rank] = self._start(base, rank, 0, None, master_port)
        spare_env = {**base, "MASTER_PORT": str(master_port)}
        for index in range(self.spares):
            idle.append((index, self._launch({**spare_env, ENV_SPARE: str(index)})))
        per_node = self.ranks_per_node or 1
        for node in range(self.spare_nodes):
            first = self.spares + node * per_node
            idle_nodes.append((node, [
                (index, self._launch({**spare_env, ENV_SPARE: str(index)}))
                for index in range(first, first + per_node)]))

    def _shape_from_tasks(self, store: TCPStore) -> int | None:
        """With a launcher's tasks: take the job's shape from task 0 unless given, check it
        against the tasks started and answer the tasks (``job/ready``); the job's exit code
        when it cannot start (``EXIT_CONFIG``: the shape does not fit, the tasks told
        why; 1: no shape came), else None."""
        channel = self._channel
        if self.world_size == 0:
            try:
                shape = channel.wait(LAYOUT_KEY, self.startup_timeout_s)
            except TimeoutError:
                log.error("supervisor: task 0 sent no job shape within %g s: were the tasks "
                          "started with MOE_STORE=%s:%d, and does their script join the job "
                          "(SparseCheckpointing, or the recipe)? Or give --workers",
                          self.startup_timeout_s, self.store_host, store.port)
                return 1
        try:
            if self.world_size == 0:
                layout = JobLayout(**json.loads(shape))
                self.world_size, self.spares = layout.world_size, layout.spares
                self.spare_nodes, self.timeout_s = layout.spare_nodes, layout.timeout_s
                self.max_restarts = layout.max_restarts
                self.preempt_grace_s = layout.preempt_grace_s
                self.durable_dir = layout.durable_dir
                self._check_shape()
        except ValueError as error:
            channel.set(READY_KEY, json.dumps({"error": f"supervisor: {error}"}))
            log.error("supervisor: %s; the job stops", error)
            return EXIT_CONFIG
        channel.set(READY_KEY, json.dumps({"world_size": self.world_size,
                                         "ranks_per_node": self.ranks_per_node}))
        return None

    def _attach_tasks(self, store: TCPStore, workers: dict[int, WorkerProcess],
                      idle: list[tuple[int, WorkerProcess]],
                      idle_nodes: list[tuple[int, list[tuple[int, WorkerProcess]]]]) -> None:
        """Take the launcher's tasks (``JobLayout``'s order) as they register."""
        deadline = time.monotonic() + self.startup_timeout_s

        def task(index: int) -> TaskProcess:
            process = TaskProcess(self._channel, index, max(0.0, deadline - time.monotonic()))
            self._tasks.append(process)
            return process

        for rank in range(self.world_size):
            workers[rank] = task(rank)
        per_node = self.ranks_per_node or 1
        for node in range(self.spare_nodes):
            first = node * per_node
            idle_nodes.append((node, [(index, task(self.world_size + index))
                                      for index in range(first, first + per_node)]))
        first = self.spare_nodes * per_node
        idle.extend((index, task(self.world_size + index))
                    for index in range(first, first + self.spares))

    def _misplaced_tasks(self, workers: dict[int, WorkerProcess],
                         idle: list[tuple[int, WorkerProcess]],
                         idle_nodes: list[tuple[int, list[tuple[int, WorkerProcess]]]]
                         ) -> str | None:
        """Why the tasks' nodes are not the block layout the job assumes (task ``t`` on
        node ``t // ranks_per_node``), or None when they are (or no node size is known)."""
        per_node = self.ranks_per_node
        if per_node is None:
            return None
        tasks = {**workers,
                 **{self.world_size + index: p for index, p in idle},
                 **{self.world_size + index: p for _, node in idle_nodes for index, p in node}}
        wrong = [f"task {task} on node {p.node}" for task, p in sorted(tasks.items())
                 if isinstance(p, TaskProcess) and p.node != task // per_node]
        if not wrong:
            return None
        return (f"{', '.join(wrong)}: with {per_node} ranks per node task t must run on node "
                f"t // {per_node} (srun --distribution=block, the default), so that a node's "
                "ranks, and a spare node's tasks, are the node's own")

    def _spares_cover(self, failed: Mapping[int, str], idle: list[tuple[int, WorkerProcess]],
                      idle_nodes: list[tuple[int, list[tuple[int, WorkerProcess]]]]) -> bool:
        """Whether the live spares (whole spare nodes for whole lost nodes, single spares
        for the rest) can take every failed rank."""
        live = [spare for spare in idle if spare[1].poll() is None]
        nodes = [(node, spares) for node, spares in idle_nodes
                 if all(process.poll() is None for _, process in spares)]
        by_node = self._spare_nodes_for(failed, nodes)
        return len(failed) - len(by_node) <= len(live)

    def _training_finished(self, rank: int, pid: int) -> bool:
        """Whether process ``pid`` of ``rank`` reported the end of its training loop."""
        return self._channel.read(finished_key(rank, pid)) is not None

    @staticmethod
    def _after_training(failed: dict[int, str]) -> int:
        """The job's exit code once every worker ended: 1 when some failed after their
        training loop ended (while writing results, or at interpreter exit), else 0."""
        if not failed:
            return 0
        ranks = ", ".join(f"rank {r} ({why})" for r, why in sorted(failed.items()))
        log.error("supervisor: %s failed after training ended, so the results they write "
                  "may be missing; a worker that leaves with process groups alive can abort "
                  "at interpreter exit: end the training script with "
                  "torch.distributed.destroy_process_group()", ranks)
        return 1

    def _open_rendezvous(self, store: TCPStore, generation: int) -> TCPStore:
        """The store ``generation``'s default process group rendezvous on, its port
        published in the job store (kept open until the job ends)."""
        rendezvous = hosted_store(self.store_host, 0,
                                  timedelta(seconds=max(30.0, self.timeout_s)))
        self._channel.set(rendezvous_key(generation), str(rendezvous.port))
        return rendezvous

    def _start(self, base: dict[str, str], rank: int, generation: int,
               replaces: int | None, master_port: int) -> WorkerProcess:
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank),
               ENV_GENERATION: str(generation), "MASTER_PORT": str(master_port)}
        if replaces is not None:
            env[ENV_REPLACES] = str(replaces)
        return self._launch(env)

    def _launch(self, env: dict[str, str]) -> WorkerProcess:
        """A process running the command with ``env``: forked or a fresh interpreter."""
        if self._forker is not None:
            return self._forker.start(env)
        return subprocess.Popen(list(self.command), env=env)

    def _hung(self, store: TCPStore, rank: int, pid: int,
              beats: dict[int, tuple[int, float]], slack_s: float = 0.0) -> bool:
        """Whether ``rank``'s heartbeat has been still for the hang timeout (less
        ``slack_s``)."""
        if self._training_finished(rank, pid):
            return False  # its training is over: no more beats are due
        count = int(store.add(heartbeat_key(rank, pid), 0))
        last, since = beats[rank]
        now = time.monotonic()
        if count != last:
            beats[rank] = (count, now)
            return False
        # Before its first beat a worker is still starting (imports, data): not hung yet.
        return count > 0 and now - since > self.timeout_s - slack_s

    def _await_node_losses(self, workers: dict[int, WorkerProcess], done: set[int],
                           failed: dict[int, str], store: TCPStore,
                           beats: dict[int, tuple[int, float]]) -> None:
        """Wait up to ``NODE_LOSS_S`` for the other ranks of every node a failure struck,
        adding those that fail to ``failed``: the processes of a lost machine are seen to
        exit one by one, and the ranks of a hung machine stop beating a moment apart
        (a peer still for all but ``NODE_HANG_SLACK_S`` of the hang timeout counts as
        hung with it, and is killed). So they open one generation (one recovery), and a
        spare node, which takes over only a node whose ranks all failed, can take it."""
        per_node = self.ranks_per_node
        assert per_node is not None
        hung_node = "hang" in failed.values()
        deadline = time.monotonic() + NODE_LOSS_S
        while True:
            waiting = [rank for node in {r // per_node for r in failed}
                       for rank in range(node * per_node, (node + 1) * per_node)
                       if rank not in failed and rank not in done]
            if not waiting or time.monotonic() > deadline:
                return
            for rank in waiting:
                process = workers[rank]
                code = process.poll()
                if code is not None and code != 0:
                    failed[rank] = f"exit {code}"
                elif code is None and hung_node and self._hung(
                        store, rank, process.pid, beats, slack_s=NODE_HANG_SLACK_S):
                    process.kill()
                    process.wait()
                    failed[rank] = "hang"
            time.sleep(POLL_S)

    def _spare_nodes_for(self, failed: Mapping[int, str],
                         idle_nodes: list[tuple[int, list[tuple[int, WorkerProcess]]]]
                         ) -> dict[int, tuple[int, tuple[int, WorkerProcess]]]:
        """For every node whose ranks all failed, while spare nodes are left: its ranks,
        each with the spare node (taken from ``idle_nodes``) and the spare taking it."""
        per_node = self.ranks_per_node
        taken: dict[int, tuple[int, tuple[int, WorkerProcess]]] = {}
        if per_node is None:
            return taken
        for node in sorted({rank // per_node for rank in failed}):
            ranks = range(node * per_node, (node + 1) * per_node)
            if idle_nodes and all(rank in failed for rank in ranks):
                spare_node, spares = idle_nodes.pop(0)
                taken.update({rank: (spare_node, spare) for rank, spare in zip(ranks, spares,
                                                                                strict=True)})
        return taken

    def _publish(self, store: TCPStore, workers: dict[int, WorkerProcess],
                 idle: list[tuple[int, WorkerProcess]],
                 idle_nodes: list[tuple[int, list[tuple[int, WorkerProcess]]]]) -> None:
        """The live view, to ``status_path`` and to the store (``status``)."""
        status = {"store": f"{self.store_host}:{store.port}", "supervisor": os.getpid(),
                  "ranks": {str(rank): process.pid for rank, process in workers.items()},
                  "ranks_per_node": self.ranks_per_node,
                  "idle_spares": [process.pid for _, process in idle],
                  "idle_spare_nodes": {str(node): [process.pid for _, process in spares]
                                       for node, spares in idle_nodes},
                  "replacements": report_of(self.replacements),
                  "worker_pids": {str(rank): pids for rank, pids in self.pids.items()},
                  "spare_pids": self.spare_pids, "spare_node_pids": self.spare_node_pids}
        store.set(STATUS_KEY, json.dumps(status))
        if self.status_path is None:
            return
        partial = self.status_path.with_suffix(".tmp")
        partial.write_text(json.dumps(status))
        partial.replace(self.status_path)  # readers never see half a file

    @staticmethod
    def _stop(workers: dict[int, WorkerProcess], grace_s: float = 0.0) -> None:
        """End ``workers`` (by pid), giving them ``grace_s`` to exit on their own. Every
        one is killed before any is waited for, even when watching them fails (a lost
        fork server): nothing is left running."""
        deadline = time.monotonic() + grace_s
        try:
            while (time.monotonic() < deadline
                   and any(p.poll() is None for p in workers.values())):
                time.sleep(POLL_S)
        finally:
            for process in workers.values():
                process.kill()  # does nothing to one that has ended
            for process in workers.values():
                process.wait()


@dataclass
class _SigtermWatch:
    """Which ranks received a SIGTERM (each worker reports it to the store), and whether
    that is a preemption of the job (every live rank within ``SIGTERM_DECIDE_S``) or the
    failure of the ranks it reached alone."""

    seen: int = 0  # reports read so far
    since: dict[tuple[int, int], float] = field(default_factory=dict)  # (rank, pid) -> when
    handled: set[tuple[int, int]] = field(default_factory=set)

    def poll(self, channel: ControlChannel, workers: Mapping[int, WorkerProcess],
             done: set[int]) -> tuple[list[int], bool]:
        """Read new reports: the ranks whose lone SIGTERM is now their failure, and whether
        every live rank received one (the job is preempted)."""
        count = int(channel.store.add(SIGTERMS_KEY, 0))
        if count != self.seen:
            self.seen = count
            now = time.monotonic()
            for rank, process in workers.items():
                key = (rank, process.pid)
                if key not in self.since and channel.read(sigterm_key(*key)) is not None:
                    self.since[key] = now
        live = {(rank, p.pid) for rank, p in workers.items() if rank not in done}
        pending = {key: t for key, t in self.since.items()
                   if key not in self.handled and key in live}
        if not pending:
            return [], False
        if live <= set(pending):
            self.handled.update(pending)
            return [], True
        lone = [key for key, t in pending.items() if time.monotonic() - t > SIGTERM_DECIDE_S]
        self.handled.update(lone)
        for rank, pid in lone:
            log.warning("supervisor: rank %d (pid %d) alone received a SIGTERM (the job was "
                        "not preempted): it is killed and replaced as a failed rank", rank, pid)
        return [rank for rank, _ in lone], False


def _every_process(workers: dict[int, WorkerProcess], idle: list[tuple[int, WorkerProcess]],
                   idle_nodes: Sequence[tuple[int, list[tuple[int, WorkerProcess]]]] = ()
                   ) -> dict[int, WorkerProcess]:
    """The workers by rank and the idle spares, those of spare nodes too (under negative
    keys), to stop them all."""
    spares = [*idle, *(spare for _, node in idle_nodes for spare in node)]
    return {**workers, **{-1 - index: process for index, process in spares}}


def report_of(replacements: Sequence[Replacement]) -> list[dict[str, Any]]:
    """JSON-ready replacements (for ``metrics.json``)."""
    return [vars(r) for r in replacements]


def external_launcher(environ: Mapping[str, str] | None = None) -> str | None:
    """The launcher that started this process as one of several ranks (``torchrun``,
    ``srun``, ``mpirun``, or another that set ``RANK`` and ``WORLD_SIZE``), or None when
    this process runs alone or under this supervisor. The supervisor starts the workers
    itself: under another launcher every process would start a whole job of its own."""
    env = os.environ if environ is None else environ
    if ENV_STORE in env:
        return None  # a worker of this supervisor
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun (TORCHELASTIC_RUN_ID is set)"
    for key, name in (("SLURM_NTASKS", "srun"), ("OMPI_COMM_WORLD_SIZE", "mpirun"),
                      ("PMI_SIZE", "mpirun"), ("WORLD_SIZE", "a launcher")):
        value = env.get(key, "1")
        if value.isdigit() and int(value) > 1:
            return f"{name} ({key}={value})"
    return None


def _host_of(process: WorkerProcess) -> str:
    """The host a worker process runs on (a launcher's task says; the others run here)."""
    host = process.host if isinstance(process, TaskProcess) else None
    return host or socket.gethostname()
