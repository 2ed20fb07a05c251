"""Real failures, survivor and replacement side: detect, re-form the groups, recover.

A survivor learns that a peer died or hung from what it sees: a collective or P2P error in
its iteration, or a new generation in the supervisor's store at the start of an iteration
(a hung peer is killed by the supervisor, which then opens the generation). It then

1. lets its own issued snapshot copies finish and drops the iteration's partial gradients;
2. tears down the broken process groups and forms the new generation's default group on
   the store prefix ``gen<g>/``, then rebuilds the mesh, the pipeline, expert-parallel and
   replication groups over its live model, optimizer, host snapshots, held replicas and
   upstream logs (nothing of its state is lost, its process keeps running);
3. agrees with everyone on the iteration to resume (the oldest step among survivors; a
   survivor that got further is *ahead*: it rolls back with its stage, from its own host
   snapshots, which it kept) and enters the one
   :func:`~lightning_moe_ckpt.recovery.api.recover`, exactly as for an injected
   failure: localized rollback of the failed stage when upstream logs exist.

A replacement process (started by the supervisor with the failed rank's identity and an
empty state) forms the same generation, builds the same groups in the same order and
joins the recovery as the failed rank: its window comes from its replica peers.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from typing_extensions import override

from lightning_moe_ckpt.checkpointing.coordinator import CheckpointCoordinator
from lightning_moe_ckpt.core.collectives import all_gather_values
from lightning_moe_ckpt.core.progress import RECOVERY
from lightning_moe_ckpt.core.target import StepHooks, TrainingTarget
from lightning_moe_ckpt.failures.rendezvous import JobStore
from lightning_moe_ckpt.recovery.api import RecoveryOutcome, RecoveryRequest, recover
from lightning_moe_ckpt.recovery.durable import DurableSource, NoUsableCheckpointError
from lightning_moe_ckpt.recovery.upstream_log import UpstreamLog

log = logging.getLogger("lightning_moe_ckpt")

# Rebuild the mesh, the executor's and the replication groups over the live state, in the
# order a joining process builds them (collective).
Reform = Callable[[], None]
WarmUp = Callable[[], None]  # a collective first pass through the rebuilt pipeline


@dataclass
class PeerFailureHandler(StepHooks):
    """Turns a peer's real failure into a re-formed job and a recovery on this rank."""

    job: JobStore
    target: TrainingTarget
    coordinator: CheckpointCoordinator
    reform_groups: Reform
    warm_up: WarmUp
    backend: str
    upstream_log: UpstreamLog | None = None
    durable: DurableSource | None = None
    # Called once the iteration to recover is agreed, before the state is touched: where
    # a real fault "during a recovery" strikes (the failure injector sets it).
    recovery_started: Callable[[int], None] = lambda failed_step: None
    # Drops this rank's references to the broken process groups before the rendezvous: a
    # gloo group's connections close only once nothing references it (neither
    # destroy_process_group nor abort() closes them), and a survivor blocked on this rank,
    # in a pipeline receive say, learns of the failure only then instead of a collective
    # timeout (recovery.timeout_s / 3) later.
    release_groups: Callable[[], None] = lambda: None
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    # When the current iteration started (perf_counter): a recovery's "detect" time runs
    # from there, so a survivor that waited out a collective timeout shows it.
    iteration_started: float | None = None

    @override
    def before_iteration(self, step: int) -> None:
        self.iteration_started = time.perf_counter()
        self.job.heartbeat()
        if self.job.newer_generation_seen():
            self.recover_now()

    @override
    def iteration_failed(self, step: int, error: BaseException) -> bool:
        # A peer's failure shows up as a new generation once the supervisor saw it.
        if not self.job.await_new_generation():
            return False  # no peer failed: this error is the process's own
        # The failed iteration's frames (the whole chain's) hold the broken groups'
        # pending operations and the pipeline stage.
        chain: list[BaseException] = []
        cause: BaseException | None = error
        while cause is not None and cause not in chain:
            chain.append(cause)
            traceback.clear_frames(cause.__traceback__)
            cause = cause.__cause__ or cause.__context__
        self.recover_now()
        return True

    def recover_now(self) -> None:
        """Re-form the groups under the newest generation and recover (survivor side)."""
        self._recover(replacing=False)

    def join_as_replacement(self) -> None:
        """A replacement's first act: the groups are formed (launch did it); recover the
        failed rank's state from its peers."""
        self._recover(replacing=True)

    def _recover(self, replacing: bool) -> None:
        detected = time.perf_counter()
        # A replacement detected nothing: it was started for the failure.
        detect = ({} if replacing or self.iteration_started is None
                  else {"detect": detected - self.iteration_started})
        with self.job.busy():
            role = "replacement" if replacing else "survivor"
            log.warning("rank %d (%s, pid %d): recovering from generation %d at step %d",
                        self.job.rank, role, os.getpid(), self.job.generation,
                        self.target.step)
            self.coordinator.wait_copies()  # issued copies finish (survivor)
            fetches = len(self.coordinator.window_fetches)
            self.target.optimizer.zero_grad()  # the aborted iteration's partial gradients
            attempt = _Attempt(None if replacing else self.target.step, set(),
                               formed=replacing)  # a replacement formed its groups at launch
            while True:
                try:
                    outcome, reformed = self._attempt(attempt)
                    break
                except NoUsableCheckpointError:
                    raise  # nothing to retry: no window and no durable checkpoint
                except (RuntimeError, TimeoutError) as error:
                    # Another peer failed during this recovery (its collectives broke, or
                    # the rendezvous waited in vain): go again in the generation the
                    # supervisor opens for it, with everything failed so far.
                    log.warning("rank %d: recovery interrupted (%s); waiting for the next "
                                "generation", self.job.rank, error)
                    if not self.job.await_new_generation():
                        raise
                    attempt.formed = False
                    attempt.rounds += 1
            report = outcome.report
            profiles: list[Any] = all_gather_values(self.coordinator.profile)
            known = next((p for p in profiles if p is not None), None)
            if known is None:  # a failure while warming up: a replacement starts afresh,
                self.coordinator.restart_profiling()  # so everyone does, together
            elif self.coordinator.profile is None:
                self.coordinator.adopt_profile(known)  # a replacement plans like the others
            # Forward/backward passes each paused rank ran during the recovery (must be 0).
            paused: list[Any] = all_gather_values(
                None if report is not None else self.coordinator.paused_forward_backward)
            self.recoveries.append({
                "generation": self.job.generation, "failed_step": attempt.step,
                "failed_ranks": sorted(attempt.failed), "ahead_ranks": sorted(attempt.ahead),
                "replacement": replacing,
                "attempts": attempt.rounds, "ranks_rolled_back": outcome.rolled_back,
                "iterations_replayed": None if report is None else report.replayed,
                # The failed ranks' windows, and the replica peers they came from.
                "windows_from": self.coordinator.window_fetches[fetches:],
                "paused_forward_backward": {str(rank): calls for rank, calls
                                            in enumerate(paused) if calls is not None},
                "timings_s": {**detect, "detect_reform": reformed - detected,
                              **({} if report is None else report.phases_s),
                              "total": time.perf_counter() - detected}})

    def _attempt(self, attempt: _Attempt) -> tuple[RecoveryOutcome, float]:
        """One try at the recovery in the newest generation (collective over the world)."""
        if not attempt.formed:
            self.coordinator.release_replication()
            self.release_groups()
            if dist.is_initialized():
                dist.destroy_process_group()
            gc.collect()  # what held them may be in reference cycles (frames, stages)
            self.job.join(self.job.current_generation(), self.backend)
            RECOVERY.mark()
            self.reform_groups()
            RECOVERY.mark()
        self.warm_up()  # in the order a fresh process reaches it: after all groups
        RECOVERY.mark()
        reformed = time.perf_counter()
        # Everyone says which iteration it recovers (None: a replacement, empty) and which
        # ranks it already knows failed or ahead, so a retry keeps them all in scope.
        views: list[Any] = all_gather_values((attempt.step, sorted(attempt.failed),
                                              sorted(attempt.ahead)))
        failed_step, failed, ahead = agree_on_failure(
            views, self.job.failed_ranks(self.job.generation))
        attempt.step, attempt.failed, attempt.ahead = failed_step, failed, ahead
        if self.target.step != failed_step:
            self.target.set_step(failed_step)
        self.recovery_started(failed_step)
        outcome = recover(RecoveryRequest(failed_step, tuple(sorted(failed)),
                                          ahead_ranks=tuple(sorted(ahead))),
                          self.coordinator, self.upstream_log, self.durable)
        return outcome, reformed


View = tuple[int | None, Sequence[int], Sequence[int]]


def agree_on_failure(views: Sequence[View],
                     known_failed: Iterable[int] = ()) -> tuple[int, set[int], set[int]]:
    """The iteration to recover and who failed or ran ahead, from every rank's view.

    A rank's view is (the step it stopped in, or ``None`` for a replacement with empty
    state; the ranks it knows failed; the ranks it knows ran ahead) from earlier tries of
    this recovery. The oldest step among the survivors is recovered. A survivor past it
    is *ahead*: its live state is newer than its peers', so it rolls back, but its host
    memory is intact and serves the recovery. A rank failed once stays failed; one ahead
    once stays ahead, since an interrupted try may have left its state half replayed.
    """
    steps = [step for step, _, _ in views]
    if all(step is None for step in steps):
        raise NoUsableCheckpointError(
            "every rank of the job failed before the recovery could complete (at once, "
            "or one during the recovery from another): no survivor holds live state, host "
            "snapshots or replicas to recover from (a durable checkpoint, "
            "checkpoint.durable_every with api=trainer, survives this)")
    failed_step = min(step for step in steps if step is not None)
    failed = {rank for rank, step in enumerate(steps) if step is None}
    failed |= {rank for _, known, _ in views for rank in known}
    failed |= set(known_failed)
    ahead = {rank for rank, step in enumerate(steps)
             if step is not None and step != failed_step}
    ahead |= {rank for _, _, known in views for rank in known}
    return failed_step, failed, ahead - failed


@dataclass
class _Attempt:
    """What a recovery interrupted by another failure keeps for its next try."""

    step: int | None  # the iteration being recovered (None: not known yet, a replacement)
    failed: set[int]  # every rank failed since the recovery began
    formed: bool  # the process groups of the current generation are formed already
    rounds: int = 1
    ahead: set[int] = field(default_factory=set)  # survivors that were past the failed step
