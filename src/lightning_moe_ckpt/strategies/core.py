"""What the Fabric and the Trainer ``MoEParallelStrategy`` share: layout, mesh, engine.

The core resolves the layout against the launcher's world size (``dp="auto"`` takes what
``pp x dp_shard x ep`` leaves), builds the ``("pp", "dp", "dp_shard", "ep")`` DeviceMesh
once the process group exists, and builds each rank's
:class:`~lightning_moe_ckpt.training.engine.TrainingEngine` for a run. It holds no
Lightning state, so both strategy classes stay thin.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_moe_ckpt.core.layout import (
    SCHEDULES,
    Coordinates,
    ParallelPlan,
    build_mesh,
    describe_layout,
    mesh_coordinates,
)
from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.parallel.fsdp import reattach_fsdp_groups, release_fsdp_groups
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
        dp: Data-parallel replicas; ``"auto"``: what ``pp x dp_shard x ep`` leaves of the
            world size.
        ep: Expert-parallel ranks; must divide the model's experts.
        schedule: The pipeline schedule, ``"1f1b"`` or ``"interleaved_1f1b"``.
        dp_shard: Data-parallel ranks over which FSDP2 shards the parameters and their
            optimizer state.

    Raises:
        ConfigError: An unknown ``schedule``, or a ``dp_shard`` below 1.
    """

    def __init__(self, pp: int = 1, dp: int | str = "auto", ep: int = 1,
                 schedule: str = "1f1b", dp_shard: int = 1) -> None:
        if schedule not in SCHEDULES:
            raise ConfigError(f"parallel.schedule={schedule!r} is unknown; choose one of "
                              f"{', '.join(SCHEDULES)}")
        if not isinstance(dp_shard, int) or dp_shard < 1:
            raise ConfigError(f"parallel.dp_shard={dp_shard!r} must be an integer >= 1")
        self.pp, self.ep, self.schedule, self.dp_shard = pp, ep, schedule, dp_shard
        self.dp: int | str = dp
        self.mesh: DeviceMesh | None = None
        # With dp_shard > 1: the mesh the sharded model's DTensors live on (the first one
        # built); a re-formed mesh's groups are handed to it by name.
        self.model_mesh: DeviceMesh | None = None
        self.boundary_hooks: list[BoundaryHook] = []

    def resolve(self, world_size: int) -> None:
        """Fix ``dp`` and check ``pp x dp x dp_shard x ep`` against the launcher (before
        launching)."""
        others = self.pp * self.dp_shard * self.ep
        if self.dp == "auto":
            if world_size % others:
                raise ConfigError(
                    f"world size {world_size} is not divisible by "
                    f"{describe_layout(self.pp, None, self.ep, self.dp_shard)}")
            self.dp = world_size // others
        if not isinstance(self.dp, int) or others * self.dp != world_size:
            raise ConfigError(
                f"{describe_layout(self.pp, self.dp, self.ep, self.dp_shard)} = "
                f"{others * int(self.dp)} processes, but the "
                f"launcher provides world size {world_size} (devices x nodes)")

    def layout_record(self, world_size: int) -> dict[str, int | str]:
        """The layout a checkpoint is written in (one file per rank), which a resume must
        use too."""
        return {"pp": self.pp, "dp": self.dp, "dp_shard": self.dp_shard, "ep": self.ep,
                "world_size": world_size}

    @property
    def plan_shape(self) -> ParallelPlan:
        """The mesh's shape as a plan (sizes only: no model, a single micro-batch)."""
        assert isinstance(self.dp, int), "resolve() runs before the mesh is built"
        return ParallelPlan(self.pp, self.dp, self.ep, 1, 1, 1, self.schedule, self.dp_shard)

    def setup_mesh(self, device_type: str) -> DeviceMesh:
        """Build the mesh and every process group the executors use (the default process
        group must exist).

        Creating a group is collective over the world, so all of them are created here,
        at one point every process reaches in the same order (at launch, and again when
        the groups are re-formed after a failure), never later inside an iteration or a
        recovery that only some ranks run. Later lookups hit the mesh's cache."""
        assert isinstance(self.dp, int), "resolve() runs before setup_mesh()"
        self.mesh = build_mesh(self.plan_shape, device_type)
        ProcessGroups.from_mesh(self.mesh)  # the stage's groups, flattened
        if self.dp_shard > 1 and self.model_mesh is None:
            self.model_mesh = self.mesh
        return self.mesh

    @property
    def coordinates(self) -> Coordinates:
        """This rank's ``(pp, dp, ep, dp_shard)`` position."""
        if self.mesh is None:
            raise RuntimeError("the device mesh exists only after the strategy's set-up")
        return mesh_coordinates(self.mesh)

    @property
    def data_shards(self) -> int:
        """How many data shards the ranks of a stage read."""
        return self.plan_shape.data_shards

    @property
    def data_shard(self) -> int:
        """Which data shard this rank reads: the same for every stage of a pipeline."""
        return self.plan_shape.data_shard(self.coordinates)

    def build_engine(self, settings: TrainingSettings, device: torch.device) -> TrainingEngine:
        """This rank's engine for ``settings`` (whose layout must match the strategy's; the
        micro-batch count comes from ``settings.layout``)."""
        if self.mesh is None:
            raise RuntimeError("the device mesh exists only after the strategy's set-up")
        plan = settings.layout
        wanted = (self.pp, self.dp, self.dp_shard, self.ep, self.schedule)
        if (plan.pp, plan.dp, plan.dp_shard, plan.ep, plan.schedule) != wanted:
            raise ConfigError(
                f"run settings ask for parallel.pp={plan.pp} parallel.dp={plan.dp} "
                f"parallel.dp_shard={plan.dp_shard} parallel.ep={plan.ep} "
                f"parallel.schedule={plan.schedule!r}, but the strategy was built with "
                f"pp={self.pp} dp={self.dp} dp_shard={self.dp_shard} ep={self.ep} "
                f"schedule={self.schedule!r}")
        return build_parallel_engine(settings, self.mesh, device, self.boundary_hooks)

    def release(self, engine: TrainingEngine) -> None:
        """Before a recovery forms new process groups: drop every reference to the broken
        ones, the mesh's and ``engine``'s executor's, so that their connections close and a
        peer blocked on this rank fails at once (:meth:`reform` builds them anew)."""
        executor = engine.executor
        if isinstance(executor, DistributedExecutor):
            executor.release()
        if self.dp_shard > 1 and self.model_mesh is not None:
            release_fsdp_groups(engine.model, self.model_mesh)
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
        if self.dp_shard > 1 and self.model_mesh is not None:
            reattach_fsdp_groups(engine.model, self.model_mesh, mesh)
        executor = build_parallel_executor(engine.settings, mesh, engine.model, device,
                                           self.boundary_hooks)
        executor.iteration = engine.step
        engine.executor = executor
