"""The recipe under the supervisor: real failures of worker processes.

Whether a job runs under the supervisor (real faults, spares, ``recovery.supervise``), the
supervisor's side of such a run (it starts the workers, replaces those that die and adds
the replacements to ``metrics.json``), and a worker's side: real-failure recovery hooked
into its training loop, for the Fabric loop (:func:`handle_peer_failures`) and the Trainer
(:class:`RecoverRealFailures`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_moe_ckpt.callbacks import SparseCheckpointing
from lightning_moe_ckpt.core.nodes import launcher_ranks_per_node
from lightning_moe_ckpt.errors import require
from lightning_moe_ckpt.failures.protocol import STATUS_KEY
from lightning_moe_ckpt.failures.rendezvous import JobStore, supervised
from lightning_moe_ckpt.failures.supervisor import Supervisor, external_launcher, report_of
from lightning_moe_ckpt.failures.survivor import PeerFailureHandler
from lightning_moe_ckpt.failures.tasks import JobLayout
from lightning_moe_ckpt.strategies import TrainerMoEParallelStrategy
from lightning_moe_ckpt.targets.lightning import align_trainer_step, skip_first_sigterm_broadcast
from lightning_moe_ckpt.testing import FailureInjector
from lightning_moe_ckpt.testing.faults import has_real_faults, schedule_from_config
from lightning_moe_ckpt.training.distributed_executor import DistributedExecutor
from lightning_moe_ckpt.training.engine import TrainingEngine
from lightning_moe_ckpt.training.lightning_module import MoELanguageModule
from moe_recipes.comparisons import COMPARISON_POLICIES
from moe_recipes.outputs import METRICS, WORKERS
from moe_recipes.settings import RunSettings

__all__ = ["RecoverRealFailures", "add_job_report", "check_supervisable",
           "handle_peer_failures", "job_layout", "job_store", "needs_supervisor",
           "supervise_workers"]


def job_store(settings: RunSettings) -> JobStore | None:
    """This worker's handle on the supervised job (``None`` when not supervised)."""
    return JobStore.from_env(settings.recovery.timeout_s)


def needs_supervisor(settings: RunSettings) -> bool:
    """Whether the job runs under the supervisor (``recovery.supervise``)."""
    supervise = settings.recovery.supervise
    real = settings.faults.get("name", "none") != "none" and has_real_faults(
        schedule_from_config(settings.faults, world_size=settings.layout.world_size,
                             max_steps=settings.max_steps, seed=settings.seed,
                             ranks_per_node=settings.ranks_per_node))
    if supervise is False:
        require(not real and settings.spares == 0 and settings.spare_nodes == 0,
                f"recovery.supervise=false, but real faults (faults.kind="
                f"{settings.faults.get('kind')!r}) or parallel.spares={settings.spares} or "
                f"parallel.spare_nodes={settings.spare_nodes} need the supervisor")
        return False
    needed = (supervise is True or real or settings.spares > 0 or settings.spare_nodes > 0
              or supervised())  # a task a launcher started for the supervisor
    launcher = external_launcher()
    require(not needed or launcher is None,
            f"recovery.supervise={supervise} (faults.kind={settings.faults.get('kind')!r}, "
            f"parallel.spares={settings.spares}) under {launcher}: the supervisor starts "
            "the workers itself, so every process would run a whole job of its own; run "
            "the recipe as one process (python recipes/train.py ...), or set "
            "recovery.supervise=false (a worker that dies then ends the job)")
    return needed


# What the recipe's workers import, for the fork server to import once (fork_workers).
RECIPE_IMPORTS = ("hydra", "moe_recipes.runner")


def check_supervisable(settings: RunSettings) -> None:
    """Refuse a supervised job the supervisor could not keep whole."""
    why = (f"recovery.supervise={settings.recovery.supervise}, "
           f"faults.kind={settings.faults.get('kind')!r}, parallel.spares={settings.spares}")
    require(settings.layout.world_size > 1,
            f"{why}: real failures need several worker processes (a layout with "
            "parallel.pp x dp x dp_shard x ep > 1)")
    require(settings.checkpoint.policy not in ("none", *COMPARISON_POLICIES),
            f"{why}: real failures are recovered from sparse checkpoints "
            f"(checkpoint={settings.checkpoint.policy})")


def job_layout(settings: RunSettings) -> JobLayout:
    """The job's shape, for a supervisor that hosts a launcher's tasks."""
    return JobLayout(settings.layout.world_size, settings.spares, settings.spare_nodes,
                     settings.recovery.timeout_s, settings.recovery.max_restarts,
                     settings.recovery.preempt_grace_s, _durable_dir(settings))


def _durable_dir(settings: RunSettings) -> str:
    """Where the job's durable checkpoints go ("" when it takes none)."""
    checkpoint = settings.checkpoint
    return "" if checkpoint.durable_every is None else str(checkpoint.durable_dir or "")


def add_job_report(settings: RunSettings, job: JobStore) -> None:
    """On rank 0 of a job whose tasks a launcher started: add the supervisor's view
    (replacements, every rank's pids, the spares) to ``metrics.json``, as
    :func:`supervise_workers` does when it started the workers."""
    path = Path(settings.out_dir) / METRICS
    if job.rank != 0 or not path.exists():
        return
    status = json.loads(job.store.get(STATUS_KEY))
    metrics: dict[str, Any] = json.loads(path.read_text())
    for key in ("replacements", "worker_pids", "spare_pids", "spare_node_pids"):
        metrics[key] = status[key]
    metrics["ranks_per_node"] = settings.ranks_per_node
    metrics["launcher_tasks"] = True
    path.write_text(json.dumps(metrics, indent=2))


def supervise_workers(settings: RunSettings) -> dict[str, Any]:
    """Run the job's workers under the supervisor (this process hosts the store)."""
    check_supervisable(settings)
    Path(settings.out_dir).mkdir(parents=True, exist_ok=True)
    supervisor = Supervisor([sys.executable, *sys.argv], settings.layout.world_size,
                            settings.recovery.timeout_s, settings.recovery.max_restarts,
                            settings.spares, status_path=Path(settings.out_dir) / WORKERS,
                            fork_workers=settings.recovery.fork_workers,
                            preload=RECIPE_IMPORTS, ranks_per_node=settings.ranks_per_node,
                            spare_nodes=settings.spare_nodes,
                            preempt_grace_s=settings.recovery.preempt_grace_s,
                            durable_dir=_durable_dir(settings))
    code = supervisor.run()
    path = Path(settings.out_dir) / METRICS
    if code != 0:
        raise SystemExit(code)
    metrics: dict[str, Any] = json.loads(path.read_text())
    metrics["replacements"] = report_of(supervisor.replacements)
    metrics["worker_pids"] = {str(rank): pids for rank, pids in supervisor.pids.items()}
    metrics["spare_pids"] = supervisor.spare_pids
    metrics["spare_node_pids"] = supervisor.spare_node_pids
    metrics["ranks_per_node"] = settings.ranks_per_node
    metrics["supervised_training_s"] = supervisor.training_s
    path.write_text(json.dumps(metrics, indent=2))
    for r in supervisor.replacements:
        print(f"  generation {r.generation}: rank {r.rank} ({r.cause}) pid {r.dead_pid} "
              f"replaced by pid {r.new_pid}")
    return metrics


def handle_peer_failures(settings: RunSettings, job: JobStore, engine: TrainingEngine,
                          checkpointing: SparseCheckpointing,
                          injector: FailureInjector | None, core: Any,
                          device: torch.device) -> PeerFailureHandler:
    """Hook real-failure recovery into ``engine`` (after checkpointing and the injector
    attached); a replacement recovers its rank's state here, before its first iteration."""
    coordinator = checkpointing.coordinator
    assert coordinator is not None

    def reform_groups() -> None:
        core.reform(engine, device)
        coordinator.reform_replication()

    def warm_up() -> None:
        executor = engine.executor
        assert isinstance(executor, DistributedExecutor)
        executor.warm_up(settings.global_batch // (settings.layout.microbatches
                                                   * settings.layout.data_shards),
                         settings.data.seq_len)

    handler = PeerFailureHandler(job, engine, coordinator, reform_groups, warm_up,
                                 dist.get_backend(), checkpointing.upstream_log,
                                 release_groups=lambda: core.release(engine))
    engine.hooks.insert(0, handler)  # heartbeat and generation check come first
    if job.replaces is not None:
        if injector is not None:  # its own fault is behind it; where it joins, not known yet
            injector.real_from = None  # (the replication thread may run before that)
        handler.join_as_replacement()
        if injector is not None:
            injector.real_from = engine.step + 1
    if injector is not None:  # from now on, real faults in phase "recovery" can strike
        handler.recovery_started = injector.fail_during_recovery
    return handler


class RecoverRealFailures(L.Callback):
    """The Trainer API under the supervisor: attaches checkpointing and the injector when
    fitting starts (a replacement takes no initial snapshot), hooks real-failure recovery
    in, and moves a replacement's Trainer to the step it recovered, so that its data,
    validation and ``max_steps`` line up with the survivors' before the data loaders are
    built."""

    def __init__(self, settings: RunSettings, job: JobStore,
                 checkpointing: SparseCheckpointing, injector: FailureInjector | None) -> None:
        self.settings, self.job = settings, job
        self.checkpointing, self.injector = checkpointing, injector
        self.handler: PeerFailureHandler | None = None

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert isinstance(pl_module, MoELanguageModule)
        engine = pl_module.engine_or_raise()
        self.checkpointing.attach(engine, rank=trainer.global_rank,
                                  world_size=trainer.world_size,
                                  ranks_per_node=launcher_ranks_per_node(trainer.num_devices),
                                  device=pl_module.device,
                                  take_initial=self.job.replaces is None)
        if self.injector is not None:
            self.injector.trainer = trainer
            self.injector.attach(engine, trainer.global_rank, trainer.world_size)
        strategy = trainer.strategy
        assert isinstance(strategy, TrainerMoEParallelStrategy)
        self.handler = handle_peer_failures(self.settings, self.job, engine,
                                             self.checkpointing, self.injector,
                                             strategy.core, pl_module.device)
        align_trainer_step(trainer, engine.step, batches=True)
        if self.job.replaces is not None:
            skip_first_sigterm_broadcast(trainer)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.job.training_finished()
