"""Failure-injection workloads run inside the gloo worker processes of the recovery tests.

Every scenario trains through :class:`FailureInjector` exactly as the recipes do (moevement
snapshots replicated to 2 peers, upstream logging on or off) and is compared on rank 0
with a fault-free run of the same world, so one spawned world serves a whole list of
scenarios: a golden run plus each failure pattern.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_moe_ckpt.callbacks import SparseCheckpointing
from lightning_moe_ckpt.checkpointing.coordinator import CheckpointCoordinator
from lightning_moe_ckpt.core.layout import build_mesh, mesh_coordinates
from lightning_moe_ckpt.testing import FailureInjector
from lightning_moe_ckpt.testing.faults import AtSchedule
from lightning_moe_ckpt.training.consolidate import gather_consolidated_state
from lightning_moe_ckpt.training.data import build_data
from lightning_moe_ckpt.training.distributed_executor import build_parallel_engine
from moe_recipes.settings import RunSettings
from tests.distributed.workloads import distributed_run


def injected_run(settings: RunSettings, window: int, events: list[dict[str, Any]],
                 upstream_logging: bool = True,
                 corrupt_local: tuple[int, int] | None = None,
                 damage_replicas: tuple[int, int] | None = None) -> dict[str, Any]:
    """Train ``settings.max_steps`` with the failures ``events`` injected; returns the
    consolidated state (rank 0), the losses and, gathered, every rank's facts.
    ``corrupt_local=(rank, step)``: before ``step``, that rank flips a bit in its own
    host copy of every snapshot already replicated (the replicas stay intact).
    ``damage_replicas=(rank, step)``: before ``step``, that rank flips a byte in the header
    of every replica it holds for its peers."""
    plan = settings.layout
    mesh = build_mesh(plan, "cpu")
    coords = mesh_coordinates(mesh)
    rank, world = dist.get_rank(), dist.get_world_size()
    checkpointing = SparseCheckpointing("moevement", replicas=2, window=window,
                                        upstream_logging=upstream_logging)
    hooks = [] if checkpointing.upstream_log is None else [checkpointing.upstream_log]
    engine = build_parallel_engine(settings, mesh, torch.device("cpu"), hooks)
    sampler = build_data(settings).train
    shard = plan.data_shard(coords)
    coordinator = checkpointing.attach(engine, rank=rank, world_size=world)
    injector = FailureInjector(AtSchedule(events, world_size=world), checkpointing)
    engine.batch = lambda t: sampler.iteration(t, shard)
    injector.attach(engine, rank, world)
    destroyed: list[bool] = []  # per destruction: every parameter became garbage
    destroy = injector._destroy

    def destroy_and_check() -> None:
        destroy()
        destroyed.append(all(bool(torch.isnan(p).all()) for p in engine.model.parameters()))

    injector._destroy = destroy_and_check  # type: ignore[method-assign]
    calls = getattr(engine.executor, "forward_backward_calls", 0)
    losses, corrupted = [], 0
    for t in range(settings.max_steps):
        if corrupt_local == (rank, t):
            corrupted = _corrupt_replicated_snapshots(coordinator)
        if damage_replicas == (rank, t):
            corrupted = _damage_replica_headers(coordinator)
        losses.append(float(engine.train_iteration(*sampler.iteration(t, shard)).loss))
    checkpointing.close()
    state = gather_consolidated_state(engine, coords, settings.max_steps)
    facts = {"destroyed": destroyed, "recoveries": injector.recoveries, "corrupted": corrupted,
             "failures": injector.counter.total,
             "paused_calls": getattr(coordinator, "paused_forward_backward", None),
             "calls": getattr(engine.executor, "forward_backward_calls", 0) - calls}
    everything: list[Any] = [None] * world
    dist.all_gather_object(everything, facts)
    return {"state": state, "losses": losses, "ranks": everything}


def _corrupt_replicated_snapshots(coordinator: Any) -> int:
    """Flip one bit of one piece in every local snapshot its replica peers confirmed;
    returns how many snapshots were corrupted."""
    coordinator.drain_acks()
    corrupted = 0
    for record in coordinator.store.windows.values():
        for step, snapshot in record.snapshots.items():
            if step in record.replicated and snapshot.pieces:
                piece = next(iter(snapshot.pieces.values()))
                flat = next(iter(piece.tensors.values())).view(-1).view(torch.uint8)
                flat[len(flat) // 2] ^= 4
                corrupted += 1
    return corrupted


def _damage_replica_headers(coordinator: Any) -> int:
    """Flip a byte in the header of every replica this rank holds (copies, so a mapped
    source's own memory stays intact); returns how many were damaged."""
    coordinator.replicator.drain()
    damaged = 0
    for windows in list(coordinator.replicator.replicas.windows.values()):
        for held in list(windows.values()):
            for step, data in list(held.items()):
                copy = data.clone()
                copy[-20] ^= 0x10  # inside the header, before its checksum and length
                held[step] = copy
                damaged += 1
    return damaged


def state_mismatches(golden: dict[str, Any], state: dict[str, Any]) -> list[str]:
    """Entries of a consolidated state that are not bitwise equal to the golden one."""
    problems = [] if state["step"] == golden["step"] else ["step"]
    for section in ("model", "compute"):
        for name, tensor in golden[section].items():
            if not torch.equal(state[section][name], tensor):
                problems.append(f"{section}:{name}")
    for name, entries in golden["optimizer"].items():
        for key, tensor in entries.items():
            if not torch.equal(state["optimizer"][name][key], tensor):
                problems.append(f"optimizer:{name}:{key}")
    return problems


def scenario_matrix(settings: RunSettings, window: int,
                    scenarios: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The fault-free run, then every scenario (``{"events": [...], "upstream_logging":
    bool}``); rank 0 returns per scenario the mismatches of the final state, the losses
    from the first failure on, and every rank's facts."""
    golden_state, golden_losses = distributed_run(settings)
    results: dict[str, Any] = {}
    for name, scenario in scenarios.items():
        run = injected_run(settings, window, scenario["events"],
                           scenario.get("upstream_logging", True),
                           scenario.get("corrupt_local"), scenario.get("damage_replicas"))
        first = min(event["step"] for event in scenario["events"])
        results[name] = {
            "ranks": run["ranks"],
            "state_mismatches": None if golden_state is None
            else state_mismatches(golden_state, run["state"]),
            "losses_after": run["losses"][first:], "golden_after": golden_losses[first:],
        }
    return results


def recovery_error(settings: RunSettings, window: int, events: list[dict[str, Any]]) -> str:
    """Run :func:`injected_run` where recovery must fail; returns the error it raised
    (every rank raises alike)."""
    from lightning_moe_ckpt.recovery.durable import NoUsableCheckpointError

    try:
        injected_run(settings, window, events)
    except NoUsableCheckpointError as error:
        return f"{error} (cause: {error.__cause__})"
    raise AssertionError("recovery succeeded although no checkpoint was usable")


def ahead_run(settings: RunSettings, window: int, step: int, failed: tuple[int, ...],
              ahead: tuple[int, ...], fold_ahead_into_failed: bool,
              lagging: tuple[int, ...] = ()) -> dict[str, Any]:
    """Train with a real failure seen late: before ``step`` the ``failed`` ranks lose their
    state and the ``ahead`` ranks' live state runs past the others' (their parameters
    move, as iteration ``step``'s update would move them), then everyone calls
    :func:`recover` as the real-failure handler does. ``fold_ahead_into_failed`` makes
    the request treat the ahead ranks as failed (their host memory dropped), the way a
    survivor ahead used to be recovered. The ``lagging`` ranks' newest window counts as
    not persisted yet (:func:`_lag_persisted_window`). Returns rank 0's consolidated
    state and losses, and every rank's rolled-back ranks, paused calls and the window
    it recovered from."""
    from lightning_moe_ckpt.recovery.api import RecoveryRequest, recover
    from lightning_moe_ckpt.testing.faults import destroy_rank_state

    plan = settings.layout
    mesh = build_mesh(plan, "cpu")
    coords = mesh_coordinates(mesh)
    rank, world = dist.get_rank(), dist.get_world_size()
    checkpointing = SparseCheckpointing("moevement", replicas=1, window=window)
    log = checkpointing.upstream_log
    assert log is not None
    engine = build_parallel_engine(settings, mesh, torch.device("cpu"), [log])
    sampler = build_data(settings).train
    shard = plan.data_shard(coords)
    coordinator = checkpointing.attach(engine, rank=rank, world_size=world)
    engine.batch = lambda t: sampler.iteration(t, shard)
    losses: list[float] = []
    facts: dict[str, Any] = {}
    try:
        for t in range(settings.max_steps):
            if t == step:
                coordinator.capture.wait_copies()
                if rank in lagging:
                    _lag_persisted_window(coordinator)
                if rank in failed:
                    destroy_rank_state(engine.model, engine.optimizer, [log.drop])
                elif rank in ahead:
                    with torch.no_grad():
                        for parameter in engine.model.parameters():
                            parameter.add_(0.5)
                request = RecoveryRequest(t, tuple(sorted({*failed, *ahead})))
                if not fold_ahead_into_failed:
                    request = RecoveryRequest(t, failed, ahead_ranks=ahead)
                calls = engine.forward_backward_calls
                outcome = recover(request, coordinator, log)
                facts = {"rolled_back": outcome.rolled_back,
                         "paused": outcome.report is None,
                         "calls": engine.forward_backward_calls - calls,
                         "window_start": None if outcome.report is None
                         else outcome.report.window_start}
            losses.append(float(engine.train_iteration(*sampler.iteration(t, shard)).loss))
    finally:
        checkpointing.close()
    state = gather_consolidated_state(engine, coords, settings.max_steps)
    everything: list[Any] = [None] * world
    dist.all_gather_object(everything, facts)
    return {"state": state, "losses": losses, "ranks": everything}


def _lag_persisted_window(coordinator: CheckpointCoordinator) -> None:
    """This rank's newest persisted window counts as not persisted yet, as when its replica
    peers had not filed its last snapshot when the failure struck: the store's persisted
    window goes back to the one before, which this rank itself no longer holds and whose
    copies the holders of the other ranks dropped already."""
    coordinator.drain()
    store = coordinator.store
    newest = store.persisted_start
    assert newest is not None and newest - store.windows[newest].window >= 0, newest
    record = store.windows[newest]
    record.replicated.discard(max(record.snapshots))
    store.persisted_start = newest - record.window


def lagging_scenario(settings: RunSettings, window: int, step: int, failed: tuple[int, ...],
                     lagging: tuple[int, ...]) -> dict[str, Any]:
    """The fault-free run and :func:`ahead_run` with ``lagging`` ranks; rank 0's
    comparison."""
    golden_state, golden_losses = distributed_run(settings)
    run = ahead_run(settings, window, step, failed, (), fold_ahead_into_failed=False,
                    lagging=lagging)
    return {"ranks": run["ranks"],
            "state_mismatches": None if golden_state is None
            else state_mismatches(golden_state, run["state"]),
            "losses_after": run["losses"][step:], "golden_after": golden_losses[step:]}


def ahead_scenarios(settings: RunSettings, window: int, step: int, failed: tuple[int, ...],
                    ahead: tuple[int, ...]) -> dict[str, Any]:
    """The fault-free run, :func:`ahead_run` recovering the ahead ranks from their own
    host memory, then with it dropped (which must fail); rank 0's comparison."""
    from lightning_moe_ckpt.recovery.durable import NoUsableCheckpointError

    golden_state, golden_losses = distributed_run(settings)
    run = ahead_run(settings, window, step, failed, ahead, fold_ahead_into_failed=False)
    try:
        ahead_run(settings, window, step, failed, ahead, fold_ahead_into_failed=True)
        folded = "recovered"
    except NoUsableCheckpointError as error:
        folded = str(error.__cause__ or error)
    return {"ranks": run["ranks"], "folded": folded,
            "state_mismatches": None if golden_state is None
            else state_mismatches(golden_state, run["state"]),
            "losses_after": run["losses"][step:], "golden_after": golden_losses[step:]}
