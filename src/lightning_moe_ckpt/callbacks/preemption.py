"""Preemption: a SIGTERM to the job commits one more durable checkpoint, then training stops.

SLURM preempts (or ends a job at its time limit) with SIGTERM to every process and SIGKILL
after a grace. Lightning's own SIGTERM handler broadcasts from inside the signal handler,
which under a collective already in flight times out or mismatches. In a training process
:class:`Preemption` replaces it (from ``on_train_start``) with a handler that only sets a
flag, and the stop is agreed at a batch boundary, where it is safe:

* under the supervisor, the worker's heartbeat thread reports the SIGTERM; the supervisor
  decides: a SIGTERM to the job (to itself, or to every rank) is a preemption, and it
  tells every rank through the store; a SIGTERM to some ranks alone is their failure
  (killed and replaced like a kill);
* without it, this process's SIGTERM is the job's (rank 0's decides, as in Lightning).

At the end of the batch during which the job was preempted, rank 0 raises Lightning's stop
flag, and Lightning stops it there with ``SIGTERMException``; rank 0 then makes the
per-batch broadcast of that flag the other ranks wait in at the start of their next batch
(Lightning's own protocol, which it runs every batch anyway), which stops them before they
run it: every rank stops at the same step, with no collective added to training.
:class:`~lightning_moe_ckpt.callbacks.SparseCheckpointing` then takes a durable checkpoint
of that step on every rank (collective) and waits, at most ``grace_s``, for its write;
the exception ends ``fit``, and a supervised worker exits with ``EXIT_PREEMPTED``. Started
again, the job resumes from that checkpoint.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_moe_ckpt.failures.rendezvous import JobStore
from lightning_moe_ckpt.targets.lightning import request_stop, stop_peers

__all__ = ["Preemption", "SIGTERMException"]

log = logging.getLogger("lightning_moe_ckpt")


class Preemption:
    """This training process's SIGTERM handling (module docstring).

    Args:
        job: The supervised job's handle (``None``: not supervised).
        grace_s: How long the preempted rank waits for its checkpoint's commit.
    """

    def __init__(self, job: JobStore | None, grace_s: float) -> None:
        self.job = job
        self.grace_s = grace_s
        self.received = False  # this process received a SIGTERM
        self.stopping = False  # the stop was requested of the Trainer
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        """Take SIGTERM over from Lightning's handler (main thread only)."""
        if threading.current_thread() is not threading.main_thread() or self._installed:
            return
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True

    def uninstall(self) -> None:
        """Give SIGTERM back to the handler that was there before."""
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.received = True  # a flag only: nothing here may block or communicate
        if self.job is not None:
            self.job.note_sigterm()

    @property
    def requested(self) -> bool:
        """Whether the job is preempted, as far as this process knows."""
        return self.job.preempt_requested if self.job is not None else self.received

    def at_batch_end(self, trainer: L.Trainer) -> None:
        """After a batch: once preempted, rank 0 asks the Trainer to stop at the end of
        this batch (the others stop at the start of their next, see :meth:`on_stopped`)."""
        if self.stopping or not self.requested:
            return
        self.stopping = True
        if trainer.global_rank == 0:
            log.warning("preempted (SIGTERM) after step %d: every rank takes a durable "
                        "checkpoint of this step and stops", trainer.global_step)
            request_stop(trainer)

    def on_stopped(self, trainer: L.Trainer) -> None:
        """Training stopped with ``SIGTERMException`` on this rank: rank 0, which stopped
        at its batch's end, releases the others from the broadcast they wait in (they stop
        there, at the same step)."""
        if trainer.global_rank == 0 and self.stopping and trainer.world_size > 1:
            stop_peers(trainer)
