"""Which ranks share a machine: from the launcher, so that replicas go to other nodes.

Replica placement puts a rank's snapshot replicas on other nodes first, so that a whole
node lost at once loses no snapshot. The number of ranks per node comes from the launcher
that started the job: ``MOE_RANKS_PER_NODE`` (the supervisor's ``--ranks-per-node``, the
recipe's ``parallel.ranks_per_node``: nodes of several ranks on one machine, for tests),
``LOCAL_WORLD_SIZE`` (torchrun), ``SLURM_NTASKS_PER_NODE`` or
``SLURM_STEP_TASKS_PER_NODE`` (SLURM, e.g. ``8(x2)``), else what the caller knows (the
devices per node Lightning was given). Node ``n`` runs ranks ``n * R`` to ``n * R + R - 1``
(``R`` ranks per node), as torchrun and SLURM's block distribution place them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from lightning_moe_ckpt.errors import ConfigError

__all__ = ["ENV_RANKS_PER_NODE", "launcher_node_size", "launcher_ranks_per_node", "node_of"]

ENV_RANKS_PER_NODE = "MOE_RANKS_PER_NODE"  # the supervisor's --ranks-per-node

_SLURM_TASKS = re.compile(r"^(\d+)(?:\(x\d+\))?(?:,|$)")


def launcher_ranks_per_node(fallback: int, environ: Mapping[str, str] | None = None) -> int:
    """Ranks per node as the launcher says, else ``fallback`` (at least 1).

    Raises:
        ConfigError: A launcher variable that is not a positive count.
    """
    size = launcher_node_size(environ)
    return size if size is not None else max(1, fallback)


def launcher_node_size(environ: Mapping[str, str] | None = None) -> int | None:
    """Ranks per node as the launcher says (None: it says nothing).

    Raises:
        ConfigError: A launcher variable that is not a positive count.
    """
    env = os.environ if environ is None else environ
    for key in (ENV_RANKS_PER_NODE, "LOCAL_WORLD_SIZE"):
        value = env.get(key)
        if value is not None:
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"{key}={value!r} (from the launcher) must be a positive "
                                  "integer")
            return int(value)
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        value = env.get(key)
        if value is None:
            continue
        match = _SLURM_TASKS.match(value)
        if match is None or int(match.group(1)) < 1:
            raise ConfigError(f"{key}={value!r} (from SLURM) is not a task count per node")
        return int(match.group(1))  # uneven allocations: the first node's count
    return None


def node_of(rank: int, ranks_per_node: int) -> int:
    """The node that runs ``rank``."""
    return rank // ranks_per_node
