"""Per-rank checkpoint coordinator: planner, snapshot capture, store and replication.

The coordinator is a step hook of the rank's
:class:`~lightning_moe_ckpt.core.target.TrainingTarget` (the built-in engine, a user's
LightningModule or a Fabric loop):

* before optimizer step ``t`` it waits for the copies of SS_{t-1} (measured stall);
* after step ``t`` it feeds the iteration's routing counts to the planner, issues SS_t
  when the plan asks for one (with the metadata replay needs: step, window and order, LR
  scheduler, RNG, data position, clip coefficient, learning rate), files it in the store,
  hands it to the replicator, and promotes/frees windows as replication confirms them.

Before the first step it takes a dense snapshot of the initial state as window ``-1``
(replicated like any other), so a failure before the first window persists still has an
exact state to recover from.

Partial-expert policies (a planner whose ``restore_rule`` is ``partial_restore``) get stores that
also keep each operator's newest save (:mod:`~lightning_moe_ckpt.replication.retention`), and a
planner's ``capacity_factors()`` (MoEtion's boost for stale experts) are handed to the target's MoE
layers after every step, as device tensors (no host sync), where the target supports capacity
factors.

A :attr:`~CheckpointCoordinator.window_filter` (None by default) may leave out whole
windows: it is asked at each window's first step, and a window it refuses is not taken at
all (the bench's paired blocks take snapshots in alternate blocks of steps this way; the
windows taken are complete, checksummed and replicated as usual, and between them the
newest persisted window ages).

Recovery sees the coordinator through
:class:`~lightning_moe_ckpt.recovery.side.CheckpointSide`, its verbs.
"""

from __future__ import annotations

import logging
import queue
import time
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_moe_ckpt.checkpointing.metrics import CheckpointMetrics
from lightning_moe_ckpt.core.target import StepHooks, StepResult, TrainingTarget
from lightning_moe_ckpt.planning.schedule import specs_from_registry
from lightning_moe_ckpt.replication.replicator import Replicator
from lightning_moe_ckpt.replication.retention import (
    RetainedSaves,
    RetainingReplicaStore,
    RetainingSnapshotStore,
)
from lightning_moe_ckpt.snapshots.capture import SnapshotCapture
from lightning_moe_ckpt.snapshots.checksum import default_threads
from lightning_moe_ckpt.snapshots.disk import DiskWriter
from lightning_moe_ckpt.snapshots.helper_threads import DEFAULT_HELPER_NICE, require_helper_nice
from lightning_moe_ckpt.snapshots.snapshot import HostBufferPool, Snapshot
from lightning_moe_ckpt.snapshots.store import SnapshotStore

if TYPE_CHECKING:
    from lightning_moe_ckpt.planning.planner import CapturePlan, Planner

log = logging.getLogger("lightning_moe_ckpt")


class CheckpointCoordinator(StepHooks):
    """Drives sparse (or dense) snapshots of one rank around its optimizer steps."""

    def __init__(self, target: TrainingTarget, planner: Planner, rank: int, world_size: int,
                 replicas: int, ranks_per_node: int, device: torch.device,
                 copy_delay_s: float = 0.0, initial_plan: CapturePlan | None = None,
                 disk_dir: str | None = None, share_same_node: bool = True,
                 checksum_threads: int | None = None,
                 helper_nice: int = DEFAULT_HELPER_NICE) -> None:
        require_helper_nice(helper_nice)
        self.target = target
        self.helper_nice = helper_nice  # added to the helper threads' nice value
        # Asked at each window's first step whether to take that window (None: take all).
        self.window_filter: Callable[[CapturePlan], bool] | None = None
        self._taking_window = True
        self.planner = planner
        self.rank = rank
        self.world_size = world_size
        self.pool = HostBufferPool(pin_memory=device.type == "cuda")
        self.capture = SnapshotCapture(target.registry, target.state, rank, device,
                                        self.pool, copy_delay_s,
                                        checksum_threads=(checksum_threads
                                                          or default_threads(ranks_per_node)),
                                        helper_nice=helper_nice)
        effective = min(replicas, world_size - 1)
        self._acks: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        acknowledge = lambda start, step: self._acks.put((start, step))  # noqa: E731
        # A snapshot persists by replication to peers, or (CheckFreq) by a write to disk.
        self.disk = (DiskWriter(disk_dir, acknowledge, helper_nice=helper_nice)
                          if disk_dir else None)
        # Partial restores need every operator's newest save, however old.
        partial = planner.restore_rule == "partial_restore"
        store_type = RetainingSnapshotStore if partial else SnapshotStore
        self.store = store_type(self.pool, 1 if self.disk else effective)
        self._replication_args = (effective, ranks_per_node, acknowledge)
        self.share_same_node = share_same_node
        # Sharded data parallelism: a rank's replicas go outside its shard group first.
        layout = target.layout
        self.shard_group = (layout.shard_group if layout.sharded
                            and layout.world_size == world_size else None)
        self.replicator = (Replicator(effective, ranks_per_node, acknowledge,
                                      RetainingReplicaStore() if partial else None,
                                      share_same_node, helper_nice, self.shard_group,
                                      largest_snapshot(target))
                           if effective > 0 and self.disk is None else None)
        self.replica_store = None if self.replicator is None else self.replicator.replicas
        # Every window fetched from a replica peer in a recovery: {rank, window_start,
        # holder}, in the order fetched.
        self.window_fetches: list[dict[str, Any]] = []
        # Deterministic placement, recorded in metrics.json, with the peers (on this node)
        # that map this rank's snapshots rather than copy them.
        self.replica_peers = [] if self.replicator is None else list(self.replicator.peers)
        self.replica_peers_mapping = ([] if self.replicator is None
                                      else sorted(self.replicator.mapping_peers))
        self._slot_bytes_before = 0  # peaks of the replicators before a re-formed group's
        self._replication_cpu_s_before = 0.0  # CPU time of those replicators' threads
        self.measured = CheckpointMetrics(target.registry.names)  # counters, for metrics
        self.profile: dict[str, float] | None = None
        # Called when every rank starts its warm-up profiling over (restart_profiling).
        self.profiling_restarts: list[Callable[[], None]] = []
        self._snapshot_taken = False
        # The start of the newest window whose every snapshot this rank issued: the same
        # window at the same step on every rank (they plan windows together), unlike a
        # window's persistence, which waits on copies, checksums and replica peers.
        self.newest_taken_window: int | None = None
        self._specs_measured = False
        self.paused_forward_backward = 0  # set by a localized recovery this rank sat out
        self._replication_error_reported: BaseException | None = None  # warned of once
        self._period_s: float | None = None
        self._last_step_end: float | None = None
        target.hooks.append(self)
        if initial_plan is not None:
            self._take(initial_plan, result=None)

    @override
    def before_optimizer_step(self, step: int) -> None:
        started = time.thread_time()  # a wait for the copies is no CPU time
        stall = self.capture.wait_copies()
        self.measured.stall_per_step.append(stall)
        if self._snapshot_taken and self._period_s:
            # Dense policies adapt their interval to the measured cost of a snapshot.
            self.planner.record_overhead(self._period_s, stall)
        self.measured.hooks_cpu_s += time.thread_time() - started

    @override
    def after_optimizer_step(self, step: int, result: StepResult) -> None:
        started = time.thread_time()
        now = time.perf_counter()
        self._period_s = now - self._last_step_end if self._last_step_end else None
        self._last_step_end = now
        if not self._specs_measured:  # optimizer state exists from the first step on
            self.planner.update_specs(specs_from_registry(self.target.registry,
                                                          self.target.state))
            self._specs_measured = True
        if result.expert_load is not None and result.soft_load is not None:
            self.planner.observe(step, result.expert_load, result.soft_load)
        self.apply_capacity_factors()
        plan = self.planner.plan(step)
        if plan is not None and self.window_filter is not None:
            if plan.window_index == 0:  # whole windows: decided where one starts
                self._taking_window = self.window_filter(plan)
            plan = plan if self._taking_window else None
        taken = self._take(plan, result) if plan is not None else 0
        self._snapshot_taken = plan is not None
        self.measured.bytes_per_step.append(taken)
        self.drain_acks()
        self.store.refresh()
        if self.replicator is not None:
            self.measured.replication_lag(self.replicator.lag)
            error = self.replicator.error
            if error is not None and error is not self._replication_error_reported:
                self._report_replication_stopped(error)
        self.measured.hooks_cpu_s += time.thread_time() - started

    def _report_replication_stopped(self, error: BaseException) -> None:
        """Say once that replication stopped: the windows taken from now on persist on no
        peer until a recovery forms a new replication group (a peer's death brings one;
        an error of another cause does not, and the job would run unprotected)."""
        self._replication_error_reported = error
        warnings.warn(f"rank {self.rank}: snapshot replication stopped ({error}); windows "
                      "taken from now on are not replicated until a recovery forms a new "
                      "replication group", RuntimeWarning, stacklevel=1)

    def apply_capacity_factors(self) -> None:
        """Hand the planner's per-expert capacity factors (if it has any) to the MoE
        layers for the next iteration; they stay on the device."""
        factors = self.planner.capacity_factors()
        if factors is not None and self.target.supports_capacity_factors:
            self.target.set_capacity_factors(factors)

    def take_base_snapshot(self) -> None:
        """Dense snapshot of the current state as a window of one (the initial state, or
        the state right after a recovery), so a recovery point exists until the next
        window persists."""
        from lightning_moe_ckpt.planning.planner import CapturePlan

        step = self.target.step - 1
        names = tuple(self.target.registry.names)
        self._take(CapturePlan(step, names, (), step, 0, 1, None), result=None)

    def _take(self, plan: CapturePlan, result: StepResult | None) -> int:
        replicator = self.replicator
        # Copied straight into the slot its mapping peers read (slot_placement), when the
        # store lets go of whole snapshots; the engine places host copies only.
        placement = (None if replicator is None or self.store.keeps_released_pieces
                     else replicator.placement)
        snapshot = self.capture.issue(plan, self._metadata(plan, result), placement)
        self.store.add(snapshot)
        if plan.window_index == plan.window - 1:
            self.newest_taken_window = plan.window_start
        self.measured.snapshot_taken(plan)
        if self.replicator is not None:
            self.replicator.submit(snapshot)
        if self.disk is not None:
            self.disk.submit(snapshot)
        return snapshot.nbytes

    def _metadata(self, plan: CapturePlan, result: StepResult | None) -> dict[str, Any]:
        clip = None if result is None or result.clip_coef is None else result.clip_coef
        return {
            "step": plan.iteration, "window_start": plan.window_start,
            "window_index": plan.window_index, "window": plan.window,
            "schedule": plan.schedule, "data_position": plan.iteration + 1,
            **self.target.schedule_state(),
            # On a GPU the snapshot capture copies it to the host with the pieces (no sync).
            "clip_coef": None if clip is None else clip.detach(),
            "lr": None if result is None else result.lr,
        }

    def drain_acks(self) -> None:
        """Mark what replication (or persistence) confirmed since the last call."""
        while True:
            try:
                start, step = self._acks.get_nowait()
            except queue.Empty:
                return
            self.measured.snapshots_confirmed += 1
            self.store.mark_replicated(start, step)

    def wait_copies(self) -> None:
        """Every issued snapshot copy finished: nothing reads the live state any more."""
        self.capture.wait_copies()

    def drain(self) -> None:
        """Recovery prologue: every copy issued before the failure finished and was
        checksummed, replication (or the disk) caught up, confirmed windows promoted."""
        self.capture.wait_copies()
        self.capture.wait_checksums()  # and handed to replication and the disk
        if self.replicator is not None:
            self.replicator.drain()
        if self.disk is not None:
            self.disk.drain()
        self.drain_acks()
        self.store.refresh()

    @property
    def persisted_start(self) -> int | None:
        """The start of this rank's newest persisted window (None: none persisted)."""
        return self.store.persisted_start

    def persisted_window(self) -> tuple[int, list[Snapshot]] | None:
        """This rank's newest persisted window: its start and its snapshots."""
        record = self.store.persisted()
        return None if record is None else (record.start, list(record.snapshots.values()))

    def persisted_window_starts(self) -> list[int]:
        """Starts of the windows this rank's store holds persisted, ascending."""
        return sorted(start for start, record in self.store.windows.items()
                      if record.persisted)

    def own_window(self, start: int) -> list[Snapshot] | None:
        """This rank's snapshots of window ``start`` when its store holds it complete."""
        record = self.store.windows.get(start)
        if record is None or not record.complete:
            return None
        return list(record.snapshots.values())

    def keep_only(self, start: int) -> None:
        """Free every window of this rank's store but ``start``."""
        self.store.discard_except(start)

    def held_window_starts(self) -> set[int]:
        """Windows this rank holds anything of: its own and its peers' replicas."""
        held = set(self.store.windows)
        if self.replicator is not None:
            held |= self.replicator.held_window_starts()
        return held

    @property
    def keeps_replicas(self) -> bool:
        """Whether this rank's snapshots have replica peers."""
        return self.replicator is not None

    def fetch_window(self, source: int, start: int,
                     exclude: Iterable[int]) -> dict[int, dict[str, Any]]:
        """Rank ``source``'s window ``start`` from its first live replica peer not in
        ``exclude`` whose copy is intact, decoded and verified (collective)."""
        if self.replicator is None:
            raise RuntimeError("fetch_window needs replica peers (checkpoint.replicas > 0)")
        window = self.replicator.fetch_window(source, start, exclude=tuple(exclude))
        self.window_fetches.append({"rank": source, "window_start": start,
                                    "holder": self.replicator.last_holder})
        return window

    def retained_saves(self) -> RetainedSaves:
        """The partial baselines' stores: this rank's, and what it holds for its peers."""
        replicator = self.replicator
        replicas = None if replicator is None else replicator.replicas
        if not isinstance(self.store, RetainingSnapshotStore) or not (
                replicas is None or isinstance(replicas, RetainingReplicaStore)):
            raise TypeError(f"checkpoint={self.planner.name} keeps no retained saves: only "
                            "a policy whose restore_rule is partial_restore does")

        def holders(source: int) -> list[int]:
            return [] if replicator is None else replicator.holders(source)

        def group() -> dist.ProcessGroup:
            if replicator is None:
                raise RuntimeError("no replication group: checkpoint.replicas is 0")
            return replicator.live_group()

        return RetainedSaves(self.store, replicas, holders, group)

    def restart_profiling(self) -> None:
        """Start the warm-up profiling over (every rank at once, after a recovery that
        came before any rank had its profile): the ranks then finish warming up at the
        same iteration, as they must, since from there on they agree on W together."""
        for restart in self.profiling_restarts:
            restart()

    def adopt_profile(self, profile: dict[str, float]) -> None:
        """Plan from a peer's measured profile (a replacement joining a running job: every
        rank must plan windows at the same iterations, since they agree on W together)."""
        self.profile = dict(profile)
        self.planner.set_profile(profile["iteration_time_s"], profile["bandwidth_bytes_per_s"])

    def lose_host_state(self) -> None:
        """What a dead worker's host memory held is gone: its snapshots, the saves it
        retained and the replicas it held for its peers."""
        self.store.discard_all()
        if isinstance(self.store, RetainingSnapshotStore):
            self.store.clear_saves()
        if self.replicator is not None:
            self.replicator.replicas.clear()
            self.replicator.abandon_slots()  # in a live process: the peers' copies stay intact

    def release_replication(self) -> None:
        """A peer failed: stop replicating and drop the broken replication group before
        new groups are formed (the replicas this rank holds stay for the recovery)."""
        if self.replicator is not None and not self.replicator.close(timeout_s=10.0):
            log.warning("rank %d: the snapshot replication thread did not stop within 10 s; "
                        "going on without it", self.rank)

    def reform_replication(self) -> None:
        """The process groups were formed anew: replicate over a new group, keeping the
        replicas this rank holds for its peers (collective, like the first one)."""
        old = self.replicator
        if old is None:
            return
        old.close(timeout_s=10.0)  # a survivor's release_replication ran it: returns at once
        old.abandon_slots()
        self._slot_bytes_before = max(self._slot_bytes_before, old.slot_bytes_peak())
        self._replication_cpu_s_before += old.thread_cpu_s
        self.replicator = Replicator(*self._replication_args, old.replicas,
                                     self.share_same_node, self.helper_nice, self.shard_group,
                                     largest_snapshot(self.target))
        self.replica_peers_mapping = sorted(self.replicator.mapping_peers)
        self.replicator.before_payload = old.before_payload

    def restart(self, failed_step: int) -> None:
        """After a recovery: old windows are superseded, the planner starts a new window
        at ``failed_step``, and a dense base snapshot is the recovery point until it
        persists."""
        self.store.discard_all()
        if self.replicator is not None:  # peers may fetch the superseded windows again
            self.replicator.abandon_slots()
        self.planner.on_recovery(failed_step)
        self.take_base_snapshot()

    def flush(self) -> None:
        """Wait for outstanding copies and replication; promote what persisted."""
        self.capture.wait_copies()
        self.capture.wait_checksums()  # and handed to replication and persistence
        if self.replicator is not None:
            self.measured.replication_lag(self.replicator.lag)
            self.replicator.close()
            self.replicator.abandon_slots()
            self._slot_bytes_before = self.slot_bytes_peak()
            self._replication_cpu_s_before = self.replication_cpu_s()
            self.replicator = None
        if self.disk is not None:
            self.disk.close()
        self.drain_acks()
        self.store.refresh()

    def close(self) -> None:
        """Flush and stop background threads."""
        self.flush()
        self.capture.close()

    def slot_bytes_peak(self) -> int:
        """Most shared memory this rank's encoded snapshots occupied (for mapping peers)."""
        current = 0 if self.replicator is None else self.replicator.slot_bytes_peak()
        return max(self._slot_bytes_before, current)

    def replication_cpu_s(self) -> float:
        """CPU time this rank's replication threads spent replicating, all groups'."""
        current = 0.0 if self.replicator is None else self.replicator.thread_cpu_s
        return self._replication_cpu_s_before + current

    def replica_window(self, source: int, window_start: int) -> dict[int, torch.Tensor]:
        """Serialized snapshots of ``source``'s window that this rank holds as a peer."""
        return {} if self.replica_store is None else self.replica_store.window(source,
                                                                               window_start)

    def metrics(self, train_seconds: float) -> dict[str, Any]:
        """Checkpoint figures for ``metrics.json``: the counters it reported, and what its
        store, buffers, replication and capture hold and did."""
        steps = self.measured.steps
        return {
            "checkpoint_policy": self.planner.name,
            **self.measured.report(train_seconds),
            "persisted_window_start": self.store.persisted_start,
            "host_snapshot_bytes_peak": self.store.peak_bytes,
            # Of those, in host buffers of the rank's own: snapshots placed in shared slots
            # are in shared_slot_bytes_peak.
            "host_snapshot_own_bytes_peak": self.store.peak_own_bytes,
            "host_buffer_bytes": self.pool.allocated_bytes,
            "replica_bytes": 0 if self.replica_store is None else self.replica_store.nbytes(),
            "replica_mapped_bytes": (0 if self.replica_store is None
                                     else self.replica_store.mapped_nbytes()),
            "shared_slot_bytes_peak": self.slot_bytes_peak(),
            "replica_peers": self.replica_peers,
            "replica_peers_mapping": self.replica_peers_mapping,
            # This rank's checkpoint work, CPU ms per iteration: its threads' (the work they
            # take from training where cores are shared, steadier than wall-time ratios)
            # and the training thread's in the step hooks.
            "checkpoint_thread_cpu_ms_per_iter": {
                "copy": 1e3 * (self.capture.worker_cpu_s
                               + self.capture.checksums.pool_cpu_s) / steps,
                "replication": 1e3 * self.replication_cpu_s() / steps,
                "training_hooks": 1e3 * self.measured.hooks_cpu_s / steps},
            # The behind-compute copies: their time (CUDA: side-stream events) and the
            # bandwidth they achieved, against the profile's measured copy bandwidth.
            "snapshot_copy_ms_per_iter": 1e3 * self.capture.copy_s / steps,
            "snapshot_copy_gbps": (self.capture.bytes_copied / self.capture.copy_s / 1e9
                                   if self.capture.copy_s else None),
            "checksum_threads": self.capture.checksums.threads,
            "helper_nice": self.helper_nice,
            "pieces_issued": self.capture.pieces_issued,
            "pieces_checksummed": self.capture.pieces_checksummed,
            "persisted_files": [] if self.disk is None else self.disk.written[-2:],
        }


# An encoded snapshot is at most this many times a rank's whole state (compute weights,
# master weights, optimizer state, buffers), plus this many bytes of framing and metadata.
_LARGEST_FACTOR = 4
_LARGEST_SLACK = 64 << 20


def largest_snapshot(target: TrainingTarget) -> int:
    """A bound on this rank's encoded snapshots in bytes: its whole state, as measured
    from the live optimizer or as AdamW would hold it (the larger), with room to spare.
    A replica peer refuses an announced length beyond it before allocating."""
    nominal = sum(op.nbytes.compute + op.nbytes.master_state for op in target.registry)
    measured = sum(spec.compute_bytes + spec.master_state_bytes
                   for spec in specs_from_registry(target.registry, target.state))
    return _LARGEST_FACTOR * max(nominal, measured) + _LARGEST_SLACK
