"""``FailureInjector``: fail ranks at scheduled steps and recover, for tests and benchmarks.

Before iteration ``t`` runs, the injector asks its schedule (``at``, ``mtbf`` or ``trace``,
see :mod:`lightning_moe_ckpt.testing.faults`) for failures at ``t``. Every rank knows the
schedule, so all of them enter recovery together: the failed ranks' state is destroyed as a
dead worker's would be (weights garbage, master weights and optimizer state gone, host
snapshots, logs and held replicas dropped). With upstream logging and one stage per
pipeline rank only the failed stages roll back, replaying from their neighbours' logs while
the other ranks pause (localized rollback); otherwise every rank rolls back to the common
persisted window (global rollback); a single process recovers from its own host store.
The baseline policies recover their own way (:mod:`~lightning_moe_ckpt.recovery.baselines`):
``gemini`` and ``checkfreq`` roll every rank back to their last dense checkpoint, ``moc``
and ``moetion`` restore their partial state (stale experts) and report the lost tokens.
The injector is one client of :func:`~lightning_moe_ckpt.recovery.api.recover`: it
destroys what the failed ranks lose, then every rank enters the same recovery a real
failure detector would. Iteration ``t`` then runs as if nothing happened. The injector
counts what it fired and records a report per recovery (window, iterations replayed,
ranks, phase timings).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
from typing_extensions import override

from lightning_moe_ckpt.callbacks.sparse_checkpointing import SparseCheckpointing
from lightning_moe_ckpt.core.collectives import all_gather_values
from lightning_moe_ckpt.core.files import WriteFault, add_write_fault, remove_write_fault
from lightning_moe_ckpt.core.target import StepHooks, StepResult, TrainingTarget
from lightning_moe_ckpt.errors import ConfigError, InjectedFailure
from lightning_moe_ckpt.failures.protocol import is_replacement
from lightning_moe_ckpt.recovery.api import RecoveryRequest, recover
from lightning_moe_ckpt.recovery.baselines import is_baseline
from lightning_moe_ckpt.recovery.sparse_to_dense import Cascade, RecoveryReport
from lightning_moe_ckpt.testing.faults import (
    FailureCounter,
    FailureEvent,
    FaultSchedule,
    check_reachable,
    destroy_rank_state,
    parse_event,
)

# Recovery phases in the order they happen ("convert_load": loading the window's first
# snapshot; "convert": replaying the window with frozen operators).
PHASE_ORDER = ("detect", "fetch", "convert_load", "convert", "replay", "resume", "total")


def _read_struck(path: Path | None) -> frozenset[FailureEvent]:
    """The real faults an earlier run of the job recorded at ``path`` (none: no file)."""
    if path is None or not path.exists():
        return frozenset()
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return frozenset(parse_event(row, f"{path} line {index + 1}")
                     for index, row in enumerate(rows))


def _disk_full(directories: list[Path]) -> WriteFault:
    """A write fault: every file under ``directories`` fails with ENOSPC."""
    roots = [d.resolve() for d in directories]

    def fault(path: Path, written: int) -> None:
        if any(path.resolve().is_relative_to(root) for root in roots):
            raise OSError(errno.ENOSPC, "No space left on device (injected: faults kind "
                          "disk_full)", str(path))
    return fault


def _kill_mid_durable_write(path: Path, written: int) -> None:
    """SIGKILL this process once part of a durable checkpoint's file is written."""
    if written > 0 and any(p.name.startswith("step=") and p.name.endswith(".ckpt")
                           for p in (path, path.parent)):
        os.kill(os.getpid(), signal.SIGKILL)


def fail_for_real(event: FailureEvent, checkpoint_dirs: Sequence[Path] = ()
                  ) -> WriteFault | None:
    """Do to this process what a real failure of ``event.kind`` does (``disk_full``: to
    the files under ``checkpoint_dirs``); the write fault installed, if it is one."""
    fault: WriteFault | None = None
    if event.kind == "disk_full":
        fault = _disk_full(list(checkpoint_dirs))
    elif event.phase == "durable_write":  # kind kill: in the middle of a durable write
        fault = _kill_mid_durable_write
    if fault is not None:
        add_write_fault(fault)
        return fault
    if event.kind == "sigterm":  # its handler notes it; the supervisor decides
        os.kill(os.getpid(), signal.SIGTERM)
    elif event.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif event.kind == "exit":
        os._exit(1)
    elif event.kind == "exception":
        raise InjectedFailure(f"injected exception on rank {event.rank} at step {event.step}")
    elif event.kind == "hang":
        while True:  # no progress, no heartbeat: the supervisor kills it after its timeout
            time.sleep(3600)
    return None


class FailureInjector(L.Callback, StepHooks):
    """Injects the failures of ``schedule`` and recovers through ``checkpointing``.

    Place it after ``checkpointing`` in the Trainer's callbacks.

    Args:
        schedule: When and where ranks fail: an :class:`~.faults.AtSchedule`,
            :class:`~.faults.MtbfSchedule`, :class:`~.faults.TraceSchedule` or
            :class:`~.faults.NoFaults`.
        checkpointing: The callback recovery goes through; it must be among the Trainer's
            callbacks.
        struck_log: A file (JSON lines) where real faults are recorded as they strike;
            those it already holds, from an earlier run of the same job that one of them
            ended, do not strike again (a job resumed from its durable checkpoint meets
            them no more, as a real failure would not recur). ``None``: no record.

    Raises:
        TypeError: ``checkpointing`` is not a :class:`SparseCheckpointing`.
    """

    def __init__(self, schedule: FaultSchedule, checkpointing: SparseCheckpointing,
                 struck_log: str | Path | None = None) -> None:
        if not isinstance(checkpointing, SparseCheckpointing):
            raise TypeError("FailureInjector recovers through the SparseCheckpointing callback "
                            f"it is given, not {checkpointing!r}")
        self.schedule = schedule
        # Real faults are recorded here as they strike, and those already recorded (an
        # earlier run of the same job, which one of them ended) strike no more: a run
        # resumed from a durable checkpoint does not meet them again, as a real failure
        # would not recur.
        self.struck_log = None if struck_log is None else Path(struck_log)
        self.struck = _read_struck(self.struck_log)
        self.checkpointing = checkpointing
        self.counter = FailureCounter()
        self.recoveries: list[dict[str, Any]] = []
        self.target: TrainingTarget | None = None
        self.rank, self.world_size = 0, 1
        self.trainer: L.Trainer | None = None  # loads durable checkpoints when set
        # Real faults fire from this step on (a replacement joins after its rank's fault;
        # None while it does not know yet where it joins: none fires).
        self.real_from: int | None = 0
        # Scheduled failures before the step a resumed run starts at (they never fire).
        self.failures_before_resume = 0
        self.write_faults: list[WriteFault] = []  # installed by disk_full, durable_write

    def attach(self, target: TrainingTarget, rank: int = 0, world_size: int = 1) -> None:
        """Start injecting into ``target`` (attach ``checkpointing`` first)."""
        if self.checkpointing.coordinator is None:
            raise RuntimeError("attach SparseCheckpointing before FailureInjector")
        if self.target is target:
            return
        self.target = target
        self.rank, self.world_size = rank, world_size
        # Ahead of the checkpoint's own hook: a real fault in phase "snapshot_copy" strikes
        # between the optimizer step and the snapshot of it.
        target.hooks.insert(target.hooks.index(self.checkpointing.coordinator), self)
        handler = self.checkpointing.peer_failures
        if handler is not None:  # real failures of peers are recovered on this rank
            handler.recovery_started = self.fail_during_recovery
            if handler.job.replaces is not None:  # this rank's own fault is behind it
                self.real_from = target.step + 1
        replicator = self.checkpointing.coordinator.replicator
        if replicator is not None:  # real faults in phase "replication" strike from there
            replicator.before_payload = self._fail_while_replicating

    @override
    def before_iteration(self, step: int) -> None:
        coordinator = self.checkpointing.coordinator
        assert coordinator is not None  # attach() checked it
        # A failure during the copy (or replication) of SS_step strikes while iteration
        # step + 1 runs: that copy never completes on the failed rank.
        if any(event.rank == self.rank and event.phase in ("snapshot_copy", "replication")
               for event in self.schedule.events_at(step + 1)):
            coordinator.capture.interrupt_copy(step)
        events = self.schedule.events_at(step)
        for event in events:
            if (event.real and event.rank == self.rank and self._real_at(step)
                    and event.phase not in ("replication", "recovery")
                    and not (event.phase == "snapshot_copy" and step > 0)):
                self._strike(event)
        events = [event for event in events if not event.real]  # nobody else reads those
        if not events:
            return
        detected = time.perf_counter()
        # Failures in phase "recovery" strike while the recovery from the others runs
        # (alone at a step, they are ordinary failures).
        first = [e for e in events if e.phase != "recovery"]
        cascading = [e for e in events if e.phase == "recovery"] if first else []
        failed = sorted({event.rank for event in first or events})
        for event in events:
            self.counter.record(event)
        # Copies already issued complete first: a dead worker's in-flight copy never
        # finishes with post-failure data (destroying the weights under a running copy
        # would put garbage into a snapshot).
        coordinator.capture.wait_copies()
        coordinator.capture.interrupted_steps.clear()  # the interrupted copy is done
        if self.rank in failed:
            self._destroy()
        cascade = None
        if cascading:
            ranks = tuple(sorted({e.rank for e in cascading}))
            cascade = Cascade(ranks, self._fail_if_among(ranks))
            if self.world_size == 1 or is_baseline(coordinator.planner):
                # One process, or a baseline that restarts everyone from its checkpoint:
                # the later failure only adds to what is lost before the recovery.
                cascade.fail()
                failed = sorted(set(failed) | set(cascade.ranks))
                cascade = None
        recovering = time.perf_counter()  # failure handled, state lost: recovery begins
        outcome = recover(RecoveryRequest(step, tuple(failed), cascade), coordinator,
                          self.checkpointing.upstream_log,
                          self.checkpointing.durable.source(self.trainer))
        summary = self._agree_on_summary(outcome.report)
        timings = {"detect": recovering - detected, **summary["timings_s"],
                   "total": time.perf_counter() - detected}
        order = [*PHASE_ORDER[:-1], *sorted(set(timings) - set(PHASE_ORDER)), "total"]
        summary["timings_s"] = {phase: timings[phase] for phase in order if phase in timings}
        self.recoveries.append({
            "failed_step": step, "failed_ranks": sorted({e.rank for e in events}),
            "cascading_ranks": [] if cascade is None else list(cascade.ranks),
            "recovery_rounds": summary["rounds"],
            "failed_phases": sorted({event.phase for event in events}),
            "window_start": summary["window_start"], "window": summary["window"],
            "iterations_replayed": summary["replayed"],
            "ranks_rolled_back": outcome.rolled_back, "lost_tokens": summary["lost_tokens"],
            "lost_token_portion": summary["lost_token_portion"],
            "stale_experts": summary["stale_experts"],
            "timings_s": summary["timings_s"],
        })

    @override
    def after_optimizer_step(self, step: int, result: StepResult) -> None:
        """A real fault in phase ``snapshot_copy`` at step ``s`` strikes right after
        optimizer step ``s - 1``, before SS_(s-1) is taken (the copy a simulated one
        interrupts): the peers may be inside the checkpoint's own collectives then."""
        for event in self.schedule.events_at(step + 1):
            if (event.real and event.rank == self.rank and event.phase == "snapshot_copy"
                    and self._real_at(step + 1)):
                self._strike(event)

    def fail_during_recovery(self, failed_step: int) -> None:
        """A real fault in phase ``recovery`` at step ``s`` strikes while this rank (a
        survivor) recovers from another failure at ``s``, before its state is touched."""
        for event in self.schedule.events_at(failed_step):
            if event.real and event.rank == self.rank and event.phase == "recovery":
                self._strike(event)

    def _fail_while_replicating(self, snapshot_step: int) -> None:
        """A real fault in phase ``replication`` at step ``s`` strikes while SS_(s-1) is
        sent to the peers (as a simulated one, it strikes while iteration s runs)."""
        for event in self.schedule.events_at(snapshot_step + 1):
            if (event.real and event.rank == self.rank and event.phase == "replication"
                    and self._real_at(snapshot_step + 1)):
                self._strike(event)

    def _note_resumed_past(self, start_step: int) -> None:
        """A run resumed at ``start_step`` (``ckpt_path``) continues its schedule there:
        the failures before it belonged to the run that wrote the checkpoint. They are
        counted in the metrics and named in a warning, so a resumed test whose failures
        all lie behind it does not pass for one that recovered."""
        past = [event for event in self.schedule.events if event.step < start_step]
        self.failures_before_resume = len(past)
        if past and self.rank == 0:
            warnings.warn(f"FailureInjector: training resumes at step {start_step}, so "
                          f"{len(past)} scheduled failure(s) before it (the first at step "
                          f"{past[0].step}) do not fire in this run; the failures from step "
                          f"{start_step} on do", stacklevel=2)

    def _real_at(self, step: int) -> bool:
        """Whether this rank's real faults at ``step`` may still fire."""
        return self.real_from is not None and step >= self.real_from

    def _strike(self, event: FailureEvent) -> None:
        """Fail for real as ``event`` says, recorded first (unless an earlier run of the
        job recorded it: then it struck already)."""
        if event in self.struck:
            return
        self.counter.record(event)
        if event.kind == "disk_full":  # the disk fills at this step: earlier writes ended
            self.checkpointing.durable.drain()
            coordinator = self.checkpointing.coordinator
            if coordinator is not None and coordinator.disk is not None:
                coordinator.disk.drain()
        if self.struck_log is not None:
            row = json.dumps({"step": event.step, "rank": event.rank, "phase": event.phase,
                              "kind": event.kind})
            with self.struck_log.open("a") as log:  # one short append: whole even if racing
                log.write(row + "\n")
                log.flush()
                os.fsync(log.fileno())
        fault = fail_for_real(event, self._checkpoint_dirs())
        if fault is not None:  # the process trains on with it: removed when training ends
            self.write_faults.append(fault)

    def _checkpoint_dirs(self) -> list[Path]:
        """Where this rank's checkpoints go: the durable directory, CheckFreq's."""
        dirs = [] if self.checkpointing.durable.directory is None else [
            Path(self.checkpointing.durable.directory)]
        coordinator = self.checkpointing.coordinator
        if coordinator is not None and coordinator.disk is not None:
            dirs.append(coordinator.disk.directory)
        return dirs

    def _destroy(self) -> None:
        """What this rank's worker loses when it fails."""
        assert self.target is not None
        log = self.checkpointing.upstream_log
        destroy_rank_state(self.target.model, self.target.optimizer,
                           [log.drop] if log is not None else [])

    def _fail_if_among(self, ranks: tuple[int, ...]) -> Callable[[], None]:
        def fail() -> None:
            if self.rank in ranks:
                self._destroy()
        return fail

    def _agree_on_summary(self, report: RecoveryReport | None) -> dict[str, Any]:
        """Paused ranks have no report of their own: take one from a scope rank."""
        mine = None if report is None else {
            "window_start": report.window_start, "window": report.window,
            "replayed": report.replayed, "rounds": report.rounds,
            "timings_s": dict(report.phases_s), "lost_tokens": report.lost_tokens,
            "lost_token_portion": report.lost_token_portion,
            "stale_experts": list(report.stale_experts)}
        if self.world_size == 1:
            assert mine is not None
            return mine
        everyone: list[Any] = all_gather_values(mine)
        return next(s for s in everyone if s is not None)

    def metrics(self) -> dict[str, Any]:
        """Failure and recovery figures for ``metrics.json``."""
        return {"failures_injected": self.counter.total, "failures": self.counter.as_dict(),
                "failures_before_resume": self.failures_before_resume,
                "recoveries": self.recoveries,
                "iterations_replayed": sum(r["iterations_replayed"] for r in self.recoveries),
                "lost_tokens": sum(r["lost_tokens"] for r in self.recoveries)}

    def report(self) -> str:
        """A short human-readable report."""
        lines = [f"failures injected: {self.counter.total}"]
        for r in self.recoveries:
            timing = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in r["timings_s"].items())
            if r["cascading_ranks"]:
                timing += (f"; ranks {r['cascading_ranks']} failed during the recovery, "
                           f"{r['recovery_rounds']} rounds")
            lines.append(
                f"  step {r['failed_step']}: ranks {r['failed_ranks']} failed; rolled back "
                f"{len(r['ranks_rolled_back'])} ranks to window {r['window_start']} "
                f"(W={r['window']}), replayed {r['iterations_replayed']} iterations, lost "
                f"tokens {r['lost_tokens']}; {timing}")
        return "\n".join(lines)

    def remove_write_faults(self) -> None:
        """Stop the write faults this injector installed (a full disk emptied)."""
        for fault in self.write_faults:
            remove_write_fault(fault)
        self.write_faults.clear()

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.remove_write_faults()

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.trainer = trainer
        # Trainer.callbacks is set by Lightning's callback connector (untyped there).
        if self.checkpointing not in trainer.callbacks:  # type: ignore[attr-defined]
            raise ConfigError("FailureInjector's SparseCheckpointing is not among the Trainer's "
                              "callbacks: add it too (callbacks=[checkpointing, injector])")
        if self.checkpointing.target is None:  # callbacks listed in the other order
            self.checkpointing.on_train_start(trainer, pl_module)
        assert self.checkpointing.target is not None
        check_reachable(self.schedule, world_size=trainer.world_size,
                        max_steps=trainer.max_steps if trainer.max_steps >= 0 else None,
                        where="FailureInjector")
        if not is_replacement():  # a replacement's earlier failures were its job's
            self._note_resumed_past(trainer.global_step)
        self.attach(self.checkpointing.target, trainer.global_rank, trainer.world_size)
