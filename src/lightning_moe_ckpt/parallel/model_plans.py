"""Plans: how a user's model splits into pipeline stages and expert shards.

A plan takes the full model (built the same way on every rank) and this rank's place in the
``("pp", "dp", "ep")`` mesh, prunes the model to what the rank holds, shards its experts
over ``ep`` and returns the rank's :class:`StagedModel`. Pruning keeps the model's own
parameter names (layers stay under their global index), so operators, snapshots and the
consolidated state are named as in the user's model, in every layout.

* Hugging Face decoder-only MoE models (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3 families
  in transformers 5.x) get a built-in plan (:mod:`~lightning_moe_ckpt.parallel.hf_plan`),
  chosen automatically (:mod:`~lightning_moe_ckpt.parallel.plan_selection`).
* Anything else brings a ``parallelize_fn(model, mesh) -> StagedModel``, the contract
  torchtitan uses: split the model into the stage modules of ``mesh``'s pipeline rank and
  shard its experts (:func:`~lightning_moe_ckpt.parallel.fused_experts.shard_fused_experts`
  does it for fused experts; :func:`stage_layer_ids` gives torchtitan's balanced split).

Everything a plan cannot run is rejected by :func:`check_layout` before any process starts
(experts not divisible by ``ep``, fewer layers than stages, no plan for the model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_moe_ckpt.core.layout import mesh_coordinates
from lightning_moe_ckpt.errors import require


@dataclass(frozen=True)
class ModelShape:
    """What a layout is checked against: decoder layers and routed experts per layer."""

    n_layers: int
    n_experts: int

    @classmethod
    def of(cls, model: nn.Module) -> ModelShape:
        """The shape of a full model, from its routed-expert operators (discovery rules)."""
        from lightning_moe_ckpt.core.discovery import discover_operators

        experts = [(op.layer, op.expert) for op in discover_operators(model)
                   if op.kind == "expert" and op.layer is not None and op.expert is not None]
        return cls(1 + max((layer for layer, _ in experts), default=-1),
                   1 + max((expert for _, expert in experts), default=-1))


@dataclass
class StagedModel:
    """One rank's part of a user's model, as a plan returns it.

    ``stages`` are the rank's pipeline stage modules (one per pipeline rank; the first
    stage maps token ids ``[b, S]`` to activations ``[b, S, hidden_size]``, the last maps
    activations to ``[b, S, output_size]`` logits, a single stage maps ids to logits).
    ``model`` is the pruned model whose parameters the optimizer steps."""

    model: nn.Module
    stages: list[nn.Module]
    hidden_size: int
    output_size: int


ParallelizeFn = Callable[[nn.Module, DeviceMesh], StagedModel]


def stage_layer_ids(n_layers: int, stages: int, stage: int) -> list[int]:
    """Contiguous, balanced layer block of ``stage`` (earlier stages take the remainder)."""
    base, extra = divmod(n_layers, stages)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (1 if stage < extra else 0)))


def mesh_position(mesh: DeviceMesh) -> tuple[int, int, int]:
    """This rank's ``(pp, dp, ep)`` coordinates in ``mesh`` (a user's split model is
    never sharded over ``dp_shard``)."""
    coords = mesh_coordinates(mesh)
    return coords.pp, coords.dp, coords.ep


def check_layout(shape: ModelShape, *, pp: int, ep: int, what: str) -> None:
    """Reject a layout the model cannot be split into, naming the model and the keys."""
    require(shape.n_experts % ep == 0,
            f"{what} has {shape.n_experts} experts per MoE layer, not divisible by "
            f"parallel.ep={ep}")
    require(shape.n_layers >= pp,
            f"{what} has {shape.n_layers} decoder layers, fewer than the {pp} pipeline "
            f"stages of parallel.pp={pp}")
