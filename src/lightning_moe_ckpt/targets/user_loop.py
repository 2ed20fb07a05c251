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
:class:`~lightning_moe_ckpt.recovery.batch_log.BatchLog`, and the observers run (a failure
injector may recover right there). Replay restores that state and runs the iteration
again through the user's own step.

Gradient clipping by norm goes through :meth:`UserLoopTarget.clip_gradients`, which
computes the coefficient exactly as ``torch.nn.utils.clip_grad_norm_`` does, records it
for the snapshot metadata and, during sparse-to-dense conversion, applies the logged one
instead (frozen operators make the global norm incomputable).
"""

from __future__ import annotations

from abc import abstractmethod
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_moe_ckpt.checkpoint.snapshot import restore_rng, rng_state
from lightning_moe_ckpt.operators import OperatorRegistry
from lightning_moe_ckpt.parallel.topology import ParallelPlan
from lightning_moe_ckpt.recovery.batch_log import BatchLog, BatchRecord, host_copy
from lightning_moe_ckpt.targets.base import (
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
        self._clip: torch.Tensor | None = None  # this iteration's coefficient
        self._lr = 0.0
        self._iterations = 0
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
        self.finish_iteration(StepTelemetry(clip, self._lr, hard, soft))

    # --- per-iteration state ---------------------------------------------------------
    def start_iteration(self, batch: Any, batch_idx: int) -> None:
        """Iteration ``step`` starts on ``batch``: log it, then run the observers."""
        self.batch_log.log(BatchRecord(self.step, host_copy(batch), batch_idx,
                                       self.schedule_state()))
        self.begin_iteration()

    @override
    def schedule_state(self) -> dict[str, Any]:
        return {"rng": rng_state(),
                "lr_schedulers": [s.state_dict() for s in self.schedulers],
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in self.optimizer.param_groups]}

    @override
    def restore_schedule_state(self, metadata: Mapping[str, Any]) -> None:
        for scheduler, state in zip(self.schedulers, metadata["lr_schedulers"], strict=True):
            scheduler.load_state_dict(state)
        for group, saved in zip(self.optimizer.param_groups, metadata["param_groups"],
                                strict=True):
            group.update(saved)
        restore_rng(metadata["rng"])

    @override
    def resume_at(self, step: int) -> None:
        self.set_step(step)
        record = self.batch_log.records.get(step)
        if record is not None:  # the aborted iteration starts over from its own state
            self.restore_schedule_state(record.state)

    @override
    def replay_iteration(self, step: int, clip_coef: torch.Tensor | None) -> None:
        record = self.batch_log.get(step)
        self.restore_schedule_state(record.state)
        self.set_step(step)
        self.clip_override = clip_coef
        try:
            self.run_step(record)
        finally:
            self.clip_override = None

    @abstractmethod
    def run_step(self, record: BatchRecord) -> None:
        """Run the user's training step on a logged batch (optimizer step included)."""

    # --- gradient clipping -------------------------------------------------------------
    @torch.no_grad()
    def clip_gradients(self, grads: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Scale ``grads`` by ``min(1, max_norm / (total_norm + 1e-6))`` as
        ``torch.nn.utils.clip_grad_norm_`` does (or by the logged coefficient during
        replay); returns the coefficient."""
        grads = [g for g in grads if g is not None]
        if self.clip_override is not None:
            coef = self.clip_override
            scale_gradients(grads, coef)
        else:
            coef = clip_by_total_norm(grads, self.total_norm(grads), max_norm)
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
        return torch.nn.utils.get_total_norm(grads, 2.0)


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
