"""What the Fabric and the Trainer ``MoEParallelStrategy`` share: layout, mesh, engine.

The core resolves the layout against the launcher's world size (``dp="auto"`` takes what
``pp x ep`` leaves), builds the ``("pp", "dp", "ep")`` DeviceMesh once the process group
exists, and builds each rank's :class:`~lightning_moe_ckpt.training.engine.TrainingEngine`
for a run. It holds no Lightning state, so both strategy classes stay thin.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_moe_ckpt.core.layout import MESH_DIMS, SCHEDULES, Coordinates
from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.parallel.pipeline import BoundaryHook
from lightning_moe_ckpt.training.distributed_executor import (
    DistributedExecutor,
    ProcessGroups,
    build_parallel_engine,
    build_parallel_executor,
)
from lightning_moe_ckpt.training.engine import TrainingEngine
from lightning_moe_ckpt.training.settings import TrainingSettings


class MoEParallelCore:
    """Layout, device mesh and engine construction for one rank.

    Args:
        pp: Pipeline stages.
        dp: Data-parallel replicas; ``"auto"``: what ``pp x ep`` leaves of the world size.
        ep: Expert-parallel ranks; must divide the model's experts.
        schedule: The pipeline schedule, ``"1f1b"`` or ``"interleaved_1f1b"``.

    Raises:
        ConfigError: An unknown ``schedule``.
    """

    def __init__(self, pp: int = 1, dp: int | str = "auto", ep: int = 1,
                 schedule: str = "1f1b") -> None:
        if schedule not in SCHEDULES:
            raise ConfigError(f"parallel.schedule={schedule!r} is unknown; choose one of "
                              f"{', '.join(SCHEDULES)}")
        self.pp, self.ep, self.schedule = pp, ep, schedule
        self.dp: int | str = dp
        self.mesh: DeviceMesh | None = None
        self.boundary_hooks: list[BoundaryHook] = []

    def resolve(self, world_size: int) -> None:
        """Fix ``dp`` and check ``pp x dp x ep`` against the launcher (before launching)."""
        if self.dp == "auto":
            if world_size % (self.pp * self.ep):
                raise ConfigError(
                    f"world size {world_size} is not divisible by parallel.pp={self.pp} x "
                    f"parallel.ep={self.ep}")
            self.dp = world_size // (self.pp * self.ep)
        if not isinstance(self.dp, int) or self.pp * self.dp * self.ep != world_size:
            raise ConfigError(
                f"parallel.pp={self.pp} x parallel.dp={self.dp} x parallel.ep={self.ep} = "
                f"{self.pp * int(self.dp) * self.ep} processes, but the launcher provides "
                f"world size {world_size} (devices x nodes)")

    def setup_mesh(self, device_type: str) -> DeviceMesh:
        """Build the mesh and every process group the executors use (the default process
        group must exist).

        Creating a group is collective over the world, so all of them are created here,
        at one point every process reaches in the same order (at launch, and again when
        the groups are re-formed after a failure), never later inside an iteration or a
        recovery that only some ranks run. Later lookups hit the mesh's cache."""
        assert isinstance(self.dp, int), "resolve() runs before setup_mesh()"
        self.mesh = init_device_mesh(device_type, (self.pp, self.dp, self.ep),
                                     mesh_dim_names=MESH_DIMS)
        ProcessGroups.from_mesh(self.mesh)  # the stage's dp x ep group, flattened
        return self.mesh

    @property
    def coordinates(self) -> Coordinates:
        """This rank's ``(pp, dp, ep)`` position."""
        if self.mesh is None:
            raise RuntimeError("the device mesh exists only after the strategy's set-up")
        pp, dp, ep = (int(c) for c in self.mesh.get_coordinate() or (0, 0, 0))
        return Coordinates(pp, dp, ep)

    @property
    def data_shard(self) -> int:
        """Which data shard this rank reads: the same for every stage of a pipeline."""
        coords = self.coordinates
        return coords.dp * self.ep + coords.ep

    def build_engine(self, settings: TrainingSettings, device: torch.device) -> TrainingEngine:
        """This rank's engine for ``settings`` (whose layout must match the strategy's; the
        micro-batch count comes from ``settings.layout``)."""
        if self.mesh is None:
            raise RuntimeError("the device mesh exists only after the strategy's set-up")
        plan = settings.layout
        wanted = (self.pp, self.dp, self.ep, self.schedule)
        if (plan.pp, plan.dp, plan.ep, plan.schedule) != wanted:
            raise ConfigError(
                f"run settings ask for parallel.pp={plan.pp} parallel.dp={plan.dp} "
                f"parallel.ep={plan.ep} parallel.schedule={plan.schedule!r}, but the strategy "
                f"was built with pp={self.pp} dp={self.dp} ep={self.ep} "
                f"schedule={self.schedule!r}")
        return build_parallel_engine(settings, self.mesh, device, self.boundary_hooks)

    def release(self, engine: TrainingEngine) -> None:
        """Before a recovery forms new process groups: drop every reference to the broken
        ones, the mesh's and ``engine``'s executor's, so that their connections close and a
        peer blocked on this rank fails at once (:meth:`reform` builds them anew)."""
        executor = engine.executor
        if isinstance(executor, DistributedExecutor):
            executor.release()
        self.release_mesh()

    def release_mesh(self) -> None:
        """Drop the mesh, whose registry holds every group it created by name (a dict of
        bound objects the garbage collector does not see, so only dropping the mesh frees
        them); :meth:`setup_mesh` builds it anew."""
        self.mesh = None

    def reform(self, engine: TrainingEngine, device: torch.device) -> None:
        """After the default process group was formed anew (a failure replaced a rank):
        rebuild the mesh and ``engine``'s executor over its live model, in the order a
        fresh process builds them (so the collective group creations pair up)."""
        mesh = self.setup_mesh(device.type)
        executor = build_parallel_executor(engine.settings, mesh, engine.model, device,
                                           self.boundary_hooks)
        executor.iteration = engine.step
        engine.executor = executor
