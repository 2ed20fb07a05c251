"""Run one training job from a composed recipe config, through the Trainer or Fabric.

:func:`run_training` is what ``recipes/train.py`` calls: it validates the config, builds the
corpus and the seekable samplers, and trains with ``api=trainer`` (the LightningModule on
``lightning.Trainer``) or ``api=fabric`` (an explicit loop on ``lightning.Fabric``). A
layout with more than one process runs under ``MoEParallelStrategy``: on one machine
Lightning's launcher re-runs the recipe once per extra process; across machines start it
under torchrun or SLURM. Rank 0 consolidates the state to layout-independent FQNs and
writes ``final_state.pt``, ``metrics.json`` and the training plot into ``out_dir``. A job
with real failures runs its workers under the supervisor
(:mod:`~moe_recipes.supervised`).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig
from tqdm.auto import tqdm

from lightning_moe_ckpt.callbacks import DurableCheckpoints, SparseCheckpointing
from lightning_moe_ckpt.callbacks.durable_checkpoints import checkpoint_layout
from lightning_moe_ckpt.core.files import save_atomically
from lightning_moe_ckpt.core.nodes import ENV_RANKS_PER_NODE, launcher_ranks_per_node
from lightning_moe_ckpt.core.target import IterationAborted
from lightning_moe_ckpt.errors import (
    ConfigError,
    CorruptCheckpointError,
    NoUsableCheckpointError,
    require,
)
from lightning_moe_ckpt.failures.protocol import (
    ENV_SPARE,
    EXIT_CONFIG,
    EXIT_PREEMPTED,
    EXIT_UNRECOVERABLE,
    is_replacement,
)
from lightning_moe_ckpt.failures.rendezvous import (
    await_assignment,
    exit_on_error,
    is_launcher_task,
    join_as_launcher_task,
    supervised,
)
from lightning_moe_ckpt.failures.survivor import PeerFailureHandler
from lightning_moe_ckpt.recovery import newest_committed_durable
from lightning_moe_ckpt.recovery.durable import check_layout
from lightning_moe_ckpt.recovery.manifest import manifest_path, read_manifest
from lightning_moe_ckpt.strategies import FabricMoEParallelStrategy, TrainerMoEParallelStrategy
from lightning_moe_ckpt.testing import FailureInjector
from lightning_moe_ckpt.testing.faults import schedule_from_config
from lightning_moe_ckpt.training.consolidate import (
    consolidated_state,
    gather_consolidated_state,
    gather_target_state,
    target_state,
)
from lightning_moe_ckpt.training.data import IterationDataset, RunData, build_data
from lightning_moe_ckpt.training.engine import TrainingEngine
from lightning_moe_ckpt.training.hf_module import HFLanguageModule
from lightning_moe_ckpt.training.history import TrainingHistory, ValidationRecord
from lightning_moe_ckpt.training.lightning_module import MoELanguageModule
from lightning_moe_ckpt.training.step_log import ValidationMetrics, evaluate, step_log_values
from moe_recipes.comparisons import COMPARISON_POLICIES, ComparisonCheckpointing
from moe_recipes.outputs import (
    FINAL_STATE,
    METRICS,
    PLOT,
    STRUCK_FAULTS,
    WORKERS,
    gather_cpu_ms,
    plot_training,
    write_metrics,
)
from moe_recipes.progress import steps_progress_bar
from moe_recipes.settings import RunSettings, settings_from_config
from moe_recipes.statistics import PairedBlocks
from moe_recipes.supervised import (
    RecoverRealFailures,
    add_job_report,
    check_supervisable,
    handle_peer_failures,
    job_layout,
    job_store,
    needs_supervisor,
    supervise_workers,
)

log = logging.getLogger("moe_recipes")


@dataclass
class TrainedState:
    """What a finished run hands to the output writers."""

    engine: TrainingEngine
    step: int
    global_rank: int
    data_shard: int = 0
    strategy_core: Any = None
    checkpointing: SparseCheckpointing | None = None
    injector: FailureInjector | None = None
    peer: ComparisonCheckpointing | None = None
    peer_failures: PeerFailureHandler | None = None  # real failures of peers, recovered


def _failure_injector(settings: RunSettings,
                      checkpointing: SparseCheckpointing | None) -> FailureInjector | None:
    if settings.faults.get("name", "none") == "none" or checkpointing is None:
        return None
    schedule = schedule_from_config(settings.faults, world_size=settings.layout.world_size,
                                    max_steps=settings.max_steps, seed=settings.seed,
                                    ranks_per_node=settings.ranks_per_node)
    # Real faults are recorded with the run: one that ended it strikes no more when the
    # same command resumes the job from its durable checkpoint.
    return FailureInjector(schedule, checkpointing, Path(settings.out_dir) / STRUCK_FAULTS)


def _checkpointing(settings: RunSettings) -> SparseCheckpointing | None:
    checkpoint = settings.checkpoint
    if checkpoint.policy in COMPARISON_POLICIES:
        require(settings.api == "fabric" and settings.model.family == "builtin",
                f"checkpoint={checkpoint.policy} runs in the Fabric loop of the built-in "
                f"model (api={settings.api}, model.family={settings.model.family})")
        return None
    if checkpoint.policy == "none":
        return None
    checkpointing = SparseCheckpointing(checkpoint.policy, checkpoint.replicas,
                                        checkpoint.warmup_iterations, checkpoint.durable_every,
                                        checkpoint.durable_dir, checkpoint.durable_keep,
                                        checkpoint.upstream_logging,
                                        same_node_replicas=checkpoint.same_node_replicas,
                                        checksum_threads=checkpoint.checksum_threads,
                                        helper_nice=checkpoint.helper_nice,
                                        preempt_grace_s=settings.recovery.preempt_grace_s,
                                        **checkpoint.options)
    if checkpoint.paired_blocks is not None:  # the bench's measurement (--paired-blocks)
        checkpointing.window_filter = PairedBlocks(checkpoint.paired_blocks)
    return checkpointing


def _progress_bar(settings: RunSettings) -> ProgressBar | None:
    """The bar naming the steps the run trains (None: no bar)."""
    return steps_progress_bar() if settings.progress_bar else None


def _launch_settings(settings: RunSettings) -> dict[str, Any]:
    """Accelerator, devices per node and node count for Lightning (one process too: a
    single-GPU run of ``hardware=h100`` trains on the GPU, not silently on the CPU)."""
    hardware = settings.hardware
    world = settings.layout.world_size
    if hardware.accelerator == "cpu":  # CPU processes: as many as the layout needs
        return {"accelerator": "cpu", "devices": world // hardware.nodes,
                "num_nodes": hardware.nodes}
    return {"accelerator": hardware.accelerator,
            "devices": min(world, hardware.devices_per_node), "num_nodes": hardware.nodes}


def _strategy_args(settings: RunSettings) -> dict[str, Any]:
    plan = settings.layout
    args: dict[str, Any] = {"pp": plan.pp, "dp": plan.dp, "ep": plan.ep,
                            "dp_shard": plan.dp_shard, "schedule": plan.schedule,
                            "process_group_backend": settings.hardware.backend,
                            "recovery_timeout_s": settings.recovery.timeout_s}
    return args


def _csv_logger(settings: RunSettings) -> CSVLogger:
    return CSVLogger(save_dir=settings.out_dir, name="csv", version=0)


def _train_with_trainer(settings: RunSettings, data: RunData,
                        history: TrainingHistory) -> TrainedState:
    module = MoELanguageModule(settings, history, data)
    checkpointing = _checkpointing(settings)
    injector = _failure_injector(settings, checkpointing)
    distributed = settings.layout.world_size > 1
    strategy: Any = (TrainerMoEParallelStrategy(**_strategy_args(settings)) if distributed
                     else "auto")
    job = job_store(settings)
    recovery = (RecoverRealFailures(settings, job, checkpointing, injector)
                if job is not None and checkpointing is not None and distributed else None)
    trainer = L.Trainer(
        strategy=strategy, precision="32-true", max_steps=settings.max_steps,
        logger=_csv_logger(settings), enable_checkpointing=False,
        enable_progress_bar=settings.progress_bar, enable_model_summary=False,
        num_sanity_val_steps=0, val_check_interval=settings.val_every,
        check_val_every_n_epoch=None, log_every_n_steps=settings.log_every,
        default_root_dir=settings.out_dir, use_distributed_sampler=False,
        callbacks=[c for c in (checkpointing, injector, recovery, _progress_bar(settings))
                   if c is not None],
        **_launch_settings(settings),
    )
    trainer.fit(module, ckpt_path=settings.ckpt_path)
    core = strategy.core if distributed else None
    return TrainedState(module._engine(), trainer.global_step, trainer.global_rank,
                        module.data_shard, core, checkpointing, injector,
                        peer_failures=None if recovery is None else recovery.handler)


def _train_hf_with_trainer(settings: RunSettings, data: RunData,
                           history: TrainingHistory) -> dict[str, Any]:
    """A Hugging Face MoE as a user's own LightningModule, in one process or split by the
    built-in plan under ``MoEParallelStrategy``: returns its consolidated state (on rank 0;
    ``None`` on the others)."""
    plan = settings.layout
    distributed = plan.world_size > 1
    require(settings.api == "trainer",
            f"model.family={settings.model.family!r} runs with api=trainer (api={settings.api})")
    require(settings.precision == "32",
            f"model.family={settings.model.family!r} trains in fp32 "
            f"(trainer.precision={settings.precision!r})")
    module = HFLanguageModule(settings, history, data.train)
    checkpointing = _checkpointing(settings)
    injector = _failure_injector(settings, checkpointing)
    strategy = (TrainerMoEParallelStrategy(**_strategy_args(settings),
                                           microbatches=plan.microbatches)
                if distributed else "auto")
    trainer = L.Trainer(
        strategy=strategy, precision="32-true", max_steps=settings.max_steps,
        logger=_csv_logger(settings), enable_checkpointing=False,
        enable_progress_bar=settings.progress_bar, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, log_every_n_steps=settings.log_every,
        default_root_dir=settings.out_dir, use_distributed_sampler=False,
        gradient_clip_val=settings.optim.max_grad_norm,
        callbacks=[c for c in (checkpointing, injector, _progress_bar(settings))
                   if c is not None],
        **_launch_settings(settings))
    trainer.fit(module, ckpt_path=settings.ckpt_path)
    if checkpointing is not None and checkpointing.peer_failures is not None:
        checkpointing.peer_failures.job.stop_heartbeat()
    if isinstance(strategy, TrainerMoEParallelStrategy):
        assert strategy.core.mesh is not None
        state = gather_target_state(module.model, trainer.optimizers[0], trainer.global_step,
                                    strategy.core.mesh.get_group("ep"))
    else:
        state = target_state(module.model, trainer.optimizers[0], trainer.global_step)
    return {"state": state, "checkpointing": checkpointing, "injector": injector,
            "rank": trainer.global_rank}


def _train_with_fabric(settings: RunSettings, data: RunData,
                       history: TrainingHistory) -> TrainedState:
    distributed = settings.layout.world_size > 1
    strategy: Any = (FabricMoEParallelStrategy(**_strategy_args(settings)) if distributed
                     else "auto")
    fabric = L.Fabric(strategy=strategy, precision="32-true", loggers=_csv_logger(settings),
                      **_launch_settings(settings))
    fabric.launch()
    checkpointing = _checkpointing(settings)
    if checkpointing is not None and distributed:
        checkpointing.hook_into(strategy.core)  # boundary logging needs the hook first
    engine = (strategy.build_engine(settings) if distributed
              else TrainingEngine.local(settings, device=fabric.device))
    shard = strategy.core.data_shard if distributed else 0
    engine.batch = lambda t: data.train.iteration(t, shard)  # replay reads the sampler
    _, wrapped_optimizer = fabric.setup(engine.model, engine.optimizer)
    job = job_store(settings)
    layout = checkpoint_layout(strategy, fabric.world_size)
    if settings.ckpt_path is not None and (job is None or job.replaces is None):
        _resume_fabric(settings.ckpt_path, engine, checkpointing, fabric.global_rank, layout)
    if checkpointing is not None:
        # A replacement starts empty: its state comes from its peers in the recovery.
        checkpointing.attach(engine, rank=fabric.global_rank, world_size=fabric.world_size,
                             ranks_per_node=launcher_ranks_per_node(
                                 _launch_settings(settings)["devices"]),
                             device=fabric.device,
                             take_initial=job is None or job.replaces is None)
    injector = _failure_injector(settings, checkpointing)
    if injector is not None:
        injector.attach(engine, fabric.global_rank, fabric.world_size)
    handler = None
    if job is not None and checkpointing is not None and distributed:
        handler = handle_peer_failures(settings, job, engine, checkpointing, injector,
                                        strategy.core, fabric.device)
    peer = _comparison_checkpointing(settings, engine, fabric.global_rank, fabric.world_size)
    layer_ids = list(range(settings.model.n_layers))
    metrics = ValidationMetrics()
    train = IterationDataset(data.train, settings.max_steps, shard=shard)
    val = IterationDataset(data.val, settings.val_batches, shard=shard)
    show = settings.progress_bar and fabric.global_rank == 0
    steps = tqdm(total=settings.max_steps, initial=engine.step, desc="train", disable=not show)
    while engine.step < settings.max_steps:
        step = engine.step
        batch = train[step]
        history.start_iteration()
        if peer is not None:
            peer.before_iteration(step)
        try:
            result = engine.train_iteration(batch["inputs"], batch["targets"],
                                            fabric.backward, wrapped_optimizer.step)
        except IterationAborted:  # a peer failed and was recovered: go on at engine.step
            continue
        history.record(result)
        steps.update(1)
        if peer is not None:
            peer.after_iteration(history.iteration_seconds[-1])
        done = step + 1
        if done % settings.log_every == 0:
            values: dict[str, Any] = dict(step_log_values(result, layer_ids))
            if checkpointing is not None:
                values.update(checkpointing.step_values())
            fabric.log_dict(values, step=done - 1)
            if show:
                steps.set_postfix(loss=f"{float(result.loss):.3f}")
        if checkpointing is not None and checkpointing.durable.due(done):
            checkpointing.durable.write_rank_state(
                done, fabric.global_rank, fabric.world_size, layout,
                {**engine.durable_state(), "planner": checkpointing.state_dict()["planner"]})
        if history.memory_due(done, settings.max_steps):
            history.sample_memory(done, 0 if checkpointing is None else checkpointing.host_bytes())
        if done % settings.val_every == 0 or done == settings.max_steps:
            loss, perplexity = evaluate(engine.executor, val, metrics, fabric.device)
            history.validation.append(ValidationRecord(done, loss, perplexity))
            fabric.log_dict({"val/loss": loss, "val/perplexity": perplexity}, step=done - 1)
    if checkpointing is not None:
        checkpointing.close()
    if peer is not None:
        peer.close()
    if job is not None:
        job.training_finished()
    for logger in fabric.loggers:
        logger.finalize("success")
    return TrainedState(engine, settings.max_steps, fabric.global_rank, shard,
                        strategy.core if distributed else None, checkpointing, injector, peer,
                        handler)


def _resume_fabric(ckpt_path: str, engine: TrainingEngine,
                   checkpointing: SparseCheckpointing | None, rank: int,
                   layout: dict[str, Any]) -> None:
    """A Fabric loop resumed from a durable checkpoint: this rank's file, verified, back
    into the engine (and the planner's state into the checkpointing, before it attaches).
    """
    manifest = read_manifest(ckpt_path)
    check_layout(ckpt_path, manifest, layout)
    state = DurableCheckpoints.load_rank_state(ckpt_path, rank)
    engine.load_durable_state(state)
    if checkpointing is not None:
        checkpointing.load_state_dict({"policy": checkpointing.policy,
                                       "planner": state.get("planner")})


def _comparison_checkpointing(settings: RunSettings, engine: TrainingEngine, rank: int,
                        world_size: int) -> ComparisonCheckpointing | None:
    """A user's own periodic checkpointing (``checkpoint=lightning`` or ``dcp``)."""
    checkpoint = settings.checkpoint
    if checkpoint.policy not in COMPARISON_POLICIES:
        return None
    failures: set[int] = set()
    options = dict(checkpoint.options)
    if settings.faults.get("name", "none") != "none":
        schedule = schedule_from_config(settings.faults, world_size=world_size,
                                        max_steps=settings.max_steps, seed=settings.seed,
                                        ranks_per_node=settings.ranks_per_node)
        failures = {step for step in range(settings.max_steps) if schedule.events_at(step)}
        if options.get("mtbf_steps") is None:
            options["mtbf_steps"] = settings.faults.get("mtbf_steps")
    peer = ComparisonCheckpointing(checkpoint.policy, engine, Path(settings.out_dir) / "peer",
                             rank, world_size, failures, checkpoint.warmup_iterations,
                             **options)
    peer.begin()
    return peer


def _resume_settings(settings: RunSettings) -> RunSettings:
    """The job started again (the same command, ``ckpt_path`` left out) resumes from its
    newest committed durable checkpoint that verifies, when the durable tier wrote one:
    after a failure with no replacement left (the supervisor's exit code
    ``EXIT_NO_SPARE``), a preemption, or any stop; with any model family and either API.
    A replacement or a spare joins the running job instead.

    Raises:
        NoUsableCheckpointError: Committed checkpoints are there but none verifies.
        ConfigError: The newest was written by another layout.
    """
    checkpoint = settings.checkpoint
    if is_replacement() or ENV_SPARE in os.environ:
        return settings
    if settings.ckpt_path is not None:  # a durable checkpoint of another layout: refused now
        manifest = manifest_path_of(settings.ckpt_path)
        if manifest is not None and manifest.exists():
            check_layout(settings.ckpt_path, read_manifest(settings.ckpt_path),
                         _checkpoint_layout(settings))
        return settings
    first = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0"
    if checkpoint.durable_every is None or checkpoint.durable_dir is None:
        if first and _earlier_run_in(Path(settings.out_dir)):
            log.warning("starting afresh at step 0: out_dir=%s holds an earlier run, but "
                        "checkpoint.durable_every is not set, so it left no durable "
                        "checkpoint to resume from", settings.out_dir)
        return settings
    newest = newest_committed_durable(checkpoint.durable_dir, layout=_checkpoint_layout(settings))
    if newest is None:
        return settings
    if first:
        log.warning("resuming from the newest committed durable checkpoint %s (started again "
                    "with checkpoint.durable_every set and no ckpt_path)", newest)
    return replace(settings, ckpt_path=newest)


def manifest_path_of(ckpt_path: str) -> Path | None:
    """The manifest that would commit ``ckpt_path`` (None: not a durable checkpoint name)."""
    try:
        return manifest_path(ckpt_path)
    except ValueError:
        return None


def _checkpoint_layout(settings: RunSettings) -> dict[str, Any]:
    """The layout this run's durable checkpoints are written in (as their manifests say)."""
    plan = settings.layout
    if plan.world_size == 1:
        return {"world_size": 1}
    return {"pp": plan.pp, "dp": plan.dp, "dp_shard": plan.dp_shard, "ep": plan.ep,
            "world_size": plan.world_size}


def _earlier_run_in(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds what an earlier run of the job left (its faults, its
    workers, its logs)."""
    return any((out_dir / name).exists() for name in (STRUCK_FAULTS, WORKERS, "csv"))


def run_training(cfg: DictConfig) -> dict[str, Any]:
    """Train as the recipe config says and write the run's artifacts on rank 0; returns the
    metrics (empty on other ranks)."""
    settings = settings_from_config(cfg)
    if supervised():  # a launcher's task takes its place in the job first (rank or spare)
        with exit_on_error():
            join_as_launcher_task(job_layout(settings))
    try:
        settings = _resume_settings(settings)
    except (NoUsableCheckpointError, ConfigError) as error:  # one line; never a silent step 0
        if isinstance(error, ConfigError) and not supervised():
            raise  # the command line's ckpt_path: ``error: ...``, exit 2 (recipes/train.py)
        log.error("%s", error)
        logging.shutdown()
        raise SystemExit(EXIT_UNRECOVERABLE if isinstance(error, NoUsableCheckpointError)
                         else EXIT_CONFIG) from None
    if settings.ranks_per_node is not None:  # every rank's node, for replica placement
        os.environ.setdefault(ENV_RANKS_PER_NODE, str(settings.ranks_per_node))
    if needs_supervisor(settings):
        if not supervised():
            return supervise_workers(settings)
        with exit_on_error():
            check_supervisable(settings)
            if not await_assignment():  # a warm spare the job did not need
                return {}
            metrics = _train_and_write(settings)
            job = job_store(settings)
            if job is not None:  # its helper thread ends before the interpreter does
                job.stop_heartbeat()
                if is_launcher_task():
                    add_job_report(settings, job)
            _leave_process_groups()
            return metrics
    if (settings.layout.world_size > 1
            and settings.checkpoint.policy not in ("none", *COMPARISON_POLICIES)
            and os.environ.get("LOCAL_RANK", "0") == "0"):  # once, from the first process
        print("note: without the supervisor a worker that really dies ends the job; set "
              "recovery.supervise=true to have it replaced and recovered", file=sys.stderr,
              flush=True)
    try:
        metrics = _train_and_write(settings)
    except (CorruptCheckpointError, NoUsableCheckpointError) as error:
        log.error("%s", error)  # one line: what is damaged or missing
        logging.shutdown()
        raise SystemExit(EXIT_UNRECOVERABLE) from None
    except SIGTERMException:  # preempted: the checkpoint of the step it stopped at is taken
        logging.shutdown()
        raise SystemExit(EXIT_PREEMPTED) from None
    _leave_process_groups()
    return metrics


def _leave_process_groups() -> None:
    """Destroy this process's process groups once its work is done and written.

    Left to interpreter finalization, gloo's worker threads can still hold work whose
    tensors need the GIL, and the process aborts (SIGABRT, "terminate called without an
    active exception") after a run that succeeded; under the supervisor that reads as a
    failed worker. Only on success, as torchtitan does: after an error a peer may still be
    inside a collective with this process."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _train_and_write(settings: RunSettings) -> dict[str, Any]:
    """Train in this process and write the artifacts on rank 0 (see :func:`run_training`)."""
    data = build_data(settings)
    out_dir = Path(settings.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    history = TrainingHistory()
    if settings.model.family != "builtin":
        user = _train_hf_with_trainer(settings, data, history)
        cpu_ms = gather_cpu_ms(history)
        if user["rank"] != 0:
            return {}
        state, checkpointing, injector = user["state"], user["checkpointing"], user["injector"]
        peer = None
        peer_failures = None if checkpointing is None else checkpointing.peer_failures
    else:
        train = _train_with_trainer if settings.api == "trainer" else _train_with_fabric
        trained = train(settings, data, history)
        engine = trained.engine
        if trained.strategy_core is not None:
            state = gather_consolidated_state(engine, trained.strategy_core.coordinates,
                                              trained.step)
        else:
            state = consolidated_state(engine.model, engine.optimizer, trained.step)
        cpu_ms = gather_cpu_ms(history)
        if trained.global_rank != 0:
            return {}
        checkpointing, injector = trained.checkpointing, trained.injector
        peer, peer_failures = trained.peer, trained.peer_failures
    assert state is not None
    save_atomically(state, out_dir / FINAL_STATE)  # whole or not at all
    extra: dict[str, Any] = {
        "data": data.corpus.name, "data_fingerprint": data.corpus.fingerprint,
        # Median CPU ms per iteration of each rank's process (all of its threads) and of
        # its training thread.
        "cpu_ms_per_iteration": cpu_ms}
    if checkpointing is not None:
        extra.update(checkpointing.metrics(sum(history.iteration_seconds)))
    if injector is not None:
        extra.update(injector.metrics())
        print(injector.report())
    if peer is not None:
        extra.update(peer.metrics(sum(history.iteration_seconds)))
    if peer_failures is not None:  # what rank 0 saw of real failures (survivor or replacement)
        extra["real_recoveries"] = peer_failures.recoveries
    metrics = write_metrics(out_dir / METRICS, settings, history, extra)
    plot_training(out_dir / PLOT, history, f"{settings.model.name}, {settings.api}")
    return metrics
