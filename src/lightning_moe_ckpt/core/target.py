"""What checkpointing and recovery need from a training loop: :class:`TrainingTarget`.

A target is one rank's model, optimizer and a way to run one training iteration again.
The built-in :class:`~lightning_moe_ckpt.training.engine.TrainingEngine` is one target;
a user's own LightningModule under the Trainer
(:class:`~lightning_moe_ckpt.targets.lightning.LightningTarget`) and a Fabric loop
(:class:`~lightning_moe_ckpt.targets.fabric.FabricTarget`) are others. Snapshots,
replication, recovery and failure injection see only this interface, so every model and
every loop runs the same core.

Around each optimizer step the target calls :meth:`TrainingTarget.before_update` (right
before the step mutates any state: frozen slices are saved and the observers' copies
waited for) and :meth:`TrainingTarget.after_update` (right after: frozen slices are put
back and the observers take their snapshot). Observers are :class:`StepHooks`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from lightning_moe_ckpt.core.batch_log import BatchLog
from lightning_moe_ckpt.core.layout import ParallelPlan
from lightning_moe_ckpt.core.optimizer_state import OptimizerStateAccess
from lightning_moe_ckpt.core.registry import OperatorRegistry
from lightning_moe_ckpt.errors import IterationAborted


class StepIndexedData:
    """Declares that a LightningModule's training data is indexed by the optimizer step:
    its ``train_dataloader`` starts at ``trainer.global_step``, so a run resumed from a
    checkpoint reads on where it was without a saved data position (the built-in
    modules do; a module of your own need not)."""


class StepResult(Protocol):
    """Per-iteration values an observer reads after the optimizer step (device tensors)."""

    @property
    def clip_coef(self) -> torch.Tensor | None: ...

    @property
    def lr(self) -> float: ...

    @property
    def expert_load(self) -> torch.Tensor | None: ...  # [layers, experts] tokens routed

    @property
    def soft_load(self) -> torch.Tensor | None: ...  # [layers, experts] gate probabilities


@dataclass(frozen=True)
class StepTelemetry:
    """:class:`StepResult` of a user's loop: what the hooks could observe."""

    clip_coef: torch.Tensor | None
    lr: float
    expert_load: torch.Tensor | None = None
    soft_load: torch.Tensor | None = None


class ReplayableSchedule(Protocol):
    """A rank's pipeline schedule, as a localized replay drives it: for each replayed
    iteration, per pipeline position, the logged activations and gradients that stand in
    for the paused neighbours (``{iteration: {pp: (activations, gradients)}}``)."""

    replay: dict[int, dict[int, tuple[Any, Any]]]


class PipelineExecution(Protocol):
    """A rank's pipeline executor, as a localized replay drives it."""

    @property
    def runner(self) -> ReplayableSchedule | None:
        """The schedule, whose ``replay`` takes logged tensors (None: no pipeline)."""

    iteration: int  # the iteration its next forward/backward runs (keys the logs)
    forward_backward_calls: int  # counted: paused ranks run none during a recovery
    replaying: bool  # set during the replay: no collective may span the world


class IterationGuard(Protocol):
    """Runs a loop's optimizer step again when a peer's failure interrupted it."""

    def guarded(self, call: Callable[[], Any]) -> Any: ...


class RankReplacement:
    """How the strategy running a user's model lets a failed rank be replaced while the
    other ranks keep their processes and their live model."""

    # Set when real failures are recovered: every optimizer step runs through it.
    iteration_guard: IterationGuard | None = None

    @property
    def replaces_failed_ranks(self) -> bool:
        """Whether a failed rank can be replaced under this strategy: its process groups
        are released and re-formed over the live model (:meth:`release_user_model`,
        :meth:`reform_user_model`, :meth:`warm_up_user_model`) and its loop retries an
        interrupted step."""
        return False

    def release_user_model(self) -> None:
        """A peer failed: drop every reference to the broken process groups (executor,
        expert shards, mesh) before new ones are formed, so a peer blocked on this rank
        fails at once instead of waiting out its collective timeout."""
        raise NotImplementedError(f"{type(self).__name__} does not replace failed ranks")

    def reform_user_model(self) -> None:
        """The default process group was formed anew: rebuild the mesh, the expert and
        pipeline groups and the executor over the live model (collective)."""
        raise NotImplementedError(f"{type(self).__name__} does not replace failed ranks")

    def warm_up_user_model(self, sample_batch: Any) -> None:
        """A collective first pass through the rebuilt pipeline (``sample_batch``: a batch
        of the loop's, for the pipeline's shapes where this process has none yet)."""
        raise NotImplementedError(f"{type(self).__name__} does not replace failed ranks")


class UserModelParallelism(RankReplacement, ABC):
    """A strategy that runs a user's own model under ``pp x dp x ep``: what the targets of
    a user's loop read from it."""

    @abstractmethod
    def user_layout(self) -> ParallelPlan | None:
        """The layout the user's model runs in, with the full model's layers and experts
        (None: the strategy did not split the model)."""

    @abstractmethod
    def user_grad_norm(self) -> torch.Tensor:
        """The L2 norm of the user's model's gradients over all of its ranks (collective
        outside a localized replay)."""

    @property
    @abstractmethod
    def data_shard(self) -> int:
        """Which data shard this rank reads (the same on every stage of a pipeline)."""

    @property
    @abstractmethod
    def user_pipeline(self) -> PipelineExecution | None:
        """The executor running the user's model's stages (None before the first batch)."""


class StepHooks:
    """Observers of the training loop (snapshotting, profiling, failure injection);
    every method defaults to doing nothing."""

    # Whether after_optimizer_step only records, locally, what a replay of the iteration
    # needs from this rank (the upstream log's scalars). Such hooks see a completed
    # iteration before any other: another's collective may break on a dead peer, and the
    # recovery then replays that iteration from what was recorded.
    records_for_replay: ClassVar[bool] = False

    def before_iteration(self, step: int) -> None:
        """Iteration ``step`` is about to start (its batch is logged)."""

    def before_optimizer_step(self, step: int) -> None:
        """Optimizer step ``step`` is about to mutate state."""

    def after_optimizer_step(self, step: int, result: StepResult) -> None:
        """Optimizer step ``step`` completed."""

    def iteration_failed(self, step: int, error: BaseException) -> bool:
        """Iteration ``step`` raised ``error``; return True when a recovery took over
        (the loop then reruns from the target's step), False to let it propagate."""
        return False


class TrainingTarget(ABC):
    """One rank's training state and how to rerun an iteration of it.

    ``step`` counts completed optimizer steps: iteration ``step`` performs optimizer
    step ``step`` (0-based).

    Args:
        model: This rank's (possibly partial) model.
        optimizer: Its optimizer.
        registry: The model's operators; ``None``: discovered from ``model`` by the
            built-in rules.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 registry: OperatorRegistry | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.registry = registry if registry is not None else OperatorRegistry(model)
        self.state = OptimizerStateAccess(optimizer)
        self.step = 0
        self.hooks: list[StepHooks] = []
        # Each iteration's batch, for targets that replay through a user's step.
        self.batch_log: BatchLog | None = None

    @property
    @abstractmethod
    def layout(self) -> ParallelPlan:
        """The parallel layout this rank belongs to."""

    @property
    def forward_backward_calls(self) -> int:
        """Forward/backward passes this rank ran so far (recovery reports count them)."""
        return 0

    @property
    def pipeline(self) -> PipelineExecution | None:
        """This rank's pipeline executor, for a localized replay (None: no pipeline)."""
        return None

    @property
    def top_k(self) -> int | None:
        """Experts each token is routed to, when the target knows it."""
        return None

    @property
    def routing_source(self) -> str:
        """Where popularity comes from: ``engine``, ``router hooks`` or ``static``."""
        return "static"

    @property
    def supports_capacity_factors(self) -> bool:
        """Whether :meth:`set_capacity_factors` reaches the model (MoEtion's boost)."""
        return False

    def set_capacity_factors(self, factors: torch.Tensor) -> None:
        """Per-``[layer, expert]`` capacity factors for the next iteration."""
        raise NotImplementedError(f"{type(self).__name__} has no expert capacity to scale")

    @abstractmethod
    def replay_iteration(self, step: int, clip_coef: torch.Tensor | None) -> None:
        """Run iteration ``step`` again as the uninterrupted run did; ``clip_coef``
        replaces the gradient-clipping coefficient (frozen operators make the global norm
        incomputable during conversion)."""

    @abstractmethod
    def schedule_state(self) -> dict[str, Any]:
        """LR schedules, optimizer hyper-parameters and RNG now (snapshot metadata)."""

    @abstractmethod
    def restore_schedule_state(self, metadata: Mapping[str, Any]) -> None:
        """Inverse of :meth:`schedule_state`."""

    def set_step(self, step: int) -> None:
        """The iteration the target runs next (its pipeline tags that iteration's
        boundary tensors, and a replay looks the logged ones up, by this number)."""
        self.step = step
        pipeline = self.pipeline
        if pipeline is not None:
            pipeline.iteration = step

    def resume_at(self, step: int) -> None:
        """After a recovery: continue with iteration ``step`` as the uninterrupted run
        would (targets that log per-iteration state restore it here)."""
        self.set_step(step)

    def begin_iteration(self) -> None:
        """Tell the observers iteration ``step`` starts (failure injection fires here).
        Raises :class:`IterationAborted` when a recovery moved the target to another step."""
        step = self.step
        for hook in list(self.hooks):  # an injected recovery may change the list
            hook.before_iteration(step)
        if self.step != step:
            raise IterationAborted(self.step)

    def iteration_failed(self, error: BaseException) -> None:
        """The current iteration raised ``error``: a hook may recover (then
        :class:`IterationAborted` tells the loop where to continue), else it propagates."""
        if any(hook.iteration_failed(self.step, error) for hook in list(self.hooks)):
            raise IterationAborted(self.step) from error
        raise error

    def before_update(self) -> None:
        """Right before the optimizer step: observers wait for their copies of the state
        the step mutates; frozen slices are saved."""
        for hook in self.hooks:
            hook.before_optimizer_step(self.step)
        if self.registry.frozen_slices:
            self.registry.frozen_slices.hold(self.state.step_tensors, self.state.state_of)

    def after_update(self) -> None:
        """Right after the optimizer step: frozen slices are put back."""
        if self.registry.frozen_slices:
            self.registry.frozen_slices.release()

    def finish_iteration(self, result: StepResult) -> None:
        """The iteration is complete: count it and let observers record and snapshot it.

        The iteration stands whatever the observers do. When one of their collectives
        breaks (a peer died), :meth:`iteration_failed` takes over: after a recovery,
        :class:`IterationAborted` names the step to go on at, which is ``step`` when the
        recovery kept this rank past the iteration."""
        index = self.step
        self.step += 1
        for hook in self.hooks:
            if hook.records_for_replay:
                hook.after_optimizer_step(index, result)
        try:
            for hook in self.hooks:
                if not hook.records_for_replay:
                    hook.after_optimizer_step(index, result)
        except RuntimeError as error:  # a broken collective or P2P (DistBackendError)
            self.iteration_failed(error)

    @contextmanager
    def hooks_suspended(self) -> Iterator[None]:
        """Replay re-takes no snapshots and injects no failures."""
        hooks, self.hooks = self.hooks, []
        try:
            yield
        finally:
            self.hooks = hooks
