"""Users' own MoE models trained through a plan and the staged executor (no Lightning).

Every rank builds the full model from the same seed, the plan prunes it to the rank's
stage and experts, and a plain ``torch.optim.AdamW`` steps what is left. Each step's
global batch is ``[shards, M, b, S]`` random tokens drawn from a generator seeded by the
step; shard ``dp * ep + ep_rank`` is this rank's. The single-process reference runs all
``shards x M`` micro-batches in one stage, which is what a layout with one data shard
runs too. Rank 0 returns the full state, expert shards concatenated in ``ep`` order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_moe_ckpt.core.layout import ParallelPlan, build_mesh, mesh_coordinates
from lightning_moe_ckpt.core.registry import OperatorRegistry
from lightning_moe_ckpt.parallel.fused_experts import ExpertShard, shard_fused_experts
from lightning_moe_ckpt.parallel.model_plans import (
    ParallelizeFn,
    StagedModel,
    mesh_position,
    stage_layer_ids,
)
from lightning_moe_ckpt.parallel.plan_selection import resolve_plan
from lightning_moe_ckpt.training.distributed_executor import ProcessGroups
from lightning_moe_ckpt.training.staged_executor import StagedExecutor

MICROBATCHES, MICRO_BATCH, SEQ = 2, 2, 16


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of one micro-batch."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def global_batch(step: int, shards: int, vocab: int) -> torch.Tensor:
    """``[shards, M, b, S + 1]`` tokens of ``step``."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (shards, MICROBATCHES, MICRO_BATCH, SEQ + 1),
                         generator=generator)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, ep_group: Any,
                ) -> dict[str, dict[str, torch.Tensor]]:
    """``{name: {"param", "exp_avg", "exp_avg_sq"}}`` of this rank, expert shards gathered."""
    shards = {id(p) for m in model.modules() if isinstance(m, ExpertShard)
              for p in m.parameters(recurse=False)}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in model.named_parameters():
        tensors = {"param": param.detach(), **{k: v for k, v in optimizer.state[param].items()
                                                if k != "step"}}
        tensors = {k: v.full_tensor() if isinstance(v, DTensor) else v
                   for k, v in tensors.items()}
        if id(param) in shards:
            for key, tensor in tensors.items():
                parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(ep_group))]
                dist.all_gather(parts, tensor.contiguous(), group=ep_group)
                tensors[key] = torch.cat(parts)
        state[name] = {k: v.clone() for k, v in tensors.items()}
    return state


def train_staged(builder: Callable[..., nn.Module], pp: int, ep: int, steps: int,
                 parallelize_fn: ParallelizeFn | None = None, shards: int | None = None,
                 dp_shard: int = 1) -> dict[str, Any]:
    """Train ``builder(seed=0)`` for ``steps`` under ``pp x dp x dp_shard x ep`` (dp from
    the world); on one process ``shards`` names how many data shards to run as
    micro-batches."""
    torch.use_deterministic_algorithms(True)
    world = dist.get_world_size()
    dp = world // (pp * dp_shard * ep)
    mesh = build_mesh(ParallelPlan(pp, dp, ep, 1, 0, 0, dp_shard=dp_shard), "cpu")
    model = builder(seed=0)
    full_names = [name for name, _ in model.named_parameters()]
    vocab = 64  # every test model's vocabulary
    plan_fn, _ = resolve_plan(model, parallelize_fn)
    staged = plan_fn(model, mesh)
    coords = mesh_coordinates(mesh)
    data_shards = shards if world == 1 and shards else dp * dp_shard * ep
    microbatches = MICROBATCHES * (data_shards if world == 1 else 1)
    plan = ParallelPlan(pp, dp, ep, microbatches, 0, 0, dp_shard=dp_shard)
    executor = StagedExecutor(staged, plan, ProcessGroups.from_mesh(mesh), coords,
                              torch.device("cpu"), MICRO_BATCH, SEQ, token_loss, [],
                              full_names)
    optimizer = torch.optim.AdamW(staged.model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        tokens = global_batch(step, data_shards, vocab)
        mine = tokens.flatten(0, 1) if world == 1 else tokens[plan.data_shard(coords)]
        loss_sum = executor.forward_backward(mine[..., :-1], mine[..., 1:])
        executor.reduce_gradients()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(executor.global_loss(loss_sum))
    state = full_state(staged.model, optimizer, mesh.get_group("ep"))
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, state)
    merged: dict[str, dict[str, torch.Tensor]] = {}
    for part in parts:
        merged.update(part)
    names: list[Any] = [None] * world
    dist.all_gather_object(names, OperatorRegistry(staged.model).names)
    return {"state": merged, "losses": torch.stack(losses),
            "operators": sorted({name for part in names for name in part})}


class GroupedStage(nn.Module):
    """A pipeline stage of the torchtitan-style ``GroupedExpertsLM`` of the test models."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model: Any = self.model
        if model.tok_embeddings is not None:
            x = model.tok_embeddings(x)
        for layer in model.layers.values():
            x = layer(x)
        if model.output is not None:
            x = model.output(model.norm(x))
        return x


def parallelize_grouped_experts(model: nn.Module, mesh: Any) -> StagedModel:
    """A user's ``parallelize_fn`` in torchtitan's shape: prune to the stage, shard the
    experts over ``ep``."""
    lm: Any = model
    pp, ep = mesh["pp"].size(), mesh["ep"].size()
    pp_rank, _, _ = mesh_position(mesh)
    owned = stage_layer_ids(len(lm.layers), pp, pp_rank)
    for key in list(lm.layers):
        if int(key) not in owned:
            del lm.layers[key]
    if pp_rank > 0:
        lm.tok_embeddings = None
    if pp_rank < pp - 1:
        lm.norm = lm.output = None
    if ep > 1:
        for layer in lm.layers.values():
            shard_fused_experts(layer.moe.experts, mesh.get_group("ep"))
    return StagedModel(model, [GroupedStage(model)], hidden_size=lm.layers[str(owned[0])]
                       .attention_norm.weight.shape[0], output_size=64)


def split_under_dp_shard(builder: Callable[..., nn.Module],
                         parallelize_fn: ParallelizeFn) -> str:
    """Split ``builder(seed=0)`` with ``parallelize_fn`` under ``dp_shard`` = the world:
    the error the split raises (``""``: none)."""
    from lightning_moe_ckpt.errors import ConfigError
    from lightning_moe_ckpt.strategies.core import MoEParallelCore
    from lightning_moe_ckpt.strategies.user_model import UserModelSplit

    core = MoEParallelCore(dp_shard=dist.get_world_size())
    core.resolve(dist.get_world_size())
    core.setup_mesh("cpu")
    try:
        UserModelSplit(core, 1, parallelize_fn).split(builder(seed=0))
    except ConfigError as error:
        return str(error)
    return ""
