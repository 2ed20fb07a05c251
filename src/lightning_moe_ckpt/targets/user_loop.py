"""A user's own model, optimizer and loop as a :class:`TrainingTarget`.

Nothing in the user's loop changes: the target follows the optimizer step itself through
``Optimizer.register_step_pre_hook`` / ``register_step_post_hook``, so automatic and
manual optimization under the Trainer and a plain Fabric loop all work. When the step is
given a closure (Lightning always passes one: it runs forward and backward, then
``on_before_optimizer_step`` and gradient clipping), the pre-hook wraps it so that the
snapshot wait and the frozen-slice save happen *after* the closure, right before the
update, and the copy of the previous snapshot overlaps forward and backward.

At the start of each iteration the loop front end (the callback's ``on_train_batch_start``
or the Fabric step wrapper) calls :meth:`UserLoopTarget.start_iteration`: the batch, its
index, the RNG states, the LR schedulers and the optimizer's hyper-parameters go to the
:class:`~lightning_moe_ckpt.core.batch_log.BatchLog`, and the observers run (a failure
injector may recover right there). Replay restores that state and runs the iteration
again through the user's own step.

Gradient clipping by norm goes through :meth:`UserLoopTarget.clip_gradients`, which
computes the coefficient exactly as ``torch.nn.utils.clip_grad_norm_`` does, records it
for the snapshot metadata and, during sparse-to-dense conversion, applies the logged one
instead (frozen operators make the global norm incomputable).

A replayed iteration also redoes what the loop does between an optimizer step and the
next iteration (:meth:`UserLoopTarget.advance_schedule`: the Trainer steps its LR
schedulers there), so the per-iteration state evolves through a replay as it did in
training. A rank that logged the iteration restores the logged state over it; a process
that joined later (a replacement) reads the batches again (:attr:`UserLoopTarget.reread`)
and relies on that evolution, starting from the snapshot's metadata.
"""

from __future__ import annotations

from abc import abstractmethod
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_moe_ckpt.core.batch_log import BatchLog, BatchRecord, host_copy
from lightning_moe_ckpt.core.layout import ParallelPlan
from lightning_moe_ckpt.core.registry import OperatorRegistry
from lightning_moe_ckpt.core.rng import restore_rng, rng_state
from lightning_moe_ckpt.core.target import (
    IterationAborted,
    PipelineExecution,
    StepTelemetry,
    TrainingTarget,
    UserModelParallelism,
)
from lightning_moe_ckpt.targets.telemetry import RouterTelemetry

_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s epsilon

Scheduler = Any  # torch LR schedulers share no usable base type (state_dict/load_state_dict)


class UserLoopTarget(TrainingTarget):
    """A user's model and optimizer, followed through optimizer step hooks."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 registry: OperatorRegistry, schedulers: Sequence[Scheduler],
                 telemetry: RouterTelemetry | None, world_size: int = 1,
                 parallelism: UserModelParallelism | None = None) -> None:
        super().__init__(model, optimizer, registry)
        self.schedulers = list(schedulers)
        self.telemetry = telemetry
        self.world_size = world_size
        # A strategy that split the model over pp x dp x ep: the layout, pipeline and
        # grad norm come from it.
        self.parallelism = parallelism
        self.split = None if parallelism is None else parallelism.user_layout()
        self.batch_log: BatchLog = BatchLog()
        self.clip_override: torch.Tensor | None = None  # the logged coefficient in replay
        # Where a process that joined the job later reads the batch of an iteration its
        # batch log does not hold (its own loader again).
        self.reread: Callable[[int], BatchRecord] | None = None
        self._clip: torch.Tensor | None = None  # this iteration's coefficient
        self._lr = 0.0
        self._iterations = 0
        self._batch_idx = 0  # the running iteration's index in its epoch
        self._after_step = False  # inside the optimizer's post-step hook
        self._handles = [optimizer.register_step_pre_hook(self._pre_step),
                         optimizer.register_step_post_hook(self._post_step)]

    @property
    @override
    def layout(self) -> ParallelPlan:
        if self.split is not None:
            return self.split
        telemetry = self.telemetry
        n_layers = 1 if telemetry is None else max(1, telemetry.n_layers)
        n_experts = 1 if telemetry is None else max(1, telemetry.n_experts)
        return ParallelPlan(1, self.world_size, 1, 1, n_layers, n_experts)

    @property
    @override
    def pipeline(self) -> PipelineExecution | None:
        return None if self.parallelism is None else self.parallelism.user_pipeline

    @property
    @override
    def forward_backward_calls(self) -> int:
        pipeline = self.pipeline
        return self._iterations if pipeline is None else pipeline.forward_backward_calls

    @property
    @override
    def top_k(self) -> int | None:
        return None if self.telemetry is None else self.telemetry.top_k

    @property
    @override
    def routing_source(self) -> str:
        observed = self.telemetry is not None and self.telemetry.observed
        return "router hooks" if observed else "static"

    def close(self) -> None:
        """Detach from the optimizer and the routers."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.telemetry is not None:
            self.telemetry.close()

    # --- following the user's optimizer step -------------------------------------
    def _pre_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        # ``args`` starts with the optimizer itself; a closure is the next positional.
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._enter_update()
            return None

        def closure_then_update() -> Any:
            result = closure()
            self._enter_update()
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_update}
        return (args[0], closure_then_update, *args[2:]), kwargs

    def _enter_update(self) -> None:
        self._lr = float(self.optimizer.param_groups[0]["lr"])
        self.before_update()

    def _post_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> None:
        self.after_update()
        hard, soft = (None, None) if self.telemetry is None else self.telemetry.take()
        clip, self._clip = self._clip, None
        self._iterations += 1
        self._after_step = True  # the snapshot's metadata is the state right after a step
        try:
            self.finish_iteration(StepTelemetry(clip, self._lr, hard, soft))
        finally:
            self._after_step = False

    # --- per-iteration state ---------------------------------------------------------
    def start_iteration(self, batch: Any, batch_idx: int) -> None:
        """Iteration ``step`` starts on ``batch``: log it, then run the observers."""
        self._batch_idx = batch_idx
        self.batch_log.log(BatchRecord(self.step, host_copy(batch), batch_idx,
                                       self.schedule_state(), self.loop_epoch()))
        self.begin_iteration()

    def loop_epoch(self) -> int:
        """The epoch the loop is in, logged with each batch (0: a loop without epochs)."""
        return 0

    @override
    def schedule_state(self) -> dict[str, Any]:
        return {"rng": rng_state(),
                "lr_schedulers": [s.state_dict() for s in self.schedulers],
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in self.optimizer.param_groups],
                # Taken right after an optimizer step (a snapshot's metadata): the loop's
                # work after that step (advance_schedule) is still to come.
                "after_step_of_batch": self._batch_idx if self._after_step else None}

    @override
    def restore_schedule_state(self, metadata: Mapping[str, Any]) -> None:
        self._restore_state(metadata)
        if metadata["after_step_of_batch"] is not None:
            self.advance_schedule(metadata["after_step_of_batch"])

    def _restore_state(self, state: Mapping[str, Any]) -> None:
        for scheduler, saved in zip(self.schedulers, state["lr_schedulers"], strict=True):
            scheduler.load_state_dict(saved)
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"],
                                strict=True):
            group.update(saved)
        restore_rng(state["rng"])

    def advance_schedule(self, batch_idx: int) -> None:
        """What the loop does between the optimizer step of the iteration at ``batch_idx``
        (in its epoch) and the next iteration, redone after a replayed step; nothing
        here (a Fabric step function holds all of it)."""

    def batch_record(self, step: int) -> BatchRecord:
        """The logged batch of iteration ``step``, or the one read again (a process that
        joined later holds no log of the iterations before it)."""
        record = self.batch_log.find(step)
        if record is not None:
            return record
        if self.reread is not None:
            return self.reread(step)
        return self.batch_log.get(step)  # not held: its error names the step

    @override
    def resume_at(self, step: int) -> None:
        self.set_step(step)
        record = self.batch_log.find(step)
        if record is not None and record.state is not None:
            self._restore_state(record.state)  # the aborted iteration starts over as logged

    @override
    def replay_iteration(self, step: int, clip_coef: torch.Tensor | None) -> None:
        record = self.batch_record(step)
        if record.state is not None:
            self._restore_state(record.state)
        self.set_step(step)
        self.clip_override = clip_coef
        try:
            self.run_step(record)
        finally:
            self.clip_override = None
        self.advance_schedule(record.batch_idx)

    def sample_batch(self) -> Any:
        """A batch shaped like every iteration's: the newest logged one, or (a process that
        joined later, before its first iteration) the first one read again."""
        newest = self.batch_log.newest()
        if newest is not None:
            return newest.batch
        if self.reread is None:
            raise RuntimeError("no batch logged or readable yet")
        return self.reread(0).batch

    def discard_telemetry(self) -> None:
        """Drop the routing counted since the last step (a pass that trained nothing)."""
        if self.telemetry is not None:
            self.telemetry.take()

    def catch_up(self, step: int) -> None:
        """A recovery moved this rank back (it had run past the iteration that failed):
        run the iterations up to ``step`` again from the batch log, as the first time
        (observers and snapshots included), then stand at the start of ``step``."""
        while self.step < step:
            record = self.batch_log.get(self.step)
            if record.state is not None:
                self._restore_state(record.state)
            self._batch_idx = record.batch_idx
            try:
                self.begin_iteration()
            except IterationAborted:
                continue  # another failure moved this rank again: go on from there
            self.run_step(record)  # its optimizer step runs guarded, as the first time
            self.advance_schedule(record.batch_idx)
        self.resume_at(step)

    def guarded(self, call: Callable[[], Any]) -> Any:
        """Run ``call`` (the loop's optimizer step: forward, backward, clipping, update);
        when a peer's failure interrupts it and the job recovered, run it again from the
        recovered state, or not at all when every rank had completed it."""
        step = self.step
        while True:
            try:
                return call()
            except IterationAborted:
                pass
            except RuntimeError as error:  # a broken collective or P2P (DistBackendError)
                with suppress(IterationAborted):
                    self.iteration_failed(error)  # re-raises unless a peer failed
            if self.step > step:
                return None  # the job resumed after this iteration: it is done
            self.catch_up(step)

    @abstractmethod
    def run_step(self, record: BatchRecord) -> None:
        """Run the user's training step on a logged batch (optimizer step included)."""

    # --- gradient clipping -------------------------------------------------------------
    @torch.no_grad()
    def clip_gradients(self, grads: Sequence[torch.Tensor], max_norm: float,
                       total_norm: torch.Tensor | None = None) -> torch.Tensor:
        """Scale ``grads`` by ``min(1, max_norm / (total_norm + 1e-6))`` as
        ``torch.nn.utils.clip_grad_norm_`` does (or by the logged coefficient during
        replay); returns the coefficient. ``total_norm``: :meth:`total_norm` of ``grads``
        when the caller has it already."""
        grads = [g for g in grads if g is not None]
        if self.clip_override is not None:
            coef = self.clip_override
            scale_gradients(grads, coef)
        else:
            total = self.total_norm(grads) if total_norm is None else total_norm
            coef = clip_by_total_norm(grads, total, max_norm)
        self._clip = coef.detach()
        return coef

    def total_norm(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """The L2 norm of every gradient the clip scales: over every stage and expert
        shard of a split model, else this rank's (the model is whole here, or its
        replicas hold equal gradients)."""
        if self.split is not None and self.parallelism is not None:
            return self.parallelism.user_grad_norm()
        if not grads:
            return torch.zeros(())
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        # Sharded (FSDP2) gradients give a distributed norm: reduce it to the plain tensor
        # the coefficient, its log and the snapshots hold (the reduction clipping needs).
        return total.full_tensor() if isinstance(total, DTensor) else total


def clip_by_total_norm(grads: Sequence[torch.Tensor], total: torch.Tensor,
                       max_norm: float) -> torch.Tensor:
    """Scale ``grads`` by ``min(1, max_norm / (total + 1e-6))`` as
    ``torch.nn.utils.clip_grad_norm_`` does; returns the coefficient."""
    coef = torch.clamp(max_norm / (total + _CLIP_EPS), max=1.0)
    scale_gradients(grads, coef)
    return coef


def scale_gradients(grads: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply ``grads`` by ``coef`` in place, one foreach call per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        by_device[grad.device].append(grad)
    for device, group in by_device.items():
        torch._foreach_mul_(group, coef.to(device))


StepFunction = Callable[[Any], Any]


def user_parallelism(strategy: object) -> UserModelParallelism | None:
    """``strategy`` when it split a user's model over pp x dp x ep, else None."""
    if isinstance(strategy, UserModelParallelism) and strategy.user_layout() is not None:
        return strategy
    return None


def full_model_shape(parallelism: UserModelParallelism | None) -> tuple[int, int] | None:
    """``(layers, experts)`` of the whole model when this rank holds part of it."""
    layout = None if parallelism is None else parallelism.user_layout()
    return None if layout is None else (layout.n_layers, layout.n_experts)
