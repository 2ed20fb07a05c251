"""Partial restore: how the MoC and MoEtion baselines recover (stale experts, lost tokens).

These policies never replay a conversion: every rank (data-parallel replicas of an expert
must stay identical, so all of them restore the same checkpoint) calls
:func:`partial_restore` at the failed iteration ``F``:

1. copies and replication are drained, so every snapshot taken before the failure is on
   its replica peers; a failed rank's host memory is gone (its store, its retained saves
   and the replicas it held for others);
2. the ranks agree on ``e``, the newest iteration whose snapshot every rank has persisted
   (a failed rank's frontier is what its live replica peers hold of it). After the drain
   this is ``F - 1``: partial policies snapshot every iteration;
3. every rank gets, for each of its operators, the newest persisted master save at or
   before ``e``: non-experts (in every snapshot) from SS_e, each expert from the last
   snapshot that captured it (the stores keep it, see
   :mod:`~lightning_moe_ckpt.replication.retention`). Surviving ranks read their own
   store, failed ranks receive the pieces from their first intact live replica peer,
   which cuts them out of its serialized copies; every piece's checksum is verified;
4. the saves are loaded (all operators active), the LR schedule, param groups, RNG and
   step counter come from SS_e's metadata, and iterations ``e+1 .. F-1`` (none after a
   drain) are recomputed normally;
5. windows restart at ``F`` with a dense base snapshot, and the planner books the tokens
   routed to each expert since its restored save as lost (MoEtion also boosts the
   capacity of those stale experts until the deficit is repaid; the boost is handed to the
   model at once). The report carries the lost tokens, MoC's lost-token proportion and
   the stale experts.

The result is deliberately *not* the fault-free state: that is the contrast with
MoEvement and with the dense baselines, which replay to the exact state. Because every
save the planner planned up to ``e`` is restored, the planner's tokens-since-last-save
counters are exactly the lost tokens. Should ``e < F - 1`` (a snapshot that never
persisted), the counters also include the tokens of the recomputed iterations.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from lightning_moe_ckpt.core.collectives import all_gather_values
from lightning_moe_ckpt.core.progress import RECOVERY
from lightning_moe_ckpt.core.target import TrainingTarget
from lightning_moe_ckpt.core.wire import WireFormatError, dumps, loads
from lightning_moe_ckpt.planning.schedule import expert_position
from lightning_moe_ckpt.recovery.side import CheckpointSide
from lightning_moe_ckpt.recovery.sparse_to_dense import (
    RecoveryReport,
    load_piece,
)
from lightning_moe_ckpt.replication.retention import (
    RetainedSaves,
    RetainingReplicaStore,
    RetainingSnapshotStore,
)
from lightning_moe_ckpt.snapshots.codec import (
    CorruptCheckpointError,
    decode_snapshot,
    split_pieces,
)
from lightning_moe_ckpt.snapshots.snapshot import SnapshotPiece

Save = tuple[int, dict[str, Any]]  # (iteration, {"kind", "tensors"}) of one operator
Restore = tuple[dict[str, Save], dict[str, Any]]  # saves by operator, SS_e's metadata


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(value: Any) -> list[Any]:
    """Everyone's ``value`` (just ours in one process)."""
    _, world = _world()
    if world == 1:
        return [value]
    return all_gather_values(value)


def _raise_if_any(error: str | None) -> None:
    """Collective: every rank raises when any rank reports an error."""
    problems = [e for e in _gather(error) if e is not None]
    if problems:
        raise CorruptCheckpointError("partial restore impossible: " + "; ".join(problems))


def _drain(side: CheckpointSide, forget: bool) -> None:
    """Step 1: everything taken before the failure is copied, checksummed, replicated."""
    side.drain()
    if forget:  # a dead worker's host memory: snapshots, retained saves, held replicas
        side.lose_host_state()


def _persisted_steps(store: RetainingSnapshotStore) -> list[int]:
    """Steps of this rank's own snapshots that persisted (replicated, or, with nothing to
    replicate to, checksummed)."""
    return sorted(step for record in store.windows.values()
                  for step, snapshot in record.snapshots.items()
                  if step in record.replicated
                  or (store.replicas == 0 and snapshot.checksummed.is_set()))


def _holders(saves: RetainedSaves, source: int, failed: tuple[int, ...]) -> list[int]:
    return [p for p in saves.holders(source) if p not in failed]


def agree_on_step(saves: RetainedSaves, failed: tuple[int, ...]) -> int:
    """Step 2 (collective): the newest iteration every rank's snapshot persisted at."""
    rank, world = _world()
    store, replicas = saves.store, saves.replicas
    own = _persisted_steps(store)
    held = {} if replicas is None else {
        source: max(step for steps in windows.values() for step in steps)
        for source, windows in replicas.windows.items() if any(windows.values())}
    reports = _gather((None if rank in failed or not own else own[-1], held))
    frontiers: dict[int, int | None] = {}
    for source in range(world):
        if source not in failed:
            frontiers[source] = reports[source][0]
            continue
        copies = [reports[h][1][source] for h in _holders(saves, source, failed)
                  if source in reports[h][1]]
        frontiers[source] = max(copies) if copies else None
    lost = [source for source, frontier in frontiers.items() if frontier is None]
    if lost:
        raise CorruptCheckpointError(
            f"no persisted snapshot of rank(s) {lost} survives (checkpoint.replicas keeps "
            "copies on peers; with 0 a failed rank's snapshots die with it)")
    return min(f for f in frontiers.values() if f is not None)


def _newest(saves: dict[str, Save], name: str, step: int, piece: dict[str, Any]) -> None:
    if piece["kind"] == "master" and (name not in saves or saves[name][0] < step):
        saves[name] = (step, piece)


def _local_restore(store: RetainingSnapshotStore, rank: int, step: int) -> Restore | str:
    """Step 3 on a rank whose host memory survived: the newest save of each operator up
    to ``step`` from its own store, checksums verified; or what is wrong."""
    newest: dict[str, tuple[int, SnapshotPiece]] = {}
    metadata = None
    candidates = [s for record in store.windows.values() for s in record.snapshots.values()]
    for snapshot in [*candidates, *store.saves.values()]:
        if snapshot.step > step:
            continue
        if snapshot.step == step and snapshot.metadata:
            metadata = snapshot.metadata
        for name, piece in snapshot.pieces.items():
            if piece.kind == "master" and newest.get(name, (snapshot.step - 1,))[0] < snapshot.step:
                newest[name] = (snapshot.step, piece)
    if metadata is None:
        return f"rank {rank}: snapshot of iteration {step} is missing"
    for name, (saved_at, piece) in newest.items():
        if not piece.verify():
            return (f"rank {rank}: checkpoint piece of operator {name!r}, iteration "
                    f"{saved_at} fails its checksum")
    return ({name: (saved_at, {"kind": piece.kind, "tensors": piece.tensors})
             for name, (saved_at, piece) in newest.items()}, metadata)


def _bundle(replicas: RetainingReplicaStore, source: int, step: int) -> dict[str, Any]:
    """What a replica peer sends a failed ``source``: SS_step whole, plus each operator's
    newest older save cut out of the serialized copies it holds."""
    held = {(start, s): data for start, steps in replicas.windows.get(source, {}).items()
            for s, data in steps.items() if s <= step}
    base = next((data for (_, s), data in held.items() if s == step), None)
    if base is None:
        return {"error": f"snapshot of iteration {step} is not held"}
    newest: dict[str, tuple[int, Any]] = {}
    for key, names in replicas.masters.get(source, {}).items():
        if key in held:
            for name in names:
                if newest.get(name, (key[1] - 1,))[0] < key[1]:
                    newest[name] = (key[1], key)
    for name, (saved_at, data) in replicas.held_saves(source).items():
        if saved_at <= step and newest.get(name, (saved_at - 1,))[0] < saved_at:
            newest[name] = (saved_at, data)
    pieces: dict[str, tuple[int, torch.Tensor]] = {}
    by_snapshot: dict[tuple[int, int], list[str]] = {}
    for name, (saved_at, where) in newest.items():
        if saved_at == step:
            continue  # in SS_step itself
        if isinstance(where, torch.Tensor):
            pieces[name] = (saved_at, where)
        else:
            by_snapshot.setdefault(where, []).append(name)
    for key, wanted in by_snapshot.items():
        for name, data in split_pieces(held[key], wanted).items():
            pieces[name] = (key[1], data)
    return {"base": base, "pieces": pieces}


def _send_bundle(bundle: dict[str, Any], dst: int, group: dist.ProcessGroup) -> None:
    """Send a bundle as wire-format bytes behind their length (never pickled)."""
    data = torch.frombuffer(bytearray(dumps(bundle, "a partial restore bundle")),
                            dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=dst, group=group)
    dist.send(data, dst=dst, group=group)


def _receive_bundle(src: int, group: dist.ProcessGroup) -> dict[str, Any]:
    """A bundle :func:`_send_bundle` sent, decoded by the wire format alone."""
    length = torch.empty(1, dtype=torch.int64)
    dist.recv(length, src=src, group=group)
    data = torch.empty(int(length), dtype=torch.uint8)
    dist.recv(data, src=src, group=group)
    try:
        bundle = loads(data.numpy().data)
    except WireFormatError as error:
        return {"error": f"the bundle from rank {src} does not decode: {error}"}
    if not isinstance(bundle, dict):
        return {"error": f"the bundle from rank {src} is not a bundle"}
    return bundle


def _unbundle(bundle: dict[str, Any], step: int) -> Restore | str:
    if "error" in bundle:
        return str(bundle["error"])
    try:
        base = decode_snapshot(bundle["base"])
        saves: dict[str, Save] = {}
        for name, piece in base["pieces"].items():
            _newest(saves, name, step, piece)
        for name, (saved_at, data) in bundle["pieces"].items():
            _newest(saves, name, saved_at, decode_snapshot(data)["pieces"][name])
    except CorruptCheckpointError as error:
        return str(error)
    return saves, base["metadata"]


def _fetch(saves: RetainedSaves, failed: tuple[int, ...], step: int) -> Restore | None:
    """Step 3 for failed ranks (collective): each receives its bundle from its first live
    replica peer whose copy is intact; returns this rank's restore if it is a failed one."""
    rank, _ = _world()
    mine: Restore | None = None
    for source in failed:
        problems = []
        holders = _holders(saves, source, failed)
        for holder in holders:
            outcome: Restore | str | None = None
            if rank == holder:
                assert saves.replicas is not None  # holders exist only with replicas
                _send_bundle(_bundle(saves.replicas, source, step), source, saves.group())
            elif rank == source:
                outcome = _unbundle(_receive_bundle(holder, saves.group()), step)
            verdicts = _gather(outcome if isinstance(outcome, str) else None)
            if verdicts[source] is None:
                if rank == source:
                    assert outcome is not None and not isinstance(outcome, str)
                    mine = outcome
                break
            problems.append(f"replica on rank {holder}: {verdicts[source]}")
        else:
            raise CorruptCheckpointError(
                f"no intact copy of the checkpoint of rank {source} up to iteration {step}: "
                + ("; ".join(problems) or "no live replica peer"))
    return mine


@torch.no_grad()
def _load(engine: TrainingTarget, saves: dict[str, Save], metadata: dict[str, Any],
          step: int) -> tuple[list[str], str | None]:
    """Step 4: load every operator's save, all active; returns the stale experts (saved
    before ``step``) or what is missing."""
    registry = engine.registry
    missing = [name for name in registry.names if name not in saves]
    if missing:
        return [], (f"no persisted save of operator(s) {missing[:5]} at or before iteration "
                    f"{step}")
    for name in registry.names:
        load_piece(engine, name, saves[name][1])
    registry.set_frozen(registry.names, frozen=False)
    engine.restore_schedule_state(metadata)
    engine.set_step(step + 1)
    stale = [name for name in registry.names
             if saves[name][0] < step and expert_position(name) is not None]
    return stale, None


def _forget_saves(saves: RetainedSaves) -> None:
    """The dense base snapshot taken next supersedes every older save, here and on the
    replica peers (and no save of the abandoned iterations may ever be restored)."""
    saves.store.clear_saves()
    if saves.replicas is not None:
        saves.replicas.clear()


def partial_restore(coordinator: CheckpointSide, failed_step: int,
                    failed_ranks: Iterable[int]) -> RecoveryReport:
    """Restore every rank from its newest persisted saves and continue at ``failed_step``
    (collective when distributed; see the module docstring)."""
    started = time.perf_counter()
    rank, world = _world()
    failed = tuple(sorted(set(failed_ranks)))
    # One process: its host memory survives a device failure.
    lost_host = world > 1 and rank in failed
    saves = coordinator.retained_saves()
    _drain(coordinator, forget=lost_host)
    step = agree_on_step(saves, failed if world > 1 else ())
    local = None if lost_host else _local_restore(saves.store, rank, step)
    _raise_if_any(local if isinstance(local, str) else None)
    fetched = _fetch(saves, failed, step) if world > 1 else None
    restore = fetched if lost_host else local
    assert restore is not None and not isinstance(restore, str)  # errors raised above
    fetched_at = time.perf_counter()
    engine = coordinator.target
    stale, error = _load(engine, *restore, step)
    _raise_if_any(error)
    report = RecoveryReport(step, 1, failed_step)
    report.phases_s["convert_load"] = time.perf_counter() - fetched_at
    recomputing = time.perf_counter()
    with engine.hooks_suspended():  # recomputation takes no snapshots
        for iteration in range(step + 1, failed_step):
            engine.replay_iteration(iteration, None)
            report.replayed += 1
            RECOVERY.mark()
            report.forward_backward_calls += 1
    engine.resume_at(failed_step)
    report.phases_s["replay"] = time.perf_counter() - recomputing
    _forget_saves(saves)
    coordinator.restart(failed_step)  # the planner books the lost tokens here
    coordinator.apply_capacity_factors()
    planner = coordinator.planner
    report.lost_tokens = planner.lost_tokens()
    report.lost_token_portion = planner.lost_token_portion()
    report.stale_experts = tuple(sorted({name for names in _gather(stale) for name in names}))
    report.phases_s["fetch"] = fetched_at - started
    return report
