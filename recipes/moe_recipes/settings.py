"""Validated run settings built from the Hydra config, before any process or tensor exists.

:func:`settings_from_config` turns the composed ``conf/train.yaml`` into typed, frozen
dataclasses and raises :class:`~lightning_moe_ckpt.errors.ConfigError` (naming the key and
value) for anything that cannot run, so bad input fails fast and clearly. The library's
:class:`~lightning_moe_ckpt.training.settings.TrainingSettings` are the part the built-in
model trains with; :class:`RunSettings` adds the recipe's checkpointing, faults, recovery
and launch settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from omegaconf import DictConfig, OmegaConf

from lightning_moe_ckpt.core.layout import ParallelPlan
from lightning_moe_ckpt.core.nodes import launcher_node_size
from lightning_moe_ckpt.core.precision import parse_precision
from lightning_moe_ckpt.data.corpus import BYTE_VOCAB_SIZE
from lightning_moe_ckpt.errors import ConfigError, fmt, is_number, require
from lightning_moe_ckpt.models.config import MoEModelConfig
from lightning_moe_ckpt.replication.shared_slots import SAME_NODE_REPLICAS
from lightning_moe_ckpt.snapshots.checksum import require_checksum_threads
from lightning_moe_ckpt.snapshots.helper_threads import DEFAULT_HELPER_NICE, require_helper_nice
from lightning_moe_ckpt.training.settings import DataSettings, OptimSettings, TrainingSettings
from moe_recipes.run_name import register as register_run_name
from moe_recipes.statistics import require_paired_blocks

Api = Literal["trainer", "fabric"]
DATA_SOURCES = ("stdlib", "textfile")
COMMON_CHECKPOINT_KEYS = ("checksum_threads", "durable_dir", "durable_every", "durable_keep",
                          "helper_nice", "paired_blocks", "replicas", "same_node_replicas",
                          "upstream_logging", "warmup_iterations")
PARALLEL_KEYS = ("dp", "dp_shard", "ep", "microbatches", "pp", "ranks_per_node", "schedule",
                 "spare_nodes", "spares")
TRAINER_KEYS = ("global_batch", "log_every", "max_steps", "optim", "precision", "progress_bar",
                "seed", "val_batches", "val_every")

register_run_name()  # ${moe_run_name:} in conf/train.yaml


@dataclass(frozen=True)
class HardwareSettings:
    """Where the job runs (``hardware`` group; its ``cluster`` block feeds the simulator)."""

    name: str = "cpu"
    accelerator: str = "cpu"
    devices_per_node: int = 1
    nodes: int = 1
    backend: str = "gloo"
    precision: str = "32"
    pin_memory: bool = False

    @property
    def world_size(self) -> int:
        """Processes the launcher provides."""
        return self.devices_per_node * self.nodes


@dataclass(frozen=True)
class CheckpointSettings:
    """The ``checkpoint`` group: policy, replication, profiling, and the policy's options."""

    policy: str = "none"
    replicas: int = 2
    warmup_iterations: int = 3
    options: dict[str, Any] = field(default_factory=dict)
    durable_every: int | None = None
    durable_dir: str | None = None
    upstream_logging: bool = True
    durable_keep: int = 2
    same_node_replicas: str = "shared"  # a peer on the same node maps the snapshot, or copies it
    checksum_threads: int | None = None  # None: the rank's share of the cores, at most 8
    paired_blocks: int | None = None  # a measurement: snapshots in alternate blocks of N steps
    helper_nice: int = DEFAULT_HELPER_NICE  # added to the helper threads' nice value


def _checkpoint_settings(values: dict[str, Any]) -> CheckpointSettings:
    from lightning_moe_ckpt.callbacks.durable_checkpoints import check_durable_settings
    from lightning_moe_ckpt.policies.registry import setting_options
    from moe_recipes.comparisons import COMPARISON_OPTIONS, COMPARISON_POLICIES

    values = dict(values)
    given = dict(values)  # what the config said, before defaults fill in
    policy = str(values.pop("policy", "none"))
    # Names checkpoint=<policy> when unknown.
    known = COMPARISON_OPTIONS if policy in COMPARISON_POLICIES else setting_options(policy)
    replicas = values.pop("replicas", 2)
    warmup = values.pop("warmup_iterations", 3)
    durable_every = values.pop("durable_every", None)
    durable_dir = values.pop("durable_dir", None)
    durable_keep = values.pop("durable_keep", 2)
    check_durable_settings(durable_every, durable_dir, durable_keep)
    upstream_logging = values.pop("upstream_logging", True)
    same_node_replicas = values.pop("same_node_replicas", "shared")
    checksum_threads = values.pop("checksum_threads", None)
    require_checksum_threads(checksum_threads)
    paired_blocks = values.pop("paired_blocks", None)
    require_paired_blocks(paired_blocks)
    helper_nice = values.pop("helper_nice", DEFAULT_HELPER_NICE)
    require_helper_nice(helper_nice)
    require(same_node_replicas in SAME_NODE_REPLICAS,
            f"{fmt('checkpoint.same_node_replicas', same_node_replicas)} must be one of "
            f"{', '.join(SAME_NODE_REPLICAS)}")
    require(isinstance(upstream_logging, bool),
            f"{fmt('checkpoint.upstream_logging', upstream_logging)} must be true or false")
    unknown = sorted(set(values) - known)
    require(not unknown, f"unknown key(s) {', '.join('checkpoint.' + k for k in unknown)} for "
                         f"checkpoint={policy}; it accepts "
                         f"{', '.join(sorted(known | set(COMMON_CHECKPOINT_KEYS)))}")
    require(isinstance(replicas, int) and replicas >= 0,
            f"{fmt('checkpoint.replicas', replicas)} must be an integer >= 0")
    require(isinstance(warmup, int) and warmup >= 1,
            f"{fmt('checkpoint.warmup_iterations', warmup)} must be an integer >= 1")
    if policy == "none" or policy in COMPARISON_POLICIES:  # settings these would ignore
        require(given.get("replicas", 0) == 0,
                f"{fmt('checkpoint.replicas', replicas)} has no effect with "
                f"checkpoint={policy}, which keeps no replicas; leave it at 0")
        require("same_node_replicas" not in given,
                f"{fmt('checkpoint.same_node_replicas', same_node_replicas)} has no effect "
                f"with checkpoint={policy}, which keeps no replicas; leave it out")
        require(durable_every is None,
                f"{fmt('checkpoint.durable_every', durable_every)} has no effect with "
                f"checkpoint={policy}; durable checkpoints come with the sparse and dense "
                "in-memory policies")
        require(checksum_threads is None,
                f"{fmt('checkpoint.checksum_threads', checksum_threads)} has no effect with "
                f"checkpoint={policy}, which takes no snapshots to checksum; leave it null")
        require(paired_blocks is None,
                f"{fmt('checkpoint.paired_blocks', paired_blocks)} has no effect with "
                f"checkpoint={policy}, which takes no snapshots; leave it null")
        require("helper_nice" not in given,
                f"{fmt('checkpoint.helper_nice', helper_nice)} has no effect with "
                f"checkpoint={policy}, which runs no helper threads of this library; "
                "leave it out")
    return CheckpointSettings(policy, replicas, warmup, values, durable_every, durable_dir,
                              upstream_logging, durable_keep, same_node_replicas,
                              checksum_threads, paired_blocks, helper_nice)


@dataclass(frozen=True)
class RecoverySettings:
    """How real failures are detected and how often a rank may be replaced."""

    # A worker whose heartbeat (one per iteration) is silent this long is hung and killed.
    # Sized for CPU tests; on a GPU cluster allow a few iterations plus data loading and
    # checkpoint I/O (minutes), and set the collective timeout to match.
    timeout_s: float = 60.0
    max_restarts: int = 3  # replacements before the job gives up
    # Run the workers under the supervisor: "auto" when real faults are injected or warm
    # spares are asked for; true for any multi-process job (real failures from
    # outside, e.g. a kill -9, are then recovered); false never.
    supervise: bool | str = "auto"
    # Fork the supervised workers (and replacements, spares) from a fork server that imported
    # torch, Lightning, Hydra and the library once, instead of starting fresh interpreters.
    fork_workers: bool = True
    # After a SIGTERM to the job (a preemption): how long the ranks have to commit a durable
    # checkpoint of the step they stop at and exit, before the supervisor kills them.
    preempt_grace_s: float = 20.0


def _recovery_settings(values: Mapping[str, Any]) -> RecoverySettings:
    settings = _pick(values, "recovery", RecoverySettings)
    require(isinstance(settings.timeout_s, int | float) and settings.timeout_s > 0,
            f"{fmt('recovery.timeout_s', settings.timeout_s)} must be > 0 seconds")
    require(isinstance(settings.max_restarts, int) and settings.max_restarts >= 0,
            f"{fmt('recovery.max_restarts', settings.max_restarts)} must be an integer >= 0")
    require(is_number(settings.preempt_grace_s) and settings.preempt_grace_s > 0,
            f"{fmt('recovery.preempt_grace_s', settings.preempt_grace_s)} must be > 0 seconds "
            "(well under the scheduler's time from SIGTERM to SIGKILL: SLURM's KillWait, 30 s "
            "by default)")
    require(settings.supervise in (True, False, "auto"),
            f"{fmt('recovery.supervise', settings.supervise)} must be auto, true or false")
    require(isinstance(settings.fork_workers, bool),
            f"{fmt('recovery.fork_workers', settings.fork_workers)} must be true or false")
    return settings


@dataclass(frozen=True, kw_only=True)
class RunSettings(TrainingSettings):
    """Everything one training run of the recipe needs."""

    hardware: HardwareSettings = field(default_factory=HardwareSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    api: Api = "trainer"
    progress_bar: bool = True
    out_dir: str = "outputs"
    ckpt_path: str | None = None
    faults: dict[str, Any] = field(default_factory=dict)
    recovery: RecoverySettings = field(default_factory=RecoverySettings)
    spares: int = 0  # warm spare processes that take a failed rank (real failures)
    # Ranks per node (node n runs ranks n*R..n*R+R-1; None: the launcher's, else one node)
    # and spare nodes, each taking over a node whose ranks all failed.
    ranks_per_node: int | None = None
    spare_nodes: int = 0


def _nodes(parallel: Mapping[str, Any], world_size: int) -> tuple[int | None, int]:
    """``parallel.ranks_per_node`` (else the launcher's, SLURM's tasks per node, when it
    divides the world size) and ``parallel.spare_nodes``, validated."""
    ranks_per_node = parallel.get("ranks_per_node")
    launched = launcher_node_size()
    if ranks_per_node is None and launched is not None and world_size % launched == 0:
        ranks_per_node = launched
    elif ranks_per_node is not None:
        require(isinstance(ranks_per_node, int) and not isinstance(ranks_per_node, bool)
                and ranks_per_node >= 1 and world_size % ranks_per_node == 0,
                f"{fmt('parallel.ranks_per_node', ranks_per_node)} must be an integer >= 1 "
                f"that divides the world size {world_size} (pp x dp x dp_shard x ep)")
    spare_nodes = parallel.get("spare_nodes", 0)
    require(isinstance(spare_nodes, int) and not isinstance(spare_nodes, bool)
            and spare_nodes >= 0,
            f"{fmt('parallel.spare_nodes', spare_nodes)} must be an integer >= 0")
    require(spare_nodes == 0 or ranks_per_node is not None,
            f"parallel.spare_nodes={spare_nodes} needs parallel.ranks_per_node (the ranks a "
            "spare node takes over)")
    return ranks_per_node, spare_nodes


def _section(cfg: DictConfig, key: str) -> dict[str, Any]:
    node = cfg.get(key)
    if node is None:
        return {}
    return cast(dict[str, Any], OmegaConf.to_container(node, resolve=True))


def _pick(values: Mapping[str, Any], group: str, cls: type[Any],
          ignore: tuple[str, ...] = ()) -> Any:
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(values) - known - set(ignore))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(f'{group}.{k}' for k in unknown)}; "
                          f"known: {', '.join(sorted(known))}")
    return cls(**{k: v for k, v in values.items() if k in known})


def _integer(values: Mapping[str, Any], key: str, default: int, minimum: int = 1) -> int:
    """``trainer.<key>`` as an integer >= ``minimum`` (3.7 is refused, not truncated)."""
    value = values.get(key, default)
    require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
            f"{fmt(f'trainer.{key}', value)} must be an integer >= {minimum}")
    return cast(int, value)


def _boolean(values: Mapping[str, Any], key: str, default: bool) -> bool:
    value = values.get(key, default)
    require(isinstance(value, bool), f"{fmt(f'trainer.{key}', value)} must be true or false")
    return cast(bool, value)


def _check_hardware(hardware: HardwareSettings, world_size: int) -> None:
    """Refuse a device or backend Lightning and torch would reject only after launch."""
    for key, known in (("accelerator", ("cpu", "cuda")), ("backend", ("gloo", "nccl"))):
        value = getattr(hardware, key)
        require(value in known,
                f"{fmt(f'hardware.{key}', value)} must be one of {', '.join(known)}")
    for key in ("nodes", "devices_per_node"):
        value = getattr(hardware, key)
        require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"{fmt(f'hardware.{key}', value)} must be an integer >= 1")
    require(world_size % hardware.nodes == 0,
            f"{fmt('hardware.nodes', hardware.nodes)} does not divide the world size "
            f"{world_size} (parallel.pp x dp x dp_shard x ep)")


def _check_optim(optim: OptimSettings) -> None:
    """Refuse what AdamW or the LR schedule would take silently or fail on later."""
    def key(name: str) -> str:
        return fmt(f"trainer.optim.{name}", getattr(optim, name))

    require(is_number(optim.lr) and optim.lr > 0, f"{key('lr')} must be a number > 0")
    require(is_number(optim.min_lr_ratio) and 0 <= optim.min_lr_ratio <= 1,
            f"{key('min_lr_ratio')} must be a number in [0, 1] (a negative one would "
            "turn the learning rate negative)")
    require(isinstance(optim.warmup_steps, int) and not isinstance(optim.warmup_steps, bool)
            and optim.warmup_steps >= 0, f"{key('warmup_steps')} must be an integer >= 0")
    require(is_number(optim.weight_decay) and optim.weight_decay >= 0,
            f"{key('weight_decay')} must be a number >= 0")
    require(is_number(optim.eps) and optim.eps > 0, f"{key('eps')} must be a number > 0")
    require(len(optim.betas) == 2 and all(is_number(b) and 0 <= b < 1 for b in optim.betas),
            f"{key('betas')} must be two numbers in [0, 1)")
    require(optim.max_grad_norm is None or (is_number(optim.max_grad_norm)
                                            and optim.max_grad_norm > 0),
            f"{key('max_grad_norm')} must be a number > 0 or null")


def settings_from_config(cfg: DictConfig) -> RunSettings:
    """Validate the composed recipe config and return typed settings."""
    model = MoEModelConfig.from_mapping(_section(cfg, "model"))
    data_values = _section(cfg, "data")
    data = _pick(data_values, "data", DataSettings)
    require(data.name in DATA_SOURCES,
            f"{fmt('data.name', data.name)} is unknown; choose one of {', '.join(DATA_SOURCES)}")
    for key, source in (("path", "textfile"), ("val_fraction", "textfile"),
                        ("val_percent", "stdlib")):  # the other source's keys: ignored there
        require(data_values.get(key) is None or data.name == source,
                f"{fmt(f'data.{key}', data_values.get(key))} is a setting of data={source}; "
                f"data={data.name} does not use it")
    require(model.vocab_size >= BYTE_VOCAB_SIZE,  # both sources are byte-level
            f"model.vocab_size={model.vocab_size} is smaller than data={data.name}'s "
            f"vocabulary of {BYTE_VOCAB_SIZE} byte values")
    require(0 < data.seq_len <= model.max_seq_len,
            f"data.seq_len={data.seq_len} must be in [1, model.max_seq_len={model.max_seq_len}]")
    parallel = _section(cfg, "parallel")
    unknown = sorted(set(parallel) - set(PARALLEL_KEYS))
    require(not unknown, f"unknown key(s) {', '.join('parallel.' + k for k in unknown)}; "
            f"known: {', '.join(PARALLEL_KEYS)}")
    layout = ParallelPlan.validate(
        pp=parallel.get("pp", 1), dp=parallel.get("dp", 1), ep=parallel.get("ep", 1),
        microbatches=parallel.get("microbatches", 1),
        schedule=str(parallel.get("schedule", "1f1b")), model=model,
        dp_shard=parallel.get("dp_shard", 1))
    spares = parallel.get("spares", 0)
    require(isinstance(spares, int) and not isinstance(spares, bool) and spares >= 0,
            f"{fmt('parallel.spares', spares)} must be an integer >= 0")
    ranks_per_node, spare_nodes = _nodes(parallel, layout.world_size)
    hardware = _pick(_section(cfg, "hardware"), "hardware", HardwareSettings,
                     ignore=("cluster",))
    _check_hardware(hardware, layout.world_size)
    trainer = _section(cfg, "trainer")
    unknown = sorted(set(trainer) - set(TRAINER_KEYS))
    require(not unknown, f"unknown key(s) {', '.join('trainer.' + k for k in unknown)}; "
            f"known: {', '.join(TRAINER_KEYS)}")
    optim_values = dict(trainer.pop("optim", {}) or {})
    if "betas" in optim_values:
        optim_values["betas"] = tuple(optim_values["betas"])
    optim = _pick(optim_values, "trainer.optim", OptimSettings)
    _check_optim(optim)
    precision = parse_precision(trainer.get("precision", "32"))
    api = str(cfg.get("api", "trainer"))
    require(api in ("trainer", "fabric"), f"{fmt('api', api)} must be 'trainer' or 'fabric'")
    checkpoint = _checkpoint_settings(_section(cfg, "checkpoint"))
    settings = RunSettings(
        model=model, data=data, layout=layout, hardware=hardware, optim=optim,
        checkpoint=checkpoint, precision=precision,
        api=cast(Api, api), seed=_integer(trainer, "seed", 0, minimum=0),
        max_steps=_integer(trainer, "max_steps", 200),
        global_batch=_integer(trainer, "global_batch", 16),
        val_every=_integer(trainer, "val_every", 50),
        val_batches=_integer(trainer, "val_batches", 4),
        log_every=_integer(trainer, "log_every", 10),
        progress_bar=_boolean(trainer, "progress_bar", True),
        out_dir=str(cfg.get("out_dir", "outputs")),
        ckpt_path=None if cfg.get("ckpt_path") is None else str(cfg.get("ckpt_path")),
        faults=_section(cfg, "faults"),
        recovery=_recovery_settings(_section(cfg, "recovery")),
        spares=spares,
        ranks_per_node=ranks_per_node,
        spare_nodes=spare_nodes,
    )
    if settings.faults.get("name", "none") != "none":
        from lightning_moe_ckpt.testing.faults import schedule_from_config

        schedule_from_config(settings.faults, world_size=layout.world_size,
                             max_steps=settings.max_steps, seed=settings.seed,
                             ranks_per_node=ranks_per_node)  # validates
        require(settings.checkpoint.policy != "none",
                f"faults={settings.faults['name']} needs a checkpoint policy to recover "
                "from (checkpoint=none was given)")
        blocks = settings.checkpoint.paired_blocks
        require(blocks is None,
                f"{fmt('checkpoint.paired_blocks', blocks)} measures the snapshots' cost "
                f"by leaving every other block of steps without them; it does not go with "
                f"faults={settings.faults['name']} (leave it null to train protected)")
    _check_policy_options(settings.checkpoint, model)
    return settings


def _check_policy_options(checkpoint: CheckpointSettings, model: MoEModelConfig) -> None:
    """Build the policy's planner over stand-in operators of the model's shape, so that a
    bad ``checkpoint.<option>`` value fails here, before any process starts, and not in
    every rank once training is set up."""
    from lightning_moe_ckpt.planning.schedule import OperatorSpec
    from lightning_moe_ckpt.policies.registry import check_options, planner_options
    from moe_recipes.comparisons import COMPARISON_POLICIES, check_comparison_options

    if checkpoint.policy in COMPARISON_POLICIES:
        check_comparison_options(**checkpoint.options)
        return
    if checkpoint.policy == "none":
        return
    specs = [OperatorSpec("embed", 1, 1, 1.0), *(
        OperatorSpec(f"layers.{layer}.moe.experts.{expert}", 1, 1, 0.0)
        for layer in range(model.n_layers) for expert in range(model.n_experts))]
    shape = {"n_layers": model.n_layers, "n_experts": model.n_experts, "top_k": model.top_k}
    accepted = planner_options(checkpoint.policy)
    check_options(checkpoint.policy, specs, **checkpoint.options,
                   **{key: value for key, value in shape.items() if key in accepted})
