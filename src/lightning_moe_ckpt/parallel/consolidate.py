"""Consolidate a distributed run's state on rank 0, keyed by layout-independent FQNs.

Every parameter is taken from exactly one of its replicas (the one at ``dp = 0`` and, for
non-expert parameters, ``ep = 0``), so the result has the same keys and layout as the
single-process ``final_state.pt`` and can be compared with it tensor by tensor. Gathering
goes through ``gather_object`` on CPU copies, which suits the model sizes this file is
written for (tests and CPU runs); cluster-sized models use the durable DCP checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from lightning_moe_ckpt.operators import is_expert_parameter
from lightning_moe_ckpt.parallel.engine import full_model_parameter_names
from lightning_moe_ckpt.parallel.topology import Coordinates
from lightning_moe_ckpt.training.engine import TrainingEngine
from lightning_moe_ckpt.training.outputs import consolidated_state


def gather_consolidated_state(engine: TrainingEngine, coords: Coordinates,
                              step: int) -> dict[str, Any] | None:
    """The full dense state on rank 0 (``None`` on the other ranks)."""
    local = consolidated_state(engine.model, engine.optimizer, step)

    def owned(name: str) -> bool:
        return coords.dp == 0 and (is_expert_parameter(name) or coords.ep == 0)

    mine = {section: {n: v for n, v in local[section].items() if owned(n)}
            for section in ("model", "compute", "optimizer")}
    gathered: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.gather_object(mine, gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, Any] = {"step": step, "model": {}, "compute": {}, "optimizer": {}}
    for part in gathered:
        assert part is not None
        for section in ("model", "compute", "optimizer"):
            merged[section].update(part[section])
    order = full_model_parameter_names(engine.settings)
    for section in ("model", "compute", "optimizer"):
        merged[section] = {n: merged[section][n] for n in order if n in merged[section]}
    return merged
