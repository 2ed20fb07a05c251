"""``SparseCheckpointing``: per-iteration snapshots as a Lightning callback (Trainer and Fabric).

Trainer: ``L.Trainer(callbacks=[SparseCheckpointing("moevement")], ...)`` with any
LightningModule and its one torch optimizer (automatic or manual optimization); the
callback discovers the operators of the module (``operators=`` overrides the rules),
follows the optimizer's steps and logs each batch for replay
(:class:`~lightning_moe_ckpt.targets.lightning.LightningTarget`). The built-in
:class:`~lightning_moe_ckpt.training.MoELanguageModule` brings its own engine. Fabric:
``step = checkpointing.protect(fabric, model, optimizer, step_fn)`` and call ``step(batch)``
in the loop (:class:`~lightning_moe_ckpt.targets.fabric.FabricTarget`), or
:meth:`SparseCheckpointing.attach` an engine; :meth:`SparseCheckpointing.close` at the end.
The policy is any of ``moevement`` (default), ``gemini``, ``checkfreq``,
``moc``, ``moetion``, ``none``; its options are the planner's keyword options (unknown ones
are errors naming ``checkpoint.<key>``).

For ``moevement`` without a forced ``window`` the first ``warmup_iterations`` are profiled
(iteration time, device-to-host bandwidth; :mod:`.planner_profiling`) before the first
window is planned; all ranks agree on the largest W so window boundaries line up
(:mod:`~lightning_moe_ckpt.planning.agreement`, in the background between boundaries).
Metrics logged every step: snapshot bytes, stall ms, W, reorders, replication lag.

Under the supervisor (``python -m lightning_moe_ckpt.supervise``) a user's module split by
``TrainerMoEParallelStrategy`` is also protected against workers that really die or hang
(:mod:`~lightning_moe_ckpt.failures.join`); :attr:`SparseCheckpointing.peer_failures`
then records each recovery.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
import torch
from lightning.fabric.strategies import DDPStrategy
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_moe_ckpt.callbacks.committed_io import checkpoint_io_replaceable
from lightning_moe_ckpt.callbacks.durable_checkpoints import (
    DurableCheckpoints,
    checkpoint_layout,
    install_committed_io,
    verify_resumed,
)
from lightning_moe_ckpt.callbacks.planner_profiling import PlannerProfiling
from lightning_moe_ckpt.callbacks.preemption import Preemption, SIGTERMException
from lightning_moe_ckpt.checkpointing.coordinator import CheckpointCoordinator
from lightning_moe_ckpt.core.nodes import launcher_ranks_per_node
from lightning_moe_ckpt.core.operators import OperatorOverride
from lightning_moe_ckpt.core.rng import restore_rng, rng_state
from lightning_moe_ckpt.core.target import (
    RankReplacement,
    StepHooks,
    StepIndexedData,
    StepResult,
    TrainingTarget,
    UserModelParallelism,
)
from lightning_moe_ckpt.errors import ConfigError, fmt, is_number, require
from lightning_moe_ckpt.failures.join import check_replaceable, protect_user_module
from lightning_moe_ckpt.failures.protocol import EXIT_PREEMPTED, PREEMPT_GRACE_S, is_replacement
from lightning_moe_ckpt.failures.rendezvous import JobStore, await_assignment, supervised
from lightning_moe_ckpt.failures.survivor import PeerFailureHandler
from lightning_moe_ckpt.planning.agreement import LargestAcrossRanks
from lightning_moe_ckpt.planning.planner import CapturePlan
from lightning_moe_ckpt.planning.schedule import specs_from_registry
from lightning_moe_ckpt.policies.registry import (
    check_options,
    make_planner,
    planner_options,
    setting_options,
)
from lightning_moe_ckpt.recovery.durable import RNG_KEY
from lightning_moe_ckpt.recovery.manifest import checkpoint_path
from lightning_moe_ckpt.recovery.upstream_log import UpstreamLog
from lightning_moe_ckpt.replication.shared_slots import SAME_NODE_REPLICAS
from lightning_moe_ckpt.snapshots.checksum import require_checksum_threads
from lightning_moe_ckpt.snapshots.helper_threads import DEFAULT_HELPER_NICE, require_helper_nice
from lightning_moe_ckpt.strategies.model_parallel import (
    ModelParallelReplacement,
    keep_start_up_collectives_local,
    restore_start_up_collectives,
)
from lightning_moe_ckpt.strategies.trainer import MoEParallelStrategy
from lightning_moe_ckpt.targets.data_position import DATA_POSITION_KEY, DataPosition
from lightning_moe_ckpt.targets.fabric import FabricTarget, ProtectedStep, StepFunction
from lightning_moe_ckpt.targets.lightning import LightningTarget
from lightning_moe_ckpt.targets.telemetry import RouterParser
from lightning_moe_ckpt.targets.user_loop import UserLoopTarget
from lightning_moe_ckpt.training.lightning_module import MoELanguageModule

log = logging.getLogger("lightning_moe_ckpt")

_ONE = torch.ones(())  # the clip coefficient of a loop that does not clip
# Lightning's warning when a run resumes mid-epoch with a loader it cannot position.
_NOT_RESUMABLE = r"You're resuming from a checkpoint that ended before the epoch ended"


def _ranks_per_node(fabric: Any) -> int:
    """Processes per machine of a Fabric job (replicas go to other machines first)."""
    strategy = fabric.strategy
    nodes = strategy.num_nodes if isinstance(strategy, DDPStrategy) else 1
    return launcher_ranks_per_node(fabric.world_size // max(1, nodes))


def _logger_writes(trainer: L.Trainer) -> bool:
    """Whether the loggers write the step metrics of the batch that just ended (checked in
    ``on_train_batch_end``: one optimizer step per batch, so ``global_step`` counts it)."""
    every: int = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set at init
    return every > 0 and (trainer.global_step % every == 0 or trainer.should_stop)


class SparseCheckpointing(L.Callback, StepHooks):
    """Sparse (or baseline) per-iteration checkpointing of every rank's state.

    ``window_filter`` (an attribute, None by default) may leave out whole windows: it is
    asked at each window's first step with its plan (a measurement's knob, e.g. the bench's
    paired blocks; a window left out protects nothing).

    Args:
        policy: The checkpoint policy: ``"moevement"``, ``"gemini"``, ``"checkfreq"``,
            ``"moc"``, ``"moetion"`` or ``"none"``.
        replicas: Each snapshot goes to this many peers, on other nodes first.
        warmup_iterations: Iterations profiled (iteration time, device-to-host bandwidth)
            before the first window is planned.
        durable_every: Take a committed dense checkpoint into ``durable_dir`` after every
            N-th optimizer step (global steps N, 2N, ...); ``None``: no durable
            checkpoints.
        durable_dir: Where durable checkpoints go; required with ``durable_every``.
        durable_keep: Newest committed durable checkpoints kept; an older one is removed
            once a newer one is committed.
        upstream_logging: Log pipeline-boundary tensors so that only failed stages roll
            back (localized rollback); ``False``: every rank rolls back (global rollback).
        operators: Overrides operator discovery for a user's model: a mapping of
            parameter-name patterns to operator names, or ``(name, param) -> name | None``;
            ``None``: the built-in rules.
        top_k: Experts per token, which helps routing telemetry read routers whose output
            is a plain logits tensor (see :mod:`~lightning_moe_ckpt.targets.telemetry`);
            ``None``: read from a Hugging Face-style config of the model, if any.
        router_parser: Reads a router's output the built-in parsing does not understand:
            ``(output) -> (indices, probabilities)`` (see
            :mod:`~lightning_moe_ckpt.targets.telemetry`); ``None``: the built-in parsing.
        same_node_replicas: How a replica peer on this node holds a snapshot: it maps the
            snapshot's shared memory (``"shared"``: it outlives this process, and no bytes
            are copied) or receives a copy (``"copied"``).
        checksum_threads: Threads per rank that checksum large pieces; ``None``: the rank's
            share of the cores it may run on, at most 8.
        helper_nice: Added to the nice value of the threads that copy, checksum, replicate
            and write snapshots, so that on shared cores they yield to the training threads
            (:mod:`~lightning_moe_ckpt.snapshots.helper_threads`; 0: the same priority).
        preempt_grace_s: On a preemption (a SIGTERM to the job; Trainer only), how long a
            rank waits for the durable checkpoint of the step it stops at to be written
            (:mod:`~lightning_moe_ckpt.callbacks.preemption`).
        **options: The policy's options, the planner's keyword options (``window=3``,
            ``interval=10``, ``experts_per_layer=2``, ...).

    Raises:
        ConfigError: A bad value or an option the policy does not know, naming its
            ``checkpoint.<key>``.
    """

    records_for_replay = True  # its step hook logs the scalars a replay reuses

    def __init__(self, policy: str = "moevement", replicas: int = 2,
                 warmup_iterations: int = 3, durable_every: int | None = None,
                 durable_dir: str | None = None, durable_keep: int = 2,
                 upstream_logging: bool = True, operators: OperatorOverride | None = None,
                 top_k: int | None = None,
                 router_parser: RouterParser | None = None,
                 same_node_replicas: str = "shared", checksum_threads: int | None = None,
                 helper_nice: int = DEFAULT_HELPER_NICE,
                 preempt_grace_s: float = PREEMPT_GRACE_S,
                 **options: Any) -> None:
        known = setting_options(policy)  # raises for an unknown policy
        unknown = sorted(set(options) - known)
        require(not unknown, f"unknown option(s) {', '.join('checkpoint.' + k for k in unknown)}"
                             f" for checkpoint={policy}; it accepts "
                             f"{', '.join(sorted(known)) or 'no options'}")
        check_options(policy, **options)  # a bad value refused here, not at fit
        for key, value, least in (("replicas", replicas, 0),
                                  ("warmup_iterations", warmup_iterations, 1)):
            require(isinstance(value, int) and not isinstance(value, bool) and value >= least,
                    f"{fmt(f'checkpoint.{key}', value)} must be an integer >= {least}")
        require(isinstance(upstream_logging, bool),
                f"{fmt('checkpoint.upstream_logging', upstream_logging)} must be True or False")
        require_checksum_threads(checksum_threads)
        require_helper_nice(helper_nice)
        require(is_number(preempt_grace_s) and preempt_grace_s > 0,
                f"{fmt('recovery.preempt_grace_s', preempt_grace_s)} must be > 0 seconds")
        require(same_node_replicas in SAME_NODE_REPLICAS,
                f"{fmt('checkpoint.same_node_replicas', same_node_replicas)} must be one of "
                f"{', '.join(map(repr, SAME_NODE_REPLICAS))}")
        self.durable = DurableCheckpoints(durable_every, durable_dir, durable_keep)
        self.policy = policy
        self.replicas = replicas
        self.same_node_replicas = same_node_replicas
        self.warmup_iterations = warmup_iterations
        self.checksum_threads = checksum_threads  # None: the rank's share of the cores
        # Asked at each window's first step whether to take it (None: every window).
        self.window_filter: Callable[[CapturePlan], bool] | None = None
        self.helper_nice = helper_nice  # added to the helper threads' nice value
        self.options = options
        self.coordinator: CheckpointCoordinator | None = None
        self.target: TrainingTarget | None = None
        self.operators = operators
        self.top_k = top_k
        self.router_parser = router_parser
        # Pipeline-boundary activations/gradients and per-iteration scalars since the
        # older window's start: what localized recovery replays a failed stage from.
        self.upstream_log = UpstreamLog() if upstream_logging else None
        self._upstream_log_peak = 0
        self._pending_state: dict[str, Any] | None = None
        self.data_position = DataPosition()  # a user's loader's position, in checkpoints
        self._started = 0.0
        # Real failures of peers recovered on this rank (a supervised job), else None.
        self.peer_failures: PeerFailureHandler | None = None
        self.preempt_grace_s = float(preempt_grace_s)
        self.preemption: Preemption | None = None  # SIGTERM handling (Trainer, once fitting)
        self._fitting = False  # set up by a Trainer (whose on_train_start starts the tier)
        self.preempted_at: int | None = None  # the step training stopped at on a preemption
        # Lightning's ModelParallelStrategy, made to replace failed ranks (supervised).
        self._rank_replacement: ModelParallelReplacement | None = None
        if supervised():
            _prepare_supervised_worker()

    @property
    @override
    def state_key(self) -> str:
        return f"SparseCheckpointing[{self.policy}]"

    def attach(self, target: TrainingTarget, *, rank: int = 0, world_size: int = 1,
               ranks_per_node: int = 1, device: torch.device | None = None,
               copy_delay_s: float = 0.0, take_initial: bool = True) -> CheckpointCoordinator:
        """Start checkpointing ``target`` (takes the initial dense snapshot now, unless
        ``take_initial`` is off: a replacement process gets its state in a recovery)."""
        if self.coordinator is not None:
            if self.target is target:
                return self.coordinator
            raise RuntimeError("this SparseCheckpointing already protects another model")
        device = device if device is not None else torch.device("cpu")
        if world_size > 1 and self.replicas > world_size - 1:
            warnings.warn(f"checkpoint.replicas={self.replicas} exceeds the {world_size - 1} "
                          f"peer(s) of a world of {world_size}: each snapshot gets "
                          f"{world_size - 1} replica(s)", UserWarning, stacklevel=2)
        registry = target.registry
        unmatched = registry.unmatched_patterns if target.layout.pp == 1 else []
        if unmatched:  # the whole model is on every rank: a typo, not another stage's part
            example = next(iter(registry)).parts[0].param_name
            raise ConfigError(f"operators pattern(s) {', '.join(map(repr, unmatched))} match "
                              f"no parameter of the model (names look like {example!r}); "
                              "fix or drop them")
        options = dict(self.options)
        accepted = planner_options(self.policy)
        n_layers, n_experts = target.layout.n_layers, target.layout.n_experts
        top_k = target.top_k if target.top_k is not None else self.top_k
        for key, value in (("n_layers", n_layers), ("n_experts", n_experts),
                           ("top_k", top_k)):
            if key in accepted and value is not None:
                options.setdefault(key, value)
        if "window_agreement" in accepted and world_size > 1:
            options["window_agreement"] = LargestAcrossRanks()
        if "interval_agreement" in accepted and world_size > 1:  # measured k: all ranks alike
            options["interval_agreement"] = LargestAcrossRanks()
        planner = make_planner(self.policy, specs_from_registry(registry, target.state),
                               **options)
        if self._pending_state is not None and self._pending_state.get("planner") is not None:
            planner.load_state_dict(self._pending_state["planner"])  # resumed from a checkpoint
            # Windows start afresh at the resumed step, as after a recovery: the initial
            # snapshot below (the state before it) is the recovery point until one persists.
            planner.on_recovery(target.step)
            self._pending_state = None
        # The state before the next step, kept (and replicated) as the first checkpoint.
        before = target.step - 1
        if not self._fitting:  # under the Trainer: at on_train_start, once the step is known
            self.durable.start(rank, target.step, fresh=take_initial)
        initial = CapturePlan(before, tuple(registry.names), (), before, 0, 1, None)
        disk_dir = None
        if self.policy == "checkfreq":  # CheckFreq persists its dense snapshots to disk
            disk_dir = f"{self.durable.directory or 'checkfreq'}/checkfreq/rank{rank:05d}"
        self.target = target
        self.coordinator = CheckpointCoordinator(
            target, planner, rank, world_size, self.replicas, ranks_per_node, device,
            copy_delay_s, initial_plan=initial if take_initial else None,
            disk_dir=disk_dir, share_same_node=self.same_node_replicas == "shared",
            checksum_threads=self.checksum_threads,
            helper_nice=self.helper_nice)
        self.coordinator.window_filter = self.window_filter
        if target.batch_log is not None:
            self.coordinator.store.release_listeners.append(target.batch_log.release_before)
        if self.upstream_log is not None and target.layout.pp > 1:
            # Only a pipeline has boundaries to log and a localized recovery to use them.
            target.hooks.append(self)
            self.coordinator.store.release_listeners.append(self.upstream_log.release_before)
        if planner.wants_profile and options.get("window") is None:
            target.hooks.append(PlannerProfiling(self.coordinator, self.warmup_iterations,
                                               device))
        self._started = time.perf_counter()
        return self.coordinator

    def protect(self, fabric: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                step_fn: StepFunction, schedulers: Sequence[Any] = ()) -> ProtectedStep:
        """Fabric: protect ``model``/``optimizer`` (as ``fabric.setup`` returned them),
        trained by ``step_fn(batch)`` (forward, ``fabric.backward``, ``optimizer.step()``);
        call the returned step with each batch instead of ``step_fn``."""
        require(fabric.world_size == 1 or JobStore.from_env() is None,
                "real failures of a Fabric loop's own model are not recovered in this "
                "version: under the supervisor, train it with L.Trainer and "
                "TrainerMoEParallelStrategy (a PipelineTrainable module)")
        target = FabricTarget(fabric, model, optimizer, step_fn, schedulers, self.operators,
                              self.top_k, self.router_parser)
        self.attach(target, rank=fabric.global_rank, world_size=fabric.world_size,
                    ranks_per_node=_ranks_per_node(fabric),
                    device=fabric.device)
        return ProtectedStep(target)

    def operator_names(self) -> list[str]:
        """This rank's operator names (available once training started)."""
        if self.target is None:
            raise RuntimeError("operator_names() is available once training started "
                               "(SparseCheckpointing attaches in on_train_start)")
        return list(self.target.registry.names)

    def hook_into(self, core: Any) -> None:
        """Log pipeline-boundary tensors of the strategy ``core`` (before its engine is
        built: the Trainer does this in :meth:`setup`; Fabric users call it themselves)."""
        if self.upstream_log is not None and self.upstream_log not in core.boundary_hooks:
            self.upstream_log.attach(core.boundary_hooks)

    @override
    def after_optimizer_step(self, step: int, result: StepResult) -> None:
        if self.upstream_log is not None:
            clip = result.clip_coef if result.clip_coef is not None else _ONE
            self.upstream_log.log_scalars(step, clip, 1.0, result.lr)
            self._upstream_log_peak = max(self._upstream_log_peak, self.upstream_log.nbytes())

    def close(self) -> None:
        """Finish outstanding copies, replication and durable writes."""
        if self.coordinator is not None:
            self.coordinator.close()
        self.durable.close()
        if isinstance(self.target, UserLoopTarget):
            self.target.close()

    def metrics(self, train_seconds: float) -> dict[str, Any]:
        """Checkpoint figures for ``metrics.json`` (empty before :meth:`attach`)."""
        if self.coordinator is None:
            return {}
        figures = self.coordinator.metrics(train_seconds)
        planner = self.coordinator.planner
        figures["reorders"] = planner.reorders
        # Dense policies' checkpoint interval and partial policies' experts per layer (K),
        # as in force at the end: what the simulator is calibrated with (recipes/bench.py).
        figures["interval"] = planner.interval
        figures["experts_per_layer"] = planner.experts_per_layer
        figures["profile"] = self.coordinator.profile
        target = self.coordinator.target
        # Dense state: every operator's compute weights and master state, measured now.
        specs = specs_from_registry(target.registry, target.state)
        figures["dense_state_bytes"] = sum(s.compute_bytes + s.master_state_bytes
                                           for s in specs)
        figures["operators"] = len(specs)
        figures["routing_telemetry"] = target.routing_source
        if target.batch_log is not None:
            figures["batch_log_bytes_peak"] = target.batch_log.peak_bytes
        figures["durable_checkpoints"] = self.durable.committed()
        figures["durable_failures"] = list(self.durable.failures)
        figures["durable_waits_s"] = list(self.durable.waits_s)
        figures["upstream_log_bytes_peak"] = self._upstream_log_peak
        return figures

    def host_bytes(self) -> int:
        """Host bytes this rank's checkpointing holds now: its snapshots (and retained
        saves), their encodings in shared memory (mapped by peers on this node), the
        copies it keeps for peers and the upstream log (with its spare buffers)."""
        coordinator = self.coordinator
        held = 0 if self.upstream_log is None else self.upstream_log.host_bytes()
        if coordinator is not None:
            held += coordinator.store.own_bytes()  # placed snapshots: in the slots below
            if coordinator.replica_store is not None:
                held += coordinator.replica_store.nbytes()
            if coordinator.replicator is not None:
                held += coordinator.replicator.slot_bytes()
        return held

    def step_values(self) -> dict[str, float]:
        """Per-step values for the loggers."""
        coordinator = self.coordinator
        if coordinator is None or not coordinator.measured.bytes_per_step:
            return {}
        replicator = coordinator.replicator
        return {
            "checkpoint/snapshot_bytes": float(coordinator.measured.bytes_per_step[-1]),
            "checkpoint/stall_ms": 1e3 * (coordinator.measured.stall_per_step[-1]
                                          if coordinator.measured.stall_per_step else 0.0),
            "checkpoint/window": float(coordinator.measured.current_window or 0),
            "checkpoint/reorders": float(coordinator.planner.reorders),
            "checkpoint/replication_lag": float(replicator.lag if replicator else 0),
            "checkpoint/host_bytes": float(coordinator.store.host_bytes()),
        }

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._fitting = stage == "fit"
        if isinstance(trainer.strategy, MoEParallelStrategy):
            self.hook_into(trainer.strategy.core)
        # Atomic writes, and loads of durable checkpoints verified against their manifests.
        if self.durable.enabled or checkpoint_io_replaceable(trainer.strategy.checkpoint_io):
            self.durable.io = install_committed_io(trainer)
            self.durable.io.layout = checkpoint_layout(trainer.strategy, trainer.world_size)
        if (isinstance(trainer.strategy, ModelParallelStrategy) and stage == "fit"
                and trainer.world_size > 1 and supervised()):
            # Before the DataLoaders are processed: a replacement starts where the job is.
            self._rank_replacement = ModelParallelReplacement(trainer.strategy)
        else:  # the strategy keeps its own start-up collectives local, if it must
            restore_start_up_collectives()

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.preemption is None:  # after Lightning's own handler (it registers first)
            job = JobStore.from_env() if trainer.world_size > 1 else None
            self.preemption = Preemption(job, self.preempt_grace_s)
            self.preemption.install()
        # The step a resumed run starts at is restored by now; no rank has written yet.
        self.durable.start(trainer.global_rank, trainer.global_step,
                           fresh=not is_replacement())
        positioned = isinstance(pl_module, StepIndexedData)
        if not positioned:  # a resumed run reads on where it was
            positioned = self.data_position.train_starts(trainer)
        if positioned:  # so Lightning's warning that it cannot do so is not true here
            warnings.filterwarnings("ignore", message=_NOT_RESUMABLE)
        if self.target is not None:
            return  # attached already (FailureInjector listed first)
        if isinstance(pl_module, MoELanguageModule):
            engine = pl_module.engine_or_raise()
            # Lightning runs this hook before the module's: a resumed run's step first, so
            # the initial snapshot is the state before the resumed step, not before step 0.
            engine.set_step(trainer.global_step)
            self.attach(engine, rank=trainer.global_rank,
                        world_size=trainer.world_size,
                        ranks_per_node=launcher_ranks_per_node(trainer.num_devices),
                        device=pl_module.device)
            return
        target = LightningTarget(trainer, pl_module, self.operators, self.top_k,
                                 self.router_parser)
        target.set_step(trainer.global_step)
        job = JobStore.from_env() if trainer.world_size > 1 else None
        replacement = self._rank_replacement_of(trainer)
        if job is not None:
            check_replaceable(trainer, replacement)
            if isinstance(replacement, ModelParallelReplacement):
                replacement.check()
        coordinator = self.attach(target, rank=trainer.global_rank,
                                  world_size=trainer.world_size,
                                  ranks_per_node=launcher_ranks_per_node(trainer.num_devices),
                                  device=pl_module.device,
                                  take_initial=job is None or job.replaces is None)
        if job is not None:  # a replacement recovers its rank's state in here
            assert replacement is not None
            self.peer_failures = protect_user_module(trainer, target, coordinator,
                                                     self.upstream_log, job, replacement)

    def _rank_replacement_of(self, trainer: L.Trainer) -> RankReplacement | None:
        """How the Trainer's strategy replaces a failed rank (None: it cannot)."""
        strategy = trainer.strategy
        if isinstance(strategy, UserModelParallelism) and strategy.user_layout() is not None:
            return strategy
        return self._rank_replacement

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if isinstance(self._rank_replacement, ModelParallelReplacement):
            self._rank_replacement.joined()  # from its first batch on, in step with all
        if isinstance(self.target, LightningTarget):
            self.target.start_iteration(batch, batch_idx)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        # Only where the loggers write (every log_every_n_steps-th step): Lightning keeps
        # the last value of a step metric, so logging at every step writes the same rows
        # and costs the training thread milliseconds per iteration.
        if trainer.is_global_zero and _logger_writes(trainer):
            values = self.step_values()
            if values:
                pl_module.log_dict(values, rank_zero_only=True)
        # A durable checkpoint is a collective (the Trainer's barriers): every rank takes
        # it at the same steps, a function of the step alone.
        if self.coordinator is not None and self.durable.due(trainer.global_step):
            self.durable.write(trainer)
        if self.preemption is not None:
            self.preemption.at_batch_end(trainer)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):  # every rank stops at this step
            if self.preemption is not None:
                self.preemption.on_stopped(trainer)
            self._save_on_preemption(trainer)
            # Left uncaught, it ends the process with the code that says "preempted".
            exception.code = EXIT_PREEMPTED

    def _save_on_preemption(self, trainer: L.Trainer) -> None:
        """The durable checkpoint of the step training stopped at on a preemption
        (collective), waited for at most ``preempt_grace_s``."""
        step = self.preempted_at = trainer.global_step
        if self.durable.directory is None or not self.durable.enabled:
            log.warning("rank %d: preempted at step %d with no durable tier "
                        "(checkpoint.durable_every is not set): nothing is saved, and started "
                        "again the job starts afresh", trainer.global_rank, step)
            return
        path = str(checkpoint_path(self.durable.directory, step))
        if path not in self.durable.taken[-1:]:  # not taken at this step already
            self.durable.write(trainer)
        if self.durable.drain(self.preempt_grace_s):
            log.warning("rank %d: preempted at step %d: its part of the durable checkpoint "
                        "%s is written", trainer.global_rank, step, path)
        else:
            log.error("rank %d: preempted at step %d: the durable checkpoint %s was not "
                      "written within recovery.preempt_grace_s=%g s", trainer.global_rank,
                      step, path, self.preempt_grace_s)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.preemption is not None:
            self.preemption.uninstall()
            self.preemption = None

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.close()
        if self.peer_failures is not None:  # the supervisor no longer watches this rank
            self.peer_failures.job.training_finished()
            self.peer_failures.job.stop_heartbeat()

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        checkpoint[RNG_KEY] = rng_state()  # the RNG the next step starts from
        if not isinstance(pl_module, StepIndexedData):
            checkpoint[DATA_POSITION_KEY] = self.data_position.state(trainer)

    @override
    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if trainer.ckpt_path is not None:  # also what the strategy loaded itself (DCP)
            verify_resumed(trainer.ckpt_path,
                           checkpoint_layout(trainer.strategy, trainer.world_size))
        if RNG_KEY in checkpoint:  # a plain ckpt_path resume continues with the same draws
            restore_rng(checkpoint[RNG_KEY])
        if DATA_POSITION_KEY in checkpoint:  # and reads the same batches, mid-epoch too
            self.data_position.load(checkpoint[DATA_POSITION_KEY])

    @override
    def state_dict(self) -> dict[str, Any]:
        planner = None if self.coordinator is None else self.coordinator.planner.state_dict()
        return {"policy": self.policy, "planner": planner}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_state = state_dict


def _prepare_supervised_worker() -> None:
    """In a worker of a supervised job, before its Trainer starts: a warm spare waits here
    for a failed rank (and leaves when the job ends without needing it); a replacement
    arrives at the generation it joins and keeps the start-up collectives of Lightning's
    ``ModelParallelStrategy`` local until it has joined (the survivors do not mirror
    them)."""
    if not await_assignment():
        sys.exit(0)  # the job ended without needing this spare
    job = JobStore.from_env()
    if job is not None and job.replaces is not None:
        job.arrive(job.replaces)
        keep_start_up_collectives_local()
