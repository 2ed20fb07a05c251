"""Which ranks share a machine: from the launcher, so that replicas go to other nodes.

Replica placement puts a rank's snapshot replicas on other nodes first, so that a whole
node lost at once loses no snapshot. The number of ranks per node comes from the launcher
that started the job: ``LOCAL_WORLD_SIZE`` (torchrun), ``SLURM_NTASKS_PER_NODE`` or
``SLURM_STEP_TASKS_PER_NODE`` (SLURM, e.g. ``8(x2)``), else what the caller knows (the
devices per node Lightning was given).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from lightning_moe_ckpt.errors import ConfigError

__all__ = ["launcher_ranks_per_node"]

_SLURM_TASKS = re.compile(r"^(\d+)(?:\(x\d+\))?(?:,|$)")


def launcher_ranks_per_node(fallback: int, environ: Mapping[str, str] | None = None) -> int:
    """Ranks per node as the launcher says, else ``fallback`` (at least 1).

    Raises:
        ConfigError: A launcher variable that is not a positive count.
    """
    env = os.environ if environ is None else environ
    local = env.get("LOCAL_WORLD_SIZE")
    if local is not None:
        if not local.isdigit() or int(local) < 1:
            raise ConfigError(f"LOCAL_WORLD_SIZE={local!r} (from the launcher) must be a "
                              "positive integer")
        return int(local)
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        value = env.get(key)
        if value is None:
            continue
        match = _SLURM_TASKS.match(value)
        if match is None or int(match.group(1)) < 1:
            raise ConfigError(f"{key}={value!r} (from SLURM) is not a task count per node")
        return int(match.group(1))  # uneven allocations: the first node's count
    return max(1, fallback)
