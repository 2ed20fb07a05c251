"""Sparse-to-dense conversion: rebuild the exact dense state from a persisted window.

Given the snapshots SS_s .. SS_{s+W-1} of a window (this rank's operators):

1. load SS_s: operators of its turn get their master state (fp32 master weights, AdamW
   moments, step counters) and become *active*; every other operator gets its compute
   weights at ``s`` and is *frozen* (no weight gradient, no optimizer update, input
   gradients still flow); the LR schedule and learning rates are restored from SS_s;
2. replay iteration ``s+1`` with the clip coefficient the original run logged for it (the
   global norm cannot be recomputed while some operators are frozen), then load SS_{s+1}:
   its turn becomes active with master state at ``s+1``, the still-frozen operators take
   their compute weights at ``s+1``; and so on until every operator is active, which is
   the dense state at ``s+W-1``;
3. replay, all active, up to the iteration that failed.

Because frozen execution leaves input gradients bitwise unchanged and the optimizer skips
frozen parameters, every replayed step reproduces the original one exactly, so the state
after recovery is bitwise equal to the state of a run that never failed. The initial-state
snapshot (window ``-1``, every operator's master state) is a window of one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lightning_moe_ckpt.core.progress import RECOVERY
from lightning_moe_ckpt.core.target import TrainingTarget
from lightning_moe_ckpt.errors import RecoveryInterrupted
from lightning_moe_ckpt.snapshots.codec import CorruptCheckpointError
from lightning_moe_ckpt.snapshots.snapshot import Snapshot

if TYPE_CHECKING:
    from lightning_moe_ckpt.recovery.side import CheckpointSide

SnapshotView = Mapping[str, Any]  # {"step", "metadata", "pieces": {op: {"kind", "tensors"}}}


def snapshot_view(snapshot: Snapshot) -> dict[str, Any]:
    """A local :class:`Snapshot` in the shape decoded replicas have, every piece verified
    against its checksum first (nothing corrupt is restored, from host memory either).

    Raises :class:`CorruptCheckpointError` naming rank, operator and iteration for a piece
    whose bytes changed or that has no checksum (its copy was cut short by a failure)."""
    for name, piece in snapshot.pieces.items():
        if not piece.verify():
            reason = ("has no checksum (its copy was cut short)" if piece.checksum is None
                      else "fails its checksum")
            raise CorruptCheckpointError(
                f"checkpoint piece of rank {snapshot.rank}, operator {name!r}, iteration "
                f"{snapshot.step} {reason}")
    return {"step": snapshot.step, "metadata": snapshot.metadata,
            "pieces": {name: {"kind": piece.kind, "tensors": piece.tensors}
                       for name, piece in snapshot.pieces.items()}}


@dataclass(frozen=True)
class Cascade:
    """A failure during an ongoing recovery (paper Appendix A).

    Args:
        ranks: The global ranks that fail.
        fail: Called on every rank; destroys this rank's state when it is one of
            ``ranks``.
        after_replayed: The failure strikes once the recovering ranks have replayed this
            many iterations.
    """

    ranks: tuple[int, ...]
    fail: Callable[[], None]
    after_replayed: int = 1


@dataclass
class RecoveryReport:
    """What one recovery did, for ``metrics.json``.

    Partial restores (MoC, MoEtion) lose updates; exact recoveries report zeros in
    ``lost_tokens``, ``lost_token_portion`` and ``stale_experts``.

    Attributes:
        window_start: The step the restored state belongs to (the window's first
            snapshot, or the durable checkpoint's step).
        window: Snapshots in the window recovered from (0: a durable checkpoint).
        failed_step: The iteration that failed; the target runs it next.
        replayed: Iterations replayed.
        phases_s: Seconds per recovery phase (``detect``, ``fetch``, ``convert_load``,
            ``convert``, ``replay``, ``resume``, ``total``; those that ran).
        forward_backward_calls: Forward-backward passes on this rank during the recovery.
        lost_tokens: Expert assignments whose update was lost, all layers.
        lost_token_portion: The policy's lost-token proportion after the recovery.
        stale_experts: Experts restored from a save older than the rest.
        rounds: Rounds the recovery took: 2 when a cascading failure restarted it.
    """

    window_start: int
    window: int
    failed_step: int
    replayed: int = 0
    phases_s: dict[str, float] = field(default_factory=dict)
    forward_backward_calls: int = 0
    lost_tokens: int = 0
    lost_token_portion: float = 0.0
    stale_experts: tuple[str, ...] = ()
    rounds: int = 1

    def merge_restart(self, earlier: RecoveryReport) -> None:
        """Fold in the work of an interrupted earlier round (its replay was wasted)."""
        self.replayed += earlier.replayed
        self.rounds += earlier.rounds
        for phase, seconds in earlier.phases_s.items():
            self.phases_s[phase] = self.phases_s.get(phase, 0.0) + seconds


@torch.no_grad()
def load_piece(target: TrainingTarget, operator: str, piece: Mapping[str, Any]) -> None:
    """Load one snapshot piece of ``operator``: compute weights, or master weights
    (compute weights rounded from them) with their optimizer state; its persistent
    buffers either way."""
    load = target.state.load_compute if piece["kind"] == "compute" else target.state.load_master
    op = target.registry[operator]
    for part in op.parts:
        load(part, piece["tensors"])
    for buffer in op.buffers:
        buffer.tensor.copy_(piece["tensors"][buffer.snapshot_key])


def sparse_to_dense(target: TrainingTarget, window: Sequence[SnapshotView], failed_step: int,
                    clip_coefs: Mapping[int, torch.Tensor] | None = None,
                    stop_after: int | None = None) -> RecoveryReport:
    """Rebuild the dense state from ``window`` and replay up to ``failed_step`` (the
    iteration that did not complete); the engine is then ready to run it again.
    ``clip_coefs`` (logged per iteration) replace every recomputed clip coefficient: a
    localized replay cannot form the global gradient norm. ``stop_after`` (failure
    injection) raises :class:`RecoveryInterrupted` once that many iterations replayed."""
    window = sorted(window, key=lambda view: view["step"])
    start = window[0]["step"]
    report = RecoveryReport(start, len(window), failed_step)
    registry = target.registry
    started = time.perf_counter()
    with target.hooks_suspended():  # replay re-takes no snapshots
        first = window[0]
        for operator, piece in first["pieces"].items():
            load_piece(target, operator, piece)
        active = {op for op, piece in first["pieces"].items() if piece["kind"] == "master"}
        registry.set_frozen([n for n in registry.names if n not in active])
        registry.set_frozen(sorted(active), frozen=False)
        target.restore_schedule_state(first["metadata"])
        target.set_step(start + 1)
        report.phases_s["convert_load"] = time.perf_counter() - started
        converting = time.perf_counter()
        for view in window[1:]:
            step = view["step"]
            clip = view["metadata"]["clip_coef"] if clip_coefs is None else clip_coefs[step]
            _check_interrupt(report, stop_after)
            target.replay_iteration(step, clip)
            report.replayed += 1
            RECOVERY.mark()
            for operator, piece in view["pieces"].items():
                if piece["kind"] == "master" or operator not in active:
                    load_piece(target, operator, piece)
            newly = {op for op, piece in view["pieces"].items() if piece["kind"] == "master"}
            registry.set_frozen(sorted(newly), frozen=False)
            active |= newly
        missing = [n for n in registry.names if n not in active]
        if missing:
            raise RuntimeError(f"window starting at {start} never captured the master state "
                               f"of {missing[:5]}")
        report.phases_s["convert"] = time.perf_counter() - converting
        replaying = time.perf_counter()
        for step in range(start + len(window), failed_step):
            _check_interrupt(report, stop_after)
            target.replay_iteration(step, None if clip_coefs is None else clip_coefs[step])
            report.replayed += 1
            RECOVERY.mark()
        report.phases_s["replay"] = time.perf_counter() - replaying
        _check_interrupt(report, stop_after)  # a replay shorter than the cascade's delay
        target.resume_at(failed_step)
    return report


def _check_interrupt(report: RecoveryReport, stop_after: int | None) -> None:
    if stop_after is not None and report.replayed >= stop_after:
        raise RecoveryInterrupted(report)


def recover_from_store(side: CheckpointSide, failed_step: int) -> RecoveryReport:
    """Rollback of one process from its own store: drop the in-flight window (its host
    copies died with the failure), convert the newest persisted window and replay."""
    started = time.perf_counter()
    side.drain()
    persisted = side.persisted_window()
    if persisted is None:
        raise RuntimeError("no persisted checkpoint to recover from (not even the initial "
                           "state): was SparseCheckpointing attached before training?")
    start, snapshots = persisted
    side.keep_only(start)
    views = [snapshot_view(s) for s in snapshots]
    fetched = time.perf_counter()
    report = sparse_to_dense(side.target, views, failed_step)
    side.planner.on_recovery(failed_step)
    report.phases_s["fetch"] = fetched - started
    return report
