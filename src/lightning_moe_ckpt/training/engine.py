"""A rank's training engine: its model part, optimizer, LR schedule, operators and executor.

The Trainer's LightningModule and the Fabric loop both drive a :class:`TrainingEngine`;
:meth:`TrainingEngine.local` builds the single-process engine, and the parallel strategy
builds one per rank over the same class, so every front end and every layout runs the
same iteration function.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR
from typing_extensions import override

from lightning_moe_ckpt.core.layout import ParallelPlan
from lightning_moe_ckpt.core.operators import local_tensor, shard_like
from lightning_moe_ckpt.core.precision import MasterWeightAdamW
from lightning_moe_ckpt.core.rng import restore_rng, rng_state
from lightning_moe_ckpt.core.target import (
    IterationAborted,
    PipelineExecution,
    TrainingTarget,
)
from lightning_moe_ckpt.models.transformer import MoETransformer
from lightning_moe_ckpt.training.executor import Backward, Executor, LocalExecutor
from lightning_moe_ckpt.training.iteration import (
    IterationResult,
    build_model,
    build_optimizer,
    build_scheduler,
    train_iteration,
)
from lightning_moe_ckpt.training.settings import TrainingSettings


class EngineProvider(ABC):
    """A strategy that builds the built-in model's engine for its rank: its share of the
    model under ``pp x dp x ep``, and the data shard it reads. The built-in
    LightningModule asks its Trainer's strategy for one when the strategy declares this;
    any other strategy gets a local engine."""

    @abstractmethod
    def build_engine(self, settings: TrainingSettings) -> TrainingEngine:
        """This rank's engine for ``settings`` (called from the module's
        ``configure_model``)."""

    @property
    @abstractmethod
    def data_shard(self) -> int:
        """Which data shard this rank reads (the same on every stage of a pipeline)."""


class TrainingEngine(TrainingTarget):
    """Everything one rank of the built-in model needs to run training iterations.

    ``step`` counts completed optimizer steps; iteration ``step`` reads data batch
    ``step`` and performs optimizer step ``step`` (0-based). Replay reads the batch from
    the deterministic sampler (a pure function of step and shard).

    Args:
        settings: The run's settings.
        model: This rank's (possibly partial) model.
        optimizer: Its master-weight AdamW.
        scheduler: Its LR scheduler.
        executor: Where and how the parts of an iteration run (local, distributed).
        batch: This rank's ``(inputs, targets)`` of a step, for replay; ``None``: none yet
            (the LightningModule sets it; replay without one raises).
    """

    def __init__(self, settings: TrainingSettings, model: MoETransformer,
                 optimizer: MasterWeightAdamW, scheduler: LambdaLR, executor: Executor,
                 batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None
                 ) -> None:
        super().__init__(model, optimizer)
        self.settings = settings
        self.model: MoETransformer = model
        self.optimizer: MasterWeightAdamW = optimizer
        self.scheduler = scheduler
        self.executor = executor
        self.batch = batch  # this rank's (inputs, targets) of a step, for replay

    @classmethod
    def local(cls, settings: TrainingSettings,
              device: torch.device | str = "cpu") -> TrainingEngine:
        """The single-process engine (the reference for every parallel layout)."""
        model = build_model(settings.model, settings.precision, settings.seed).to(device)
        return cls.around(settings, model, LocalExecutor(model))

    @classmethod
    def around(cls, settings: TrainingSettings, model: MoETransformer,
               executor: Executor) -> TrainingEngine:
        """An engine over an already built (possibly partial) model and its executor."""
        optimizer = build_optimizer(model, settings.precision, settings.optim)
        scheduler = build_scheduler(optimizer, settings.optim, settings.max_steps)
        return cls(settings, model, optimizer, scheduler, executor)

    @property
    @override
    def layout(self) -> ParallelPlan:
        return self.settings.layout

    @property
    @override
    def forward_backward_calls(self) -> int:
        return self.executor.forward_backward_calls

    @property
    @override
    def pipeline(self) -> PipelineExecution | None:
        return self.executor

    @property
    @override
    def top_k(self) -> int | None:
        return self.settings.model.top_k

    @property
    @override
    def routing_source(self) -> str:
        return "engine"

    @property
    @override
    def supports_capacity_factors(self) -> bool:
        return True

    @override
    def set_capacity_factors(self, factors: torch.Tensor) -> None:
        for layer, moe in self.model.moe_layers().items():
            moe.capacity_scale = factors[layer]

    @override
    def replay_iteration(self, step: int, clip_coef: torch.Tensor | None) -> None:
        if self.batch is None:
            raise RuntimeError("the engine has no batch source for replay "
                               "(TrainingEngine.batch is unset)")
        self.train_iteration(*self.batch(step), clip_coef=clip_coef)

    @override
    def schedule_state(self) -> dict[str, Any]:
        return {"lr_scheduler": self.scheduler.state_dict(), "rng": rng_state(),
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in self.optimizer.param_groups]}

    @override
    def restore_schedule_state(self, metadata: Mapping[str, Any]) -> None:
        self.scheduler.load_state_dict(metadata["lr_scheduler"])
        for group, saved in zip(self.optimizer.param_groups, metadata["param_groups"],
                                strict=True):
            group.update(saved)
        restore_rng(metadata["rng"])

    def durable_state(self) -> dict[str, Any]:
        """This rank's dense state after step ``self.step`` (model, master weights and
        optimizer state, LR schedule, RNG, the step), as a durable checkpoint of a Fabric
        loop holds it; sharded tensors as their local shards."""
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "lr_scheduler": self.scheduler.state_dict(), "rng": rng_state(),
                 "global_step": self.step}
        return apply_to_collection(state, DTensor, local_tensor)

    def load_durable_state(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`durable_state` (local shards placed like the live ones)."""
        live = self.model.state_dict()
        self.model.load_state_dict({key: shard_like(value, live[key]) if key in live
                                    else value for key, value in state["model"].items()})
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["lr_scheduler"])
        restore_rng(state["rng"])
        self.set_step(int(state["global_step"]))

    def train_iteration(self, inputs: torch.Tensor, targets: torch.Tensor,
                        backward: Backward | None = None,
                        step: Callable[[], object] | None = None,
                        clip_coef: torch.Tensor | None = None) -> IterationResult:
        """One optimizer step. ``backward``/``step`` let Lightning wrap them (defaults:
        ``loss.backward()`` and the raw optimizer step)."""
        self.begin_iteration()  # e.g. failure injection, which may recover first
        # Batches come from the host-side sampler (the loop's and replay's alike): on a GPU
        # they go to the model's device here, once for every caller.
        device = next(self.model.parameters()).device
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        optimizer_step = step if step is not None else self.optimizer.step

        stepped = False

        def hooked_step() -> None:
            nonlocal stepped
            self.before_update()
            optimizer_step()
            self.after_update()
            stepped = True

        try:
            result = train_iteration(
                self.executor, self.optimizer, self.scheduler, inputs, targets,
                backward if backward is not None else _plain_backward, hooked_step,
                self.settings.optim.max_grad_norm, clip_coef)
        except RuntimeError as error:  # a broken collective or P2P (DistBackendError)
            if stepped:  # nothing after the update communicates: this is no peer's failure
                raise
            self.iteration_failed(error)  # a peer died: recover, or propagate
            raise
        # The iteration is complete, also when an observer's collective broke and the job
        # recovered with this rank past it: its result stands.
        after = self.step + 1
        try:
            self.finish_iteration(result)
        except IterationAborted as aborted:
            if aborted.step != after:  # the recovery moved this rank: go on from there
                raise
        return result


def _plain_backward(loss: torch.Tensor) -> None:
    loss.backward()
