"""One rank's iteration over a user's :class:`~.model_plans.StagedModel`.

An iteration's ``[M, b, S]`` micro-batches run through the pipeline schedule
(``torch.distributed.pipelining`` 1F1B with the library's boundary hooks, so upstream
logging works unchanged) when ``pp > 1``, or through the same micro-batch loop in one
stage otherwise. Either way a parameter's gradient is the sum of its micro-batch loss
gradients, in micro-batch order, so a pure pipeline layout's gradients equal the
single-stage run's bitwise.

:meth:`StagedExecutor.reduce_gradients` then makes them the gradient of the mean loss over
the global batch: expert parameters (those of an
:class:`~lightning_moe_ckpt.parallel.fused_experts.ExpertShard`) are summed over ``dp``
(an expert already holds every token routed to it from its ``ep`` peers), all others over
the stage's ``dp x ep`` ranks, and everything is divided once by ``M x dp x dp_shard x
ep``. A model sharded over ``dp_shard`` (FSDP2) has summed each gradient over its shard
group in backward already; the sums above run on the local shards. A
trainable parameter that got no gradient this iteration (no token reached its expert)
takes part with zeros, so every replica issues the same collectives; a frozen one
(``requires_grad`` off during a replay) takes no part.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from lightning_moe_ckpt.core.layout import Coordinates, ParallelPlan
from lightning_moe_ckpt.core.operators import local_tensor
from lightning_moe_ckpt.parallel.fused_experts import ExpertShard
from lightning_moe_ckpt.parallel.model_plans import StagedModel
from lightning_moe_ckpt.parallel.pipeline import BoundaryHook, PipelineRunner
from lightning_moe_ckpt.training.distributed_executor import ProcessGroups
from lightning_moe_ckpt.training.executor import slot_tensor

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def expert_parameters(model: nn.Module) -> set[int]:
    """``id`` of every parameter held by an expert shard of ``model``."""
    return {id(p) for module in model.modules() if isinstance(module, ExpertShard)
            for p in module.parameters(recurse=False)}


class StagedExecutor:
    """Forward/backward, gradient sync and the global loss of one rank's stages."""

    def __init__(self, staged: StagedModel, plan: ParallelPlan, groups: ProcessGroups,
                 coords: Coordinates, device: torch.device, micro_batch: int, seq_len: int,
                 loss_fn: LossFn, hooks: list[BoundaryHook], full_names: list[str]) -> None:
        self.staged = staged
        self.plan = plan
        self.groups = groups
        self.loss_fn = loss_fn
        self.device = device
        self.micro_batch, self.seq_len = micro_batch, seq_len
        self.iteration = 0
        self.forward_backward_calls = 0
        self.replaying = False
        experts = expert_parameters(staged.model)
        self.trainable = [(p, id(p) in experts) for p in staged.model.parameters()
                          if p.requires_grad]
        self.norm_slots, self.owned_norms = _norm_slots(staged.model, experts, full_names,
                                                        coords, plan)
        self.runner: PipelineRunner | None = None
        pp_rank = coords.pp
        if plan.pp > 1:
            dtype = next(p.dtype for p in staged.model.parameters() if p.is_floating_point())
            self.runner = PipelineRunner(
                staged.stages, plan, pp_rank, groups.pp, device, dtype, micro_batch, seq_len,
                staged.hidden_size, staged.output_size, loss_fn, hooks)

    def release(self) -> None:
        """Drop this executor's pipeline and gradient-sync groups before a recovery forms
        new ones (it runs nothing until it is rebuilt; idempotent)."""
        self.runner = None
        vars(self).pop("groups", None)

    @property
    def has_loss(self) -> bool:
        """Whether this rank computes the loss (holds the last stage)."""
        return self.runner is None or self.runner.has_last

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """All micro-batches of ``inputs``/``targets`` (``[M, b, S]``); returns this rank's
        summed micro-batch loss (zero on ranks without the last stage)."""
        iteration = self.iteration
        self.iteration += 1
        self.forward_backward_calls += 1
        # An iteration's gradients are its own: whatever the previous step left (the
        # Trainer zeroes gradients only after the training step) is dropped first.
        for param, _ in self.trainable:
            param.grad = None
        if self.runner is not None:
            return self.runner.run(iteration, inputs, targets)
        (stage,) = self.staged.stages
        total = torch.zeros((), dtype=torch.float32, device=inputs.device)
        for index in range(inputs.shape[0]):
            loss = self.loss_fn(stage(inputs[index]), targets[index])
            loss.backward()
            total = total + loss.detach()
        return total

    def warm_up(self) -> None:
        """One forward/backward of token id 0 through a freshly built pipeline schedule, its
        gradients dropped: the schedule exchanges its start-up messages with the
        neighbours here, on every rank together, and not later in a localized replay
        where the neighbours are paused (collective; nothing to do without a pipeline)."""
        if self.runner is None:
            return
        shape = (self.plan.microbatches, self.micro_batch, self.seq_len)
        tokens = torch.zeros(shape, dtype=torch.int64, device=self.device)
        self.runner.run(-1, tokens, tokens)  # iteration -1: the boundary hooks stay silent
        for param, _ in self.trainable:
            param.grad = None

    def reduce_gradients(self) -> None:
        """Gradients of the mean loss over the global batch, in place (collective)."""
        # Frozen operators (requires_grad off, by name on every rank) take no part: no
        # gradient, no collective, so the optimizer leaves them untouched.
        active = [(param, is_expert) for param, is_expert in self.trainable
                  if param.requires_grad]
        pending = []
        grads = []
        for param, is_expert in active:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = local_tensor(param.grad)
            grads.append(grad)
            group = self.groups.dp if is_expert else self.groups.replicas
            if dist.get_world_size(group) > 1:
                pending.append(dist.all_reduce(grad, group=group, async_op=True))
        for work in pending:
            assert work is not None
            work.wait()
        if grads:
            torch._foreach_div_(grads, self.plan.microbatches * self.plan.data_shards)

    def grad_norm(self) -> torch.Tensor:
        """The L2 norm of the full model's gradients: per-parameter norms placed at the
        parameter's position in the full model (expert shards at their own slots), summed
        by an exact all-reduce (every slot comes from one rank; skipped in a localized
        replay), then normed, so a pure pipeline layout gets the one-process norm."""
        vector = torch.zeros(self.norm_slots, dtype=torch.float32, device=self.device)
        owned = [(slot, local_tensor(p.grad)) for slot, p in self.owned_norms
                 if p.grad is not None]
        if owned:
            norms = torch._foreach_norm([grad for _, grad in owned])
            vector[slot_tensor([slot for slot, _ in owned], self.device)] = \
                torch.stack(norms).float()
        if not self.replaying:
            dist.all_reduce(vector, group=self.groups.world)
        return torch.linalg.vector_norm(vector)

    def global_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """Mean micro-batch loss over every data shard, on every rank (collective unless
        replaying: a localized replay's loss stays on the scope)."""
        total = loss_sum.detach().clone().reshape(1)
        if not self.replaying:
            dist.all_reduce(total, group=self.groups.world)
        return total[0] / (self.plan.microbatches * self.plan.data_shards)


def _norm_slots(model: nn.Module, experts: set[int], full_names: list[str],
                coords: Coordinates, plan: ParallelPlan
                ) -> tuple[int, list[tuple[int, nn.Parameter]]]:
    """Slots of the grad-norm vector and the ``(slot, parameter)`` pairs this rank fills.

    A whole parameter takes its position in the full model and is filled by its first
    replica (``dp == 0``, and ``ep == 0`` unless it is an expert shard); the ``ep`` shards
    of an expert parameter take one slot each, past the whole-model positions. Under
    ``dp_shard`` every position has a slot per shard."""
    ep, shards = plan.ep, plan.dp_shard
    position = {name: index for index, name in enumerate(full_names)}
    owned: list[tuple[int, nn.Parameter]] = []
    for name, param in model.named_parameters():
        if id(param) in experts:
            if coords.dp == 0:
                slot = len(full_names) + position[name] * ep + coords.ep
                owned.append((slot * shards + coords.dp_shard, param))
        elif coords.dp == 0 and coords.ep == 0:
            owned.append((position[name] * shards + coords.dp_shard, param))
    return len(full_names) * (ep + 1) * shards, owned
