"""A Fabric loop as a :class:`~.base.TrainingTarget`: the user hands over its step function.

``SparseCheckpointing.protect(fabric, model, optimizer, step_fn)`` returns a
:class:`ProtectedStep`; the loop calls it with each batch instead of ``step_fn``. It logs
the batch and the per-iteration state, lets the observers run (a failure injector may
recover there) and then calls ``step_fn(batch)``, which does forward, ``fabric.backward``
and ``optimizer.step()`` as before. Replay calls the same ``step_fn`` on the logged batch.
Clip gradients by norm with ``fabric.clip_gradients(model, optimizer, max_norm=...)``
(rerouted here for this Fabric's strategy) or :meth:`FabricTarget.clip_gradients`: both log
the coefficient the replay needs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.wrappers import _FabricModule, _FabricOptimizer
from torch import nn
from typing_extensions import override

from lightning_moe_ckpt.core.batch_log import BatchRecord
from lightning_moe_ckpt.core.operators import OperatorOverride
from lightning_moe_ckpt.core.registry import OperatorRegistry
from lightning_moe_ckpt.errors import require
from lightning_moe_ckpt.targets.telemetry import RouterParser, RouterTelemetry, configured_top_k
from lightning_moe_ckpt.targets.user_loop import (
    Scheduler,
    UserLoopTarget,
    full_model_shape,
    user_parallelism,
)

StepFunction = Callable[[Any], Any]


class FabricTarget(UserLoopTarget):
    """A Fabric-set-up model and optimizer, and the step function that trains them."""

    def __init__(self, fabric: Fabric, model: nn.Module, optimizer: torch.optim.Optimizer,
                 step_fn: StepFunction, schedulers: Sequence[Scheduler] = (),
                 override: OperatorOverride | None = None, top_k: int | None = None,
                 router_parser: RouterParser | None = None) -> None:
        module = model.module if isinstance(model, _FabricModule) else model
        raw = optimizer.optimizer if isinstance(optimizer, _FabricOptimizer) else optimizer
        # torch's LRScheduler marks the step of the optimizer it drives. Unless handed over,
        # a scheduler stepped in step_fn is stepped again by every replayed iteration.
        if not schedulers and hasattr(raw.step, "_wrapped_by_lr_sched"):
            warnings.warn("an LR scheduler drives this optimizer, but protect() got no "
                          "schedulers=[...]: one stepped inside step_fn would be stepped "
                          "again by every replayed iteration and run ahead after a "
                          "recovery; pass it as protect(..., schedulers=[scheduler])",
                          UserWarning, stacklevel=3)
        parallelism = user_parallelism(fabric.strategy)
        # Replicas synchronised by a DDP-style wrapper expect a gradient for every
        # parameter: frozen ones keep requires_grad and are restored around the step. A
        # model split by the strategy syncs only what requires a gradient.
        registry = OperatorRegistry(module, override, freeze_by_restore=(
            fabric.world_size > 1 and parallelism is None))
        telemetry = RouterTelemetry(module, registry, configured_top_k(module, top_k),
                                    router_parser, full_model_shape(parallelism))
        super().__init__(module, raw, registry, schedulers,
                         telemetry if telemetry.active else None, fabric.world_size,
                         parallelism)
        self.fabric = fabric
        self.step_fn = step_fn
        self._route_clipping()

    def _route_clipping(self) -> None:
        """Send ``fabric.clip_gradients(..., max_norm=...)`` through :meth:`clip_gradients`:
        computed from the partly frozen gradients of a replay, the coefficient would
        differ from the one the run applied. An instance attribute: only this Fabric's
        strategy is rerouted."""
        strategy = self.fabric.strategy

        def clip_gradients_norm(module: nn.Module, optimizer: torch.optim.Optimizer,
                                max_norm: float, norm_type: float = 2.0,
                                error_if_nonfinite: bool = True) -> torch.Tensor:
            require(float(norm_type) == 2.0,
                    f"fabric.clip_gradients(norm_type={norm_type!r}) under sparse "
                    "checkpointing: replay reuses the logged coefficient of the L2 norm "
                    "only; use norm_type=2")
            strategy.precision.unscale_gradients(optimizer)
            grads = [p.grad for p in strategy.precision.main_params(optimizer)
                     if p.grad is not None]
            total = self.total_norm(grads)
            # As torch.nn.utils.clip_grad_norm_ (a host sync, as there).
            if error_if_nonfinite and not bool(torch.isfinite(total)):
                raise RuntimeError(f"the total norm of the gradients is {float(total)}; "
                                   "pass error_if_nonfinite=False to clip anyway")
            self.clip_gradients(grads, float(max_norm), total)
            return total

        strategy.clip_gradients_norm = clip_gradients_norm  # type: ignore[method-assign]

    @override
    def run_step(self, record: BatchRecord) -> None:
        self.step_fn(self.fabric.to_device(record.batch))


class ProtectedStep:
    """The user's step function, with batch logging and failure handling around it."""

    def __init__(self, target: FabricTarget) -> None:
        self.target = target

    def __call__(self, batch: Any) -> Any:
        """Run iteration ``target.step`` on ``batch``."""
        self.target.start_iteration(batch, self.target.step)
        step = self.target.step  # after a recovery start_iteration ran: the step to run
        result = self.target.step_fn(batch)
        steps = self.target.step - step
        require(steps == 1,
                f"the step function passed to protect() ran {steps} optimizer steps on one "
                "batch; sparse checkpointing logs and replays one batch per optimizer step, "
                "so call optimizer.step() exactly once per call (to accumulate gradients, "
                "loop over micro-batches inside the step function)")
        return result
