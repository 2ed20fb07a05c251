"""Parallel topology: world = pp x dp x dp_shard x ep, rank coordinates, stage and expert
placement.

Ranks are laid out with ``ep`` fastest and ``pp`` slowest (mesh dims
``("pp", "dp", "dp_shard", "ep")``), so the expert-parallel all-to-all stays inside a node
and a pipeline stage's ``dp x dp_shard x ep`` ranks are contiguous. Within each stage:

* layers are split into contiguous, balanced blocks (earlier stages take the remainder);
  stage 0 also owns the embedding, the last stage the output head;
* each MoE layer's experts are sharded over ``ep`` in contiguous blocks;
* with ``dp_shard > 1`` every parameter (and so its optimizer state) is sharded by FSDP2
  over the ``dp_shard`` ranks that hold the same stage and experts (a shard group);
* non-expert parameters (or their shards) are replicated over the stage's ``dp x ep``
  ranks, expert parameters over ``dp``; every ``dp x dp_shard x ep`` rank of a stage reads
  a different data shard.

:meth:`ParallelPlan.validate` rejects any layout that cannot run, naming keys and values,
before a single process is started.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_moe_ckpt.errors import ConfigError, require
from lightning_moe_ckpt.models.config import MoEModelConfig

SCHEDULES = ("1f1b", "interleaved_1f1b")
MESH_DIMS = ("pp", "dp", "dp_shard", "ep")


@dataclass(frozen=True)
class Coordinates:
    """A rank's position in the ``pp x dp x dp_shard x ep`` grid.

    Args:
        pp: Pipeline position (stage group).
        dp: Data-parallel replica.
        ep: Expert-parallel rank.
        dp_shard: Position in its shard group (which shard of the parameters it holds).
    """

    pp: int
    dp: int
    ep: int
    dp_shard: int = 0


@dataclass(frozen=True)
class ParallelPlan:
    """A validated parallel layout for one model.

    Build it with :meth:`validate`, which checks it against the model; the constructor
    checks nothing.

    Args:
        pp: Pipeline ranks.
        dp: Data-parallel replicas.
        ep: Expert-parallel ranks.
        microbatches: Micro-batches per iteration.
        n_layers: The model's decoder layers.
        n_experts: The model's routed experts per MoE layer.
        schedule: The pipeline schedule, ``"1f1b"`` or ``"interleaved_1f1b"`` (two
            virtual stages per pipeline rank).
        dp_shard: Data-parallel ranks over which FSDP2 shards the parameters and their
            optimizer state (each reads its own data, as a replica does).
    """

    pp: int
    dp: int
    ep: int
    microbatches: int
    n_layers: int
    n_experts: int
    schedule: str = "1f1b"
    dp_shard: int = 1

    @property
    def world_size(self) -> int:
        """Number of processes the plan needs."""
        return self.pp * self.dp * self.dp_shard * self.ep

    @property
    def data_shards(self) -> int:
        """Ranks per stage that see different data."""
        return self.dp * self.dp_shard * self.ep

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 shards the parameters (``dp_shard > 1``)."""
        return self.dp_shard > 1

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages (virtual stages) each pipeline rank holds."""
        return 2 if self.schedule == "interleaved_1f1b" and self.pp > 1 else 1

    @property
    def num_stages(self) -> int:
        """Total pipeline stages, counting virtual stages of interleaved schedules."""
        return self.pp * self.stages_per_rank

    @classmethod
    def validate(cls, *, pp: int, dp: int, ep: int, microbatches: int, schedule: str,
                 model: MoEModelConfig, world_size: int | None = None,
                 dp_shard: int = 1) -> ParallelPlan:
        """Check a layout against the model and (optionally) the launcher's world size."""
        for key, value in (("pp", pp), ("dp", dp), ("dp_shard", dp_shard), ("ep", ep),
                           ("microbatches", microbatches)):
            require(isinstance(value, int) and value >= 1,
                    f"parallel.{key}={value} must be an integer >= 1")
        require(schedule in SCHEDULES,
                f"parallel.schedule={schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
        plan = cls(pp, dp, ep, microbatches, model.n_layers, model.n_experts, schedule,
                   dp_shard)
        if world_size is not None and world_size != plan.world_size:
            raise ConfigError(
                f"{plan.describe()} = {plan.world_size} processes, but the launcher provides "
                f"world size {world_size}")
        require(model.n_experts % ep == 0,
                f"model.n_experts={model.n_experts} is not divisible by parallel.ep={ep}")
        require(model.n_layers >= plan.num_stages,
                f"model.n_layers={model.n_layers} is fewer than the {plan.num_stages} pipeline "
                f"stages of parallel.pp={pp} with parallel.schedule={schedule!r}")
        require(microbatches >= pp,
                f"parallel.microbatches={microbatches} is fewer than parallel.pp={pp} "
                "pipeline stages")
        if plan.stages_per_rank > 1:
            require(microbatches % pp == 0,
                    f"parallel.microbatches={microbatches} must be a multiple of parallel.pp={pp} "
                    "for parallel.schedule='interleaved_1f1b'")
        return plan

    def describe(self) -> str:
        """The layout as its settings, e.g. ``parallel.pp=2 x parallel.dp=1 x ...``."""
        return describe_layout(self.pp, self.dp, self.ep, self.dp_shard)

    def coordinates(self, rank: int) -> Coordinates:
        """Grid position of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        return Coordinates(rank // (self.dp * self.dp_shard * self.ep),
                           (rank // (self.dp_shard * self.ep)) % self.dp, rank % self.ep,
                           (rank // self.ep) % self.dp_shard)

    def rank_of(self, coords: Coordinates) -> int:
        """Global rank at a grid position."""
        return (((coords.pp * self.dp + coords.dp) * self.dp_shard + coords.dp_shard)
                * self.ep + coords.ep)

    def shard_group(self, rank: int) -> int:
        """The shard group of ``rank``, named by its first rank: the ``dp_shard`` ranks
        that hold the same stage, replica index and experts (each rank alone when
        ``dp_shard`` is 1)."""
        return self.rank_of(replace(self.coordinates(rank), dp_shard=0))

    def data_shard(self, coords: Coordinates) -> int:
        """Which data shard the rank at ``coords`` reads (the same on every stage)."""
        return (coords.dp * self.dp_shard + coords.dp_shard) * self.ep + coords.ep

    def stage_layers(self, stage: int) -> list[int]:
        """Layer indices of pipeline stage ``stage`` (of ``num_stages``)."""
        base, extra = divmod(self.n_layers, self.num_stages)
        start = stage * base + min(stage, extra)
        return list(range(start, start + base + (1 if stage < extra else 0)))

    def stages_of(self, pp_rank: int) -> list[int]:
        """Stage indices a pipeline rank holds (looped placement for interleaved schedules)."""
        return [pp_rank + v * self.pp for v in range(self.stages_per_rank)]

    def local_experts(self, ep_rank: int) -> range:
        """Global ids of the experts an expert-parallel rank owns."""
        per_rank = self.n_experts // self.ep
        return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)

    def stage_group_ranks(self, pp_rank: int) -> list[int]:
        """The ``dp x dp_shard x ep`` global ranks of one pipeline stage."""
        return [self.rank_of(Coordinates(pp_rank, d, e, s))
                for d in range(self.dp) for s in range(self.dp_shard) for e in range(self.ep)]


def describe_layout(pp: int, dp: int | str | None, ep: int, dp_shard: int) -> str:
    """A layout as its settings, e.g. ``parallel.pp=2 x parallel.dp=1 x parallel.ep=2``.

    Args:
        pp: Pipeline ranks.
        dp: Data-parallel replicas; ``None``: left out (not resolved yet).
        ep: Expert-parallel ranks.
        dp_shard: Shard-group size; named only when above 1.

    Returns:
        The settings joined by `` x ``.
    """
    sizes: list[tuple[str, object]] = [("pp", pp), ("dp", dp), ("ep", ep)]
    if dp_shard > 1:
        sizes.insert(2, ("dp_shard", dp_shard))
    return " x ".join(f"parallel.{key}={value}" for key, value in sizes if value is not None)


def build_mesh(plan: ParallelPlan, device_type: str) -> DeviceMesh:
    """The ``("pp", "dp", "dp_shard", "ep")`` device mesh of ``plan`` (collective: the
    default process group must exist).

    Args:
        plan: The parallel layout.
        device_type: ``"cpu"`` or ``"cuda"``.

    Returns:
        The mesh over every rank of the world.
    """
    return init_device_mesh(device_type, (plan.pp, plan.dp, plan.dp_shard, plan.ep),
                            mesh_dim_names=MESH_DIMS)


def mesh_coordinates(mesh: DeviceMesh) -> Coordinates:
    """The calling rank's position in a mesh built by :func:`build_mesh`.

    Args:
        mesh: The layout's mesh.

    Returns:
        The rank's coordinates.
    """
    pp, dp, dp_shard, ep = (int(c) for c in mesh.get_coordinate() or (0, 0, 0, 0))
    return Coordinates(pp, dp, ep, dp_shard)
