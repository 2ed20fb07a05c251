"""The comparison policies: a user's own periodic checkpointing, the real alternatives
MoEvement is compared with (the bench's ``--peers``).

* ``checkpoint=lightning``: every ``k`` steps the loop saves what a Trainer checkpoint
  holds (model, optimizer and LR-scheduler state, step, RNG) through Lightning's
  :class:`~lightning.pytorch.plugins.io.AsyncCheckpointIO` (the plugin of
  ``Trainer(plugins=[AsyncCheckpointIO()])``), one file per rank.
* ``checkpoint=dcp``: every ``k`` steps ``torch.distributed.checkpoint.async_save`` of the
  same state (torchtitan's choice), one checkpoint directory per step; as torchtitan does,
  a save first waits for the one before it to finish.

``k`` (``checkpoint.interval``) is an integer or is chosen the way users choose it, after
``warmup_iterations`` from the measured iteration time and the measured wall time of one
complete save (the step-0 save, waited for): ``cap``, the smallest ``k`` whose saves cost
at most ``max_overhead`` of the training time (CheckFreq's rule), or ``oracle``, the ``k``
with the best analytic ETTR at ``mtbf_steps`` (Gemini's oracle; defaults to
``faults.mtbf_steps``). Across ranks one ``k`` is chosen, from the slowest rank's figures.

A save that fails (a full disk) ends the job with its error, as ``AsyncCheckpointIO``
and torchtitan's checkpointer end it, at the latest where the loop next waits for the save.

Recovery is a user's: at a failure every in-flight save dies with the job, every rank loads
the newest checkpoint that completed on every rank (the initial state when none did) and
recomputes the lost steps, inside the interrupted iteration so the loop time holds it.
The restart of processes is not counted (it would only add to these policies' recovery).
"""

from __future__ import annotations

import copy
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from typing_extensions import override

from lightning_moe_ckpt.errors import ConfigError, fmt, is_number, require
from lightning_moe_ckpt.policies.checkfreq import checkfreq_interval
from lightning_moe_ckpt.policies.gemini import gemini_interval
from lightning_moe_ckpt.training.engine import TrainingEngine

COMPARISON_POLICIES = ("lightning", "dcp")
COMPARISON_OPTIONS = frozenset({"interval", "max_overhead", "mtbf_steps"})


class _CompletionIO(TorchCheckpointIO):
    """Lightning's torch checkpoint IO that records which files finished writing, and
    which failed with what (``AsyncCheckpointIO`` would raise a failure only at its next
    save or at teardown)."""

    def __init__(self) -> None:
        super().__init__()
        self.finished: set[str] = set()
        self.failed: dict[str, BaseException] = {}
        self._lock = threading.Lock()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        try:
            super().save_checkpoint(checkpoint, path, storage_options)
        except BaseException as error:
            with self._lock:
                self.failed[str(path)] = error
            raise
        with self._lock:
            self.finished.add(str(path))

    def done(self, path: Path) -> bool:
        """Whether ``path`` finished writing; raises its save's error if it failed."""
        with self._lock:
            error = self.failed.get(str(path))
            finished = str(path) in self.finished
        if error is not None:
            raise error
        return finished


def _dcp_done(future: Future[Any]) -> bool:
    """Whether the DCP save behind ``future`` finished; raises its error if it failed."""
    if not future.done():
        return False
    future.result()
    return True


@dataclass
class _Save:
    step: int  # optimizer steps the saved state has taken
    path: Path
    # Whether the save completed; raises the save's own error if it failed, so that a
    # failed save (a full disk) ends the job with that error, as it would for a user,
    # instead of being waited for forever or taken for a checkpoint to restart from.
    done: Callable[[], bool]


def check_comparison_options(*, interval: Any = "cap", max_overhead: Any = 0.03,
                       mtbf_steps: Any = None) -> None:
    """Refuse ``checkpoint.<option>`` values of the comparison policies, naming key and value."""
    integer = isinstance(interval, int) and not isinstance(interval, bool)
    require((integer and interval >= 1) or interval in ("cap", "oracle"),
            f"{fmt('checkpoint.interval', interval)} must be an integer >= 1, 'cap' or "
            "'oracle'")
    require(is_number(max_overhead) and 0 < max_overhead < 1,
            f"{fmt('checkpoint.max_overhead', max_overhead)} must be a number in (0, 1)")
    require(mtbf_steps is None or (is_number(mtbf_steps) and mtbf_steps > 0),
            f"{fmt('checkpoint.mtbf_steps', mtbf_steps)} must be a number > 0 (or null: "
            "faults.mtbf_steps)")


class ComparisonCheckpointing:
    """Periodic asynchronous checkpoints of one rank's engine and a user's restart."""

    def __init__(self, policy: str, engine: TrainingEngine, directory: Path, rank: int,
                 world_size: int, failure_steps: set[int], warmup: int,
                 interval: int | str = "cap", max_overhead: float = 0.03,
                 mtbf_steps: float | None = None) -> None:
        if policy not in COMPARISON_POLICIES:
            raise ConfigError(f"checkpoint={policy} is not a comparison policy")
        check_comparison_options(interval=interval, max_overhead=max_overhead,
                                 mtbf_steps=mtbf_steps)
        if interval == "oracle" and mtbf_steps is None:
            raise ConfigError("checkpoint.interval=oracle needs checkpoint.mtbf_steps (or "
                              "faults=mtbf)")
        self.policy, self.engine, self.rank = policy, engine, rank
        self.directory = directory / f"rank{rank}" if policy == "lightning" else directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.distributed = world_size > 1
        self.failure_steps = set(failure_steps)
        self.warmup, self.rule, self.max_overhead = warmup, interval, max_overhead
        self.mtbf_steps = mtbf_steps
        self.interval: int | None = interval if isinstance(interval, int) else None
        self.io = AsyncCheckpointIO(_CompletionIO()) if policy == "lightning" else None
        # DCP's async save finishes with collectives from its own thread: on the training
        # group they would interleave with training's (torchtitan gives it a group too).
        self.group = (dist.new_group(backend="gloo")
                      if self.distributed and policy == "dcp" else None)
        # The ranks agree on k and on the newest complete checkpoint with host tensors: on
        # a group of their own, which works whatever the training group's backend (NCCL
        # takes device tensors only) and never meets the DCP save thread's collectives.
        self.control = dist.new_group(backend="gloo") if self.distributed else None
        self._dcp_save: Future[Any] | None = None  # the newest DCP save
        self.saves: list[_Save] = []
        self.save_s = 0.0  # wall time of one complete save, measured at step 0
        self.stall_s: list[float] = []  # training-thread time of each periodic save
        self.checkpoint_bytes = 0
        self.recoveries: list[dict[str, Any]] = []
        self._iteration_s: list[float] = []
        self._initial: dict[str, Any] = {}

    # -- the state a user's checkpoint holds ------------------------------------------
    def _state(self) -> dict[str, Any]:
        engine = self.engine
        return {"model": engine.model.state_dict(), "optimizer": engine.optimizer.state_dict(),
                "schedule": engine.schedule_state(), "step": engine.step}

    def _load(self, state: dict[str, Any]) -> None:
        engine = self.engine
        engine.model.load_state_dict(state["model"])
        engine.optimizer.load_state_dict(state["optimizer"])
        engine.restore_schedule_state(state["schedule"])
        engine.set_step(int(state["step"]))

    def _save(self) -> _Save:
        step = self.engine.step
        if self.io is not None:
            path = self.directory / f"step-{step}.ckpt"
            self.io.save_checkpoint(self._state(), path)
            completion = self.io.checkpoint_io
            assert isinstance(completion, _CompletionIO)
            return _Save(step, path, lambda: completion.done(path))
        path = self.directory / f"step-{step}"
        # One save in flight, as torchtitan keeps it: each async_save runs in a thread of
        # its own, and two in flight would run their collectives in either order on each
        # rank. The wait is the training thread's, counted in the stall.
        if self._dcp_save is not None:
            self._dcp_save.result()
        # Keys per rank: DCP deduplicates equal keys across ranks, and stage-local names
        # repeat on every pipeline stage.
        future = dcp.async_save({f"rank{self.rank}": self._state()}, checkpoint_id=path,
                                process_group=self.group)
        assert isinstance(future, Future)  # the default (thread) async save
        self._dcp_save = future
        return _Save(step, path, lambda: _dcp_done(future))

    # -- the loop's calls -------------------------------------------------------------
    def begin(self) -> None:
        """Before the first step: measure one complete save, keep the initial state."""
        self._initial = copy.deepcopy(self._state())
        started = time.perf_counter()
        save = self._save()
        while not save.done():
            time.sleep(0.001)
        self.save_s = time.perf_counter() - started
        self.checkpoint_bytes = sum(f.stat().st_size for f in save.path.rglob("*")
                                    if f.is_file()) if save.path.is_dir() else (
            save.path.stat().st_size)

    def before_iteration(self, step: int) -> None:
        """A failure at ``step`` aborts it: restart from the newest complete checkpoint."""
        if step not in self.failure_steps:
            return
        self.failure_steps.discard(step)
        newest = self._newest_complete()
        # Saves in flight died with the job; their threads still run here: let them end
        # (not counted) so none writes while the recomputed steps save again.
        while not all(s.done() for s in self.saves):
            time.sleep(0.001)
        started = time.perf_counter()
        self.saves = [s for s in self.saves if s.step <= newest]
        if newest == 0:
            self._load(copy.deepcopy(self._initial))
        elif self.io is not None:
            self._load(torch.load(self.directory / f"step-{newest}.ckpt", weights_only=False))
        else:
            state = {f"rank{self.rank}": self._state()}
            dcp.load(state, checkpoint_id=self.directory / f"step-{newest}",
                     process_group=self.group)
            self._load(state[f"rank{self.rank}"])
        loaded = time.perf_counter()
        while self.engine.step < step:  # recompute the lost steps
            assert self.engine.batch is not None
            self.engine.train_iteration(*self.engine.batch(self.engine.step))
            self.after_iteration(None)
        finished = time.perf_counter()
        self.recoveries.append({
            "failed_step": step, "iterations_replayed": step - newest,
            "restored_step": newest,
            "timings_s": {"fetch": loaded - started, "replay": finished - loaded,
                          "total": finished - started}})

    def after_iteration(self, iteration_s: float | None) -> None:
        """After an optimizer step: choose ``k`` once warm, save every ``k`` steps."""
        if iteration_s is not None and self.interval is None:
            self._iteration_s.append(iteration_s)
            if len(self._iteration_s) >= self.warmup:
                self.interval = self._choose_interval()
        step = self.engine.step
        if (self.interval is None or step % self.interval
                or (self.saves and self.saves[-1].step >= step)):
            return
        started = time.perf_counter()
        self.saves.append(self._save())
        self.stall_s.append(time.perf_counter() - started)
        self._prune()

    def _newest_complete(self) -> int:
        """The newest step whose checkpoint completed on every rank (0: none did).
        Collective: every rank calls it at the same steps."""
        newest = max((s.step for s in self.saves if s.done()), default=0)
        if self.distributed:
            agreed = torch.tensor([newest])
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.control)
            newest = int(agreed.item())
        return newest

    def _prune(self) -> None:
        """Keep the newest checkpoint complete on every rank and those after it, as users
        keep the latest (``save_top_k``, torchtitan's ``keep_latest_k``): disk and the
        list stay bounded."""
        newest = self._newest_complete()
        for save in [s for s in self.saves if s.step < newest and s.done()]:
            self.saves.remove(save)
            if save.path.is_dir():
                shutil.rmtree(save.path, ignore_errors=True)
            else:
                save.path.unlink(missing_ok=True)

    def _choose_interval(self) -> int:
        """``k`` by the rule, from the median iteration and the measured save. Collective
        when distributed: one ``k`` for the job, from the slowest rank's figures, as a user
        sets one for every rank (ranks that measured apart and chose apart would prune at
        different steps, each waiting in a collective the others never enter)."""
        iteration = sorted(self._iteration_s)[len(self._iteration_s) // 2]
        save_s = self.save_s
        if self.distributed:
            slowest = torch.tensor([iteration, save_s], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.control)
            iteration, save_s = slowest.tolist()
        if self.rule == "cap":
            return checkfreq_interval(iteration, save_s, self.max_overhead)
        assert self.mtbf_steps is not None
        return gemini_interval(self.mtbf_steps * iteration, iteration, save_s)

    def close(self) -> None:
        """Wait for outstanding saves."""
        while not all(s.done() for s in self.saves):
            time.sleep(0.001)
        if self.io is not None:
            self.io.teardown()

    def metrics(self, train_seconds: float) -> dict[str, Any]:
        """Figures for ``metrics.json``, named as the sparse policies' are."""
        stall = sum(self.stall_s)
        steps = max(1, self.engine.step)
        return {
            "checkpoint_policy": self.policy, "interval": self.interval,
            "interval_rule": self.rule, "checkpoint_save_s": self.save_s,
            "checkpoint_overhead_pct": 100.0 * stall / train_seconds if train_seconds else 0.0,
            "stall_ms": 1e3 * stall, "checkpoints_written": len(self.stall_s),
            "snapshot_bytes_per_iter": self.checkpoint_bytes * len(self.stall_s) / steps,
            "checkpoint_bytes": self.checkpoint_bytes, "window": None,
            "failures_injected": len(self.recoveries), "recoveries": self.recoveries,
        }
