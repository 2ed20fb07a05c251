"""Materialise one rank's part of the model: its pipeline stages and its expert block.

The rank's part is built on the meta device, pruned to the layers of its stages and the
experts of its expert-parallel block, then materialised and initialised by the
per-parameter seeded initialiser, so every parameter equals, bitwise, the same parameter
of the full single-process model. All of a rank's layers live in one
:class:`MoETransformer` (parameter names identical to the full model); each pipeline stage
is a :class:`StageModule` view that shares those layers.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_moe_ckpt.core.layout import Coordinates, ParallelPlan
from lightning_moe_ckpt.models.config import MoEModelConfig
from lightning_moe_ckpt.models.transformer import (
    Embedding,
    MoETransformer,
    OutputHead,
    run_blocks,
)


class StageModule(nn.Module):
    """One pipeline stage: a view over some layers of the rank's model (shared modules)."""

    def __init__(self, model: MoETransformer, layer_ids: list[int], first: bool,
                 last: bool) -> None:
        super().__init__()
        self.embed: Embedding | None = model.embed if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
        self.head: OutputHead | None = model.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_blocks(self.embed, self.layers, self.head, x)


def build_rank_model(cfg: MoEModelConfig, plan: ParallelPlan, coords: Coordinates, seed: int,
                     dtype: torch.dtype, device: torch.device) -> MoETransformer:
    """The layers, experts, embedding and head this rank owns, initialised and cast."""
    with torch.device("meta"):
        model = MoETransformer(cfg, seed=seed)
    stages = plan.stages_of(coords.pp)
    owned_layers = {layer for stage in stages for layer in plan.stage_layers(stage)}
    for key in list(model.layers):
        if int(key) not in owned_layers:
            del model.layers[key]
    if 0 not in stages:
        model.embed = None
    if plan.num_stages - 1 not in stages:
        model.head = None
    local = {str(e) for e in plan.local_experts(coords.ep)}
    for moe in model.moe_layers().values():
        for key in list(moe.experts):
            if key not in local:
                del moe.experts[key]
    model.to_empty(device=device)
    model.init_weights(seed)
    model.reset_stats()  # buffers of an empty-materialised model hold garbage
    return model.to(dtype)


def stage_modules(model: MoETransformer, plan: ParallelPlan, pp_rank: int) -> list[StageModule]:
    """The pipeline stages (one, or several when interleaved) held by ``pp_rank``."""
    return [StageModule(model, plan.stage_layers(stage), stage == 0,
                        stage == plan.num_stages - 1)
            for stage in plan.stages_of(pp_rank)]
