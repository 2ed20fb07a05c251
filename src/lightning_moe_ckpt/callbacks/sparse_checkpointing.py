"""``SparseCheckpointing``: per-iteration snapshots as a Lightning callback (Trainer and Fabric).

Trainer: ``L.Trainer(callbacks=[SparseCheckpointing("moevement")], ...)`` with
:class:`~lightning_moe_ckpt.training.MoELanguageModule`; the callback attaches to the
module's engine when training starts. Fabric: call :meth:`SparseCheckpointing.attach`
with the rank's engine after ``fabric.launch()`` and :meth:`SparseCheckpointing.close`
at the end. The policy is any of ``moevement`` (default), ``gemini``, ``checkfreq``,
``moc``, ``moetion``, ``none``; its options are the planner's keyword options (unknown ones
are errors naming ``checkpoint.<key>``).

For ``moevement`` without a forced ``window`` the first ``warmup_iterations`` are profiled
(iteration time, device-to-host bandwidth) before the first window is planned; all ranks
agree on the largest W so window boundaries line up. Metrics logged every step:
snapshot bytes, stall ms, W, reorders, replication lag.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_moe_ckpt.checkpoint.coordinator import CheckpointCoordinator
from lightning_moe_ckpt.checkpoint.planners import CapturePlan, make_planner, planner_options
from lightning_moe_ckpt.checkpoint.profiler import IterationProfiler, measure_bandwidth
from lightning_moe_ckpt.checkpoint.schedule import specs_from_registry
from lightning_moe_ckpt.errors import fmt, require
from lightning_moe_ckpt.recovery.upstream_log import UpstreamLog
from lightning_moe_ckpt.training.engine import TrainingEngine

_BANDWIDTH_PROBE_BYTES = 32 * 2**20


def _agree_on_largest(window: int) -> int:
    value = torch.tensor([window], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value)


class _ProfilingHook:
    """Measures the iteration period and, once warm, hands the planner its profile."""

    def __init__(self, coordinator: CheckpointCoordinator, warmup: int,
                 device: torch.device) -> None:
        self.coordinator = coordinator
        self.profiler = IterationProfiler(warmup_iterations=warmup, skip=1, device=device)
        self.device = device
        self.profiler.begin()

    def before_optimizer_step(self, step: int) -> None:
        return None

    def after_optimizer_step(self, step: int, result: Any) -> None:
        if self.profiler.done:
            return
        self.profiler.end()
        self.profiler.begin()
        if self.profiler.done:
            bandwidth = measure_bandwidth(_BANDWIDTH_PROBE_BYTES, self.device)
            iteration_s = self.profiler.iteration_time_s
            assert iteration_s is not None
            self.coordinator.planner.set_profile(iteration_s, bandwidth)
            self.coordinator.profile = {"iteration_time_s": iteration_s,
                                        "bandwidth_bytes_per_s": bandwidth}


class SparseCheckpointing(L.Callback):
    """Sparse (or baseline) per-iteration checkpointing of every rank's state."""

    def __init__(self, policy: str = "moevement", replicas: int = 2,
                 warmup_iterations: int = 3, durable_every: int | None = None,
                 durable_dir: str | None = None, upstream_logging: bool = True,
                 **options: Any) -> None:
        known = planner_options(policy)  # raises for an unknown policy
        unknown = sorted(set(options) - known)
        require(not unknown, f"unknown option(s) {', '.join('checkpoint.' + k for k in unknown)}"
                             f" for checkpoint={policy}; it accepts "
                             f"{', '.join(sorted(known)) or 'no options'}")
        require(replicas >= 0, f"{fmt('checkpoint.replicas', replicas)} must be >= 0")
        require(warmup_iterations >= 1,
                f"{fmt('checkpoint.warmup_iterations', warmup_iterations)} must be >= 1")
        require(durable_every is None or (isinstance(durable_every, int) and durable_every >= 1),
                f"{fmt('checkpoint.durable_every', durable_every)} must be an integer >= 1 "
                "(or null: no durable checkpoints)")
        require(durable_every is None or durable_dir is not None,
                f"checkpoint.durable_every={durable_every} needs checkpoint.durable_dir")
        self.durable_every = durable_every
        self.durable_dir = durable_dir
        self.durable_saved: list[str] = []
        self._persisted_seen: int | None = None
        self._persisted_count = 0
        self._first_step = 0  # windows starting before it are the initial-state snapshot
        self.policy = policy
        self.replicas = replicas
        self.warmup_iterations = warmup_iterations
        self.options = options
        self.coordinator: CheckpointCoordinator | None = None
        # Pipeline-boundary activations/gradients and per-iteration scalars since the
        # older window's start: what localized recovery replays a failed stage from.
        self.upstream_log = UpstreamLog() if upstream_logging else None
        self._upstream_log_peak = 0
        self._pending_state: dict[str, Any] | None = None
        self._started = 0.0

    @property
    @override
    def state_key(self) -> str:
        return f"SparseCheckpointing[{self.policy}]"

    def attach(self, engine: TrainingEngine, *, rank: int = 0, world_size: int = 1,
               ranks_per_node: int = 1, device: torch.device | None = None,
               copy_delay_s: float = 0.0) -> CheckpointCoordinator:
        """Start checkpointing ``engine`` (takes the initial dense snapshot now)."""
        device = device if device is not None else torch.device("cpu")
        registry = engine.registry
        options = dict(self.options)
        accepted = planner_options(self.policy)
        model = engine.settings.model
        for key, value in (("n_layers", model.n_layers), ("n_experts", model.n_experts),
                           ("top_k", model.top_k)):
            if key in accepted:
                options.setdefault(key, value)
        if "window_agreement" in accepted and world_size > 1:
            options["window_agreement"] = _agree_on_largest
        if "interval_agreement" in accepted and world_size > 1:  # measured k: all ranks alike
            options["interval_agreement"] = _agree_on_largest
        planner = make_planner(self.policy, specs_from_registry(registry), **options)
        if self._pending_state is not None and self._pending_state.get("planner") is not None:
            planner.load_state_dict(self._pending_state["planner"])  # resumed from a checkpoint
            self._pending_state = None
        # The state before the next step, kept (and replicated) as the first checkpoint.
        before = engine.step - 1
        self._first_step = engine.step
        initial = CapturePlan(before, tuple(registry.names), (), before, 0, 1, None)
        persist_dir = None
        if self.policy == "checkfreq":  # CheckFreq persists its dense snapshots to disk
            persist_dir = f"{self.durable_dir or 'checkfreq'}/checkfreq/rank{rank:05d}"
        self.coordinator = CheckpointCoordinator(
            engine, planner, rank, world_size, self.replicas, ranks_per_node, device,
            copy_delay_s, initial_plan=initial, persist_dir=persist_dir)
        if self.upstream_log is not None:
            engine.hooks.append(self)
            self.coordinator.store.release_listeners.append(self.upstream_log.release_before)
        if hasattr(planner, "set_profile") and options.get("window") is None:
            engine.hooks.append(_ProfilingHook(self.coordinator, self.warmup_iterations,
                                               device))
        self._started = time.perf_counter()
        return self.coordinator

    def hook_into(self, core: Any) -> None:
        """Log pipeline-boundary tensors of the strategy ``core`` (before its engine is
        built: the Trainer does this in :meth:`setup`; Fabric users call it themselves)."""
        if self.upstream_log is not None and self.upstream_log not in core.boundary_hooks:
            self.upstream_log.attach(core.boundary_hooks)

    def before_optimizer_step(self, step: int) -> None:
        return None

    def after_optimizer_step(self, step: int, result: Any) -> None:
        if self.upstream_log is not None:
            self.upstream_log.log_scalars(step, result.clip_coef, 1.0, result.lr)
            self._upstream_log_peak = max(self._upstream_log_peak, self.upstream_log.nbytes())

    def close(self) -> None:
        """Finish outstanding copies and replication."""
        if self.coordinator is not None:
            self.coordinator.close()

    def metrics(self, train_seconds: float) -> dict[str, Any]:
        """Checkpoint figures for ``metrics.json`` (empty before :meth:`attach`)."""
        if self.coordinator is None:
            return {}
        figures = self.coordinator.metrics(train_seconds)
        planner = self.coordinator.planner
        figures["reorders"] = getattr(planner, "reorders", 0)
        # Dense policies' checkpoint interval and partial policies' experts per layer (K),
        # as in force at the end: what the simulator is calibrated with (recipes/bench.py).
        figures["interval"] = getattr(planner, "interval", None)
        figures["experts_per_layer"] = getattr(planner, "experts_per_layer", None)
        figures["profile"] = getattr(self.coordinator, "profile", None)
        figures["durable_checkpoints"] = list(self.durable_saved)
        figures["upstream_log_bytes_peak"] = self._upstream_log_peak
        return figures

    def step_values(self) -> dict[str, float]:
        """Per-step values for the loggers."""
        coordinator = self.coordinator
        if coordinator is None or not coordinator.bytes_per_step:
            return {}
        replicator = coordinator.replicator
        return {
            "checkpoint/snapshot_bytes": float(coordinator.bytes_per_step[-1]),
            "checkpoint/stall_ms": 1e3 * (coordinator.stall_per_step[-1]
                                          if coordinator.stall_per_step else 0.0),
            "checkpoint/window": float(coordinator.current_window or 0),
            "checkpoint/reorders": float(getattr(coordinator.planner, "reorders", 0)),
            "checkpoint/replication_lag": float(replicator.lag if replicator else 0),
            "checkpoint/host_bytes": float(coordinator.store.host_bytes()),
        }

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        core = getattr(trainer.strategy, "core", None)
        if core is not None:
            self.hook_into(core)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = getattr(pl_module, "engine", None)
        if not isinstance(engine, TrainingEngine):
            raise TypeError("SparseCheckpointing needs a module with a TrainingEngine "
                            "(e.g. MoELanguageModule)")
        self.attach(engine, rank=trainer.global_rank, world_size=trainer.world_size,
                    ranks_per_node=max(1, trainer.num_devices), device=pl_module.device)

    def durable_due(self) -> bool:
        """Whether a window persisted since the last call and it is the durable_every-th."""
        if self.durable_every is None or self.coordinator is None:
            return False
        persisted = self.coordinator.store.persisted_start
        if persisted is None or persisted == self._persisted_seen or persisted < self._first_step:
            return False
        self._persisted_seen = persisted
        self._persisted_count += 1
        return self._persisted_count % self.durable_every == 0

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        values = self.step_values()
        if values:
            pl_module.log_dict(values, rank_zero_only=True)
        if self.durable_due():
            # The live state at the step the window persisted: the dense checkpoint that
            # converting the window and replaying up to this step would produce. Lightning's
            # checkpoint IO writes it (asynchronously with AsyncCheckpointIO).
            assert self.durable_dir is not None
            path = f"{self.durable_dir}/step={trainer.global_step}.ckpt"
            trainer.save_checkpoint(path)
            self.durable_saved.append(path)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.close()

    @override
    def state_dict(self) -> dict[str, Any]:
        planner = None if self.coordinator is None else self.coordinator.planner.state_dict()
        return {"policy": self.policy, "planner": planner}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_state = state_dict
