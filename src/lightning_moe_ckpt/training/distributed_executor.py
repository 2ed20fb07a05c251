"""The distributed executor: one rank's share of an iteration under pp x dp x dp_shard x ep.

Forward/backward runs through the pipeline schedule (``pp > 1``) or a plain micro-batch
loop, with expert-parallel dispatch inside the MoE layers. Gradients are synchronised in
fp32 on the master gradients: non-expert gradients are summed over the stage's ``dp x ep``
ranks, expert gradients over ``dp`` (an expert's gradient already holds every token routed
to it from its ``ep`` peers), and both are divided by the number of data shards, so the
update is the one for the mean loss over the global batch. With ``dp_shard > 1`` FSDP2
has summed each gradient over the shard group already (a reduce-scatter in backward), and
the sums above run on the local shards. Frozen operators have no gradient and take part in
no collective (they are frozen by name on every rank, so the groups stay consistent); a
sharded model freezes by restoring instead, and every gradient is reduced. The global grad
norm, the loss and the routing telemetry are combined by exact all-reduces of vectors in
which every entry comes from one rank (a sharded parameter has an entry per shard).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_moe_ckpt.core.layout import Coordinates, ParallelPlan, mesh_coordinates
from lightning_moe_ckpt.core.operators import is_expert_parameter, local_tensor
from lightning_moe_ckpt.core.precision import compute_dtype
from lightning_moe_ckpt.models.transformer import MoETransformer
from lightning_moe_ckpt.parallel.expert_parallel import (
    disable_expert_parallel,
    enable_expert_parallel,
)
from lightning_moe_ckpt.parallel.fsdp import apply_fsdp
from lightning_moe_ckpt.parallel.partition import build_rank_model, stage_modules
from lightning_moe_ckpt.parallel.pipeline import BoundaryHook, PipelineRunner
from lightning_moe_ckpt.training.engine import TrainingEngine
from lightning_moe_ckpt.training.executor import (
    Backward,
    IterationStats,
    LossFn,
    accumulate_microbatches,
    norm_vector,
)
from lightning_moe_ckpt.training.iteration import language_model_loss
from lightning_moe_ckpt.training.settings import TrainingSettings


@dataclass(frozen=True)
class ProcessGroups:
    """The process groups of one rank, taken from the ``("pp", "dp", "dp_shard", "ep")``
    mesh."""

    world: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    ep: dist.ProcessGroup
    stage: dist.ProcessGroup  # dp x dp_shard x ep ranks of this pipeline stage
    replicas: dist.ProcessGroup  # dp x ep ranks holding the same shard of the stage

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> ProcessGroups:
        """Groups of the calling rank in ``mesh`` (created on the first call, in the same
        order on every rank)."""
        stage = mesh["dp", "dp_shard", "ep"]._flatten("stage").get_group()
        replicas = stage
        if mesh["dp_shard"].size() > 1:
            replicas = mesh["dp", "ep"]._flatten("dp_ep").get_group()
        world = dist.group.WORLD
        assert world is not None
        return cls(world, mesh.get_group("pp"), mesh.get_group("dp"), mesh.get_group("ep"),
                   stage, replicas)


def full_model_parameter_names(settings: TrainingSettings) -> list[str]:
    """Parameter FQNs of the full model in model order (built on the meta device)."""
    with torch.device("meta"):
        return [name for name, _ in MoETransformer(settings.model).named_parameters()]


class DistributedExecutor:
    """Executor for one rank of a ``pp x dp x ep`` layout."""

    def __init__(self, model: MoETransformer, plan: ParallelPlan, coords: Coordinates,
                 groups: ProcessGroups, full_names: list[str], n_layers: int,
                 runner: PipelineRunner | None) -> None:
        self.model = model
        self.plan = plan
        self.groups = groups
        self.runner = runner
        self.iteration = 0
        # During a localized replay only the recovery scope runs: no collective may span
        # the world, and forward/backward passes are counted (paused ranks run none).
        self.replaying = False
        self.forward_backward_calls = 0
        self.index = {name: i for i, name in enumerate(full_names)}
        self.n_layers = n_layers
        names = [name for name, _ in model.named_parameters()]
        self.is_expert = {name: is_expert_parameter(name) for name in names}
        # Each parameter's norm is contributed by exactly one of its replicas; a sharded
        # parameter's by one replica of each shard, in a slot of its own.
        self.owns_norm = {name: coords.dp == 0 and (self.is_expert[name] or coords.ep == 0)
                          for name in names}
        shards = plan.dp_shard
        self.norm_size = len(full_names) * shards
        self.norm_index = {name: index * shards + coords.dp_shard
                           for name, index in self.index.items()}

    def release(self) -> None:
        """Drop every reference this executor holds to its process groups: the pipeline
        (its stages and their pending operations), the gradient-sync groups and the model's
        expert dispatch. A recovery does this before forming new groups, and replaces the
        executor then; it runs nothing in between. Idempotent: a recovery interrupted
        before it built the new executor releases this one again."""
        self.runner = None
        vars(self).pop("groups", None)
        disable_expert_parallel(self.model)

    def reset_stats(self) -> None:
        self.model.reset_stats()

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor,
                         loss_fn: LossFn, backward: Backward) -> torch.Tensor:
        iteration = self.iteration
        self.iteration += 1
        self.forward_backward_calls += 1
        if self.runner is not None:
            return self.runner.run(iteration, inputs, targets)
        return accumulate_microbatches(self.model, inputs, targets, loss_fn, backward)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor,
                 loss_fn: LossFn) -> tuple[torch.Tensor, int]:
        microbatches = inputs.shape[0]
        if self.runner is not None:
            loss_sum = self.runner.evaluate(inputs, targets)
            tokens = targets.numel() if self.runner.has_last else 0
        else:
            loss_sum = torch.zeros((), dtype=torch.float32, device=inputs.device)
            for index in range(microbatches):
                loss_sum = loss_sum + loss_fn(self.model(inputs[index]), targets[index])
            tokens = targets.numel()
        return loss_sum / microbatches, tokens

    def warm_up(self, micro_batch: int, seq_len: int) -> None:
        """One training-mode forward/backward of zero tokens on every rank, its gradients
        and statistics dropped: a freshly built pipeline schedule exchanges its start-up
        messages with its neighbours here, together, and not later in a localized replay
        where the neighbours are paused (collective)."""
        if self.runner is None:
            return
        device = next(self.model.parameters()).device
        shape = (self.plan.microbatches, micro_batch, seq_len)
        tokens = torch.zeros(shape, dtype=torch.int64, device=device)
        self.runner.run(-1, tokens, tokens)  # iteration -1: the boundary hooks stay silent
        self.model.zero_grad(set_to_none=True)
        self.model.reset_stats()

    def reduce_gradients(self, grads: Mapping[str, torch.Tensor]) -> None:
        shards = self.plan.data_shards
        if shards == 1 or not grads:
            return
        local = {name: local_tensor(grad) for name, grad in grads.items()}
        pending = []
        for name, grad in local.items():
            group = self.groups.dp if self.is_expert[name] else self.groups.replicas
            if dist.get_world_size(group) > 1:
                pending.append(dist.all_reduce(grad, group=group, async_op=True))
        for work in pending:
            assert work is not None
            work.wait()
        torch._foreach_div_(list(local.values()), shards)

    def grad_norm(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        device = next(self.model.parameters()).device
        owned = {name: local_tensor(grad) for name, grad in grads.items()
                 if self.owns_norm[name]}
        vector = norm_vector(owned, self.norm_index, self.norm_size, device)
        if not self.replaying:  # replay supplies the logged clip coefficient instead
            dist.all_reduce(vector, group=self.groups.world)
        return torch.linalg.vector_norm(vector)

    def iteration_stats(self, loss_sum: torch.Tensor, microbatches: int) -> IterationStats:
        moe_layers = self.model.moe_layers()
        n_experts = self.plan.n_experts
        device = loss_sum.device
        load = torch.zeros(self.n_layers, n_experts, device=device)
        soft = torch.zeros(self.n_layers, n_experts, device=device)
        aux = torch.zeros((), device=device)
        dropped = torch.zeros((), device=device)
        for layer, moe in moe_layers.items():
            load[layer] = moe.gate.hard_counts
            soft[layer] = moe.gate.soft_counts
            aux = aux + moe.aux_loss_sum
            dropped = dropped + moe.dropped_assignments
        packed = torch.cat([loss_sum.reshape(1), aux.reshape(1), dropped.reshape(1),
                            load.flatten(), soft.flatten()])
        if not self.replaying:
            dist.all_reduce(packed, group=self.groups.world)
        scale = self.plan.data_shards * microbatches
        cells = self.n_layers * n_experts
        return IterationStats(loss=packed[0] / scale, aux_loss=packed[1] / scale,
                              expert_load=packed[3:3 + cells].view(self.n_layers, n_experts),
                              dropped=packed[2],
                              soft_load=packed[3 + cells:].view(self.n_layers, n_experts))


def build_parallel_executor(settings: TrainingSettings, mesh: DeviceMesh, model: MoETransformer,
                            device: torch.device,
                            hooks: list[BoundaryHook] | None = None) -> DistributedExecutor:
    """The executor of this rank's ``model`` over ``mesh``: expert-parallel dispatch, the
    pipeline schedule and the gradient sync groups. Built again over the same model when
    the process groups are re-formed after a failure."""
    plan = settings.layout
    coords = mesh_coordinates(mesh)
    groups = ProcessGroups.from_mesh(mesh)
    dtype = compute_dtype(settings.precision)
    if plan.ep > 1:
        enable_expert_parallel(model, groups.ep, plan.local_experts(coords.ep))
    runner = None
    if plan.pp > 1:
        runner = PipelineRunner(
            stage_modules(model, plan, coords.pp), plan, coords.pp, groups.pp, device, dtype,
            settings.global_batch // (plan.microbatches * plan.data_shards),
            settings.data.seq_len, settings.model.d_model, settings.model.vocab_size,
            language_model_loss, hooks if hooks is not None else [])
    return DistributedExecutor(model, plan, coords, groups, full_model_parameter_names(settings),
                               settings.model.n_layers, runner)


def build_parallel_engine(settings: TrainingSettings, mesh: DeviceMesh, device: torch.device,
                          hooks: list[BoundaryHook] | None = None) -> TrainingEngine:
    """This rank's :class:`TrainingEngine` for ``settings.layout`` over ``mesh``; with
    ``dp_shard > 1`` its model is sharded over the ``dp_shard`` mesh dimension."""
    coords = mesh_coordinates(mesh)
    model = build_rank_model(settings.model, settings.layout, coords, settings.seed,
                             compute_dtype(settings.precision), device)
    if settings.layout.sharded:
        apply_fsdp(model, mesh["dp_shard"])
    executor = build_parallel_executor(settings, mesh, model, device, hooks)
    return TrainingEngine.around(settings, model, executor)
