"""Training workloads run inside the gloo worker processes of the distributed tests.

Each function runs on every rank (after ``init_process_group``) and returns rank 0's
view. They are module-level so ``spawn`` can pickle them.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from typing_extensions import override

from lightning_moe_ckpt.core.layout import Coordinates, build_mesh, mesh_coordinates
from lightning_moe_ckpt.data import BatchLayout, SeekableSampler
from lightning_moe_ckpt.parallel.pipeline import BoundaryEvent, PipelineRunner
from lightning_moe_ckpt.planning.planner import BasePlanner
from lightning_moe_ckpt.training.consolidate import consolidated_state, gather_consolidated_state
from lightning_moe_ckpt.training.data import build_data
from lightning_moe_ckpt.training.distributed_executor import build_parallel_engine
from lightning_moe_ckpt.training.engine import TrainingEngine
from moe_recipes.comparisons import ComparisonCheckpointing
from moe_recipes.settings import RunSettings, settings_from_config


def make_settings(pp: int, dp: int, ep: int, precision: str = "32", steps: int = 3,
                  microbatches: int = 4, schedule: str = "1f1b",
                  max_grad_norm: float | None = 1.0, dp_shard: int = 1) -> RunSettings:
    """Tiny model, short sequences, a global batch every tested layout divides."""
    return settings_from_config(OmegaConf.create({
        "model": {"max_seq_len": 16},
        "data": {"seq_len": 16},
        "parallel": {"pp": pp, "dp": dp, "ep": ep, "microbatches": microbatches,
                     "schedule": schedule, "dp_shard": dp_shard},
        "trainer": {"max_steps": steps, "precision": precision, "global_batch": 16,
                    "val_batches": 1, "optim": {"max_grad_norm": max_grad_norm}},
    }))


@contextmanager
def single_thread() -> Any:
    """CPU kernels may block differently with more threads: compare at one thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def whole_batch_sampler(settings: RunSettings) -> SeekableSampler:
    """The training data's sampler of whole global batches, for a single process."""
    return SeekableSampler(build_data(settings).train.tokens, settings.data.seq_len,
                           BatchLayout(settings.global_batch, settings.layout.microbatches),
                           settings.seed)


def reference_run(settings: RunSettings) -> tuple[dict[str, Any], list[float]]:
    """Single-process run of the same global batch: ``(final state, losses)``."""
    with single_thread():
        engine = TrainingEngine.local(settings)
        whole = whole_batch_sampler(settings)
        losses = [float(engine.train_iteration(*whole.iteration(t)).loss)
                  for t in range(settings.max_steps)]
        return consolidated_state(engine.model, engine.optimizer, settings.max_steps), losses


def _rank_engine(settings: RunSettings, hooks: list[Any] | None = None
                 ) -> tuple[TrainingEngine, Coordinates, SeekableSampler, int]:
    plan = settings.layout
    mesh = build_mesh(plan, "cpu")
    coords = mesh_coordinates(mesh)
    engine = build_parallel_engine(settings, mesh, torch.device("cpu"), hooks)
    sampler = build_data(settings).train
    return engine, coords, sampler, plan.data_shard(coords)


def distributed_run(settings: RunSettings) -> tuple[dict[str, Any] | None, list[float]]:
    """Train ``settings.max_steps`` on this rank; rank 0 returns the consolidated state."""
    engine, coords, sampler, shard = _rank_engine(settings)
    losses = [float(engine.train_iteration(*sampler.iteration(t, shard)).loss)
              for t in range(settings.max_steps)]
    return gather_consolidated_state(engine, coords, settings.max_steps), losses


def peer_checkpointing_run(settings: RunSettings, policy: str, directory: str,
                           failure_step: int) -> tuple[dict[str, Any] | None, list[Any]]:
    """Train with a user's periodic checkpointing (``checkpoint=lightning`` or ``dcp``,
    ``k`` by the overhead cap) and a failure before ``failure_step``, once the saves
    before it completed. The ranks report iteration times a million times apart, as
    ranks measuring apart might: alone they would choose different ``k`` (rank 0's 1000 s
    allow a save of up to 30 s at ``k`` = 1, however loaded the machine). Returns rank
    0's consolidated state and every rank's ``k`` and recoveries."""
    engine, coords, sampler, shard = _rank_engine(settings)
    engine.batch = lambda step: sampler.iteration(step, shard)
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = ComparisonCheckpointing(policy, engine, Path(directory), rank, world, {failure_step},
                             warmup=2)
    peer.begin()
    while engine.step < settings.max_steps:
        if engine.step == failure_step:
            while not all(save.done() for save in peer.saves):
                time.sleep(0.01)
        peer.before_iteration(engine.step)
        engine.train_iteration(*sampler.iteration(engine.step, shard))
        peer.after_iteration(1000.0 if rank == 0 else 0.001)
    peer.close()
    ranks: list[Any] = [None] * world
    dist.all_gather_object(ranks, {"interval": peer.interval, "recoveries": peer.recoveries})
    return gather_consolidated_state(engine, coords, settings.max_steps), ranks


FROZEN = ["layers.0.moe.experts.1", "layers.0.moe.experts.6", "layers.1.attn",
          "layers.2.moe.gate", "layers.3.moe.experts.4", "embed"]


def _cloned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cloned(v) for v in value]
    return value


def _local_state(engine: TrainingEngine) -> dict[str, Any]:
    return {"master": {n: t.clone() for n, t in engine.optimizer.master_weights().items()},
            "compute": {n: p.detach().clone() for n, p in engine.model.named_parameters()},
            "optimizer": _cloned(engine.optimizer.state_dict()),
            "scheduler": engine.scheduler.state_dict()}


def frozen_step_check(settings: RunSettings) -> dict[str, Any]:
    """Two all-active steps, then step 3 twice from the same state: all active, and with
    ``FROZEN`` frozen. Returns, gathered on rank 0, per-rank lists of mismatches."""
    engine, _, sampler, shard = _rank_engine(settings)
    for t in range(2):
        engine.train_iteration(*sampler.iteration(t, shard))
    before = _local_state(engine)
    engine.train_iteration(*sampler.iteration(2, shard))
    all_active = _local_state(engine)

    with torch.no_grad():  # restore the state after step 2
        for name, param in engine.model.named_parameters():
            param.copy_(before["compute"][name])
    engine.optimizer.load_state_dict(before["optimizer"])
    engine.scheduler.load_state_dict(before["scheduler"])
    registry = engine.registry
    frozen_here = [name for name in FROZEN if name in registry]
    registry.set_frozen(frozen_here)
    engine.train_iteration(*sampler.iteration(2, shard))
    with_frozen = _local_state(engine)

    frozen_params = {n for op in frozen_here for n, _ in registry[op].params}
    problems = []
    for name in with_frozen["master"]:
        expected = before if name in frozen_params else all_active
        for section in ("master", "compute"):
            if not torch.equal(with_frozen[section][name], expected[section][name]):
                problems.append((section, name))
        saved = expected["optimizer"]["state"].get(name, {})
        got = with_frozen["optimizer"]["state"].get(name, {})
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if not torch.equal(got[key], saved[key]):
                problems.append((key, name))
    report = {"frozen_here": frozen_here, "problems": problems,
              "n_frozen_params": len(frozen_params)}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    return {"ranks": gathered}


def boundary_hook_check(settings: RunSettings) -> dict[str, Any]:
    """Record every boundary send and every received boundary tensor for a few steps."""
    sent: dict[tuple[str, int, int, int], list[torch.Tensor | None]] = {}
    calls: Counter[tuple[str, int, int, int]] = Counter()

    def recorder(event: BoundaryEvent) -> None:
        key = (event.kind, event.iteration, event.microbatch, event.stage)
        calls[key] += 1
        sent[key] = [None if t is None else t.clone() for t in event.tensors]

    engine, _, sampler, shard = _rank_engine(settings, hooks=[recorder])
    runner = getattr(engine.executor, "runner", None)
    assert isinstance(runner, PipelineRunner)
    received: dict[tuple[str, int, int, int], list[torch.Tensor]] = {}
    for stage in runner.stages:
        original_acts, original_grads = (stage._retrieve_recv_activations,
                                         stage._retrieve_recv_grads)

        def acts(mb: int, stage: Any = stage, original: Any = original_acts) -> Any:
            out = original(mb)
            received[("activation", stage.iteration, mb, stage.stage_index - 1)] = [
                t.detach().clone() for t in out]
            return out

        def grads(mb: int, stage: Any = stage, original: Any = original_grads) -> Any:
            out = original(mb)
            received[("gradient", stage.iteration, mb, stage.stage_index + 1)] = [
                t.clone() for t in out]
            return out

        stage._retrieve_recv_activations = acts  # type: ignore[method-assign]
        stage._retrieve_recv_grads = grads  # type: ignore[method-assign]
    for t in range(settings.max_steps):
        engine.train_iteration(*sampler.iteration(t, shard))
    everything: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, {"calls": dict(calls), "sent": sent,
                                        "received": received})
    return {"ranks": everything}


class RoundRobinPlanner(BasePlanner):
    """A minimal planner for coordinator tests: window of ``window`` snapshots, operators
    dealt round-robin into the turns."""

    name = "round_robin"

    def __init__(self, names: list[str], window: int) -> None:
        self.names, self.window = names, window

    @override
    def plan(self, iteration: int) -> Any:
        from lightning_moe_ckpt.planning.planner import CapturePlan

        index = iteration % self.window
        turns = [tuple(self.names[i::self.window]) for i in range(self.window)]
        later = tuple(n for turn in turns[index + 1:] for n in turn)
        return CapturePlan(iteration, turns[index], later, iteration - index, index,
                           self.window, None)


def replication_partner_failure(settings: RunSettings, steps: int,
                                ranks_per_node: int) -> dict[str, Any]:
    """Rank 0's replication thread fails in its last exchange, after the slot handles went
    out and before the payloads (as when a third rank, one of its sources, died there):
    rank 1's thread, waiting on rank 0 in that exchange, must stop too. Reports whether
    each rank's thread stopped when it closed its replicator, its error, its persisted
    window and the steps replicated of each window it keeps, and what the next two
    iterations warned."""
    from lightning_moe_ckpt.checkpointing.coordinator import CheckpointCoordinator
    from lightning_moe_ckpt.core.registry import OperatorRegistry
    from lightning_moe_ckpt.models.transformer import MoETransformer

    engine, _, sampler, shard = _rank_engine(settings)
    with torch.device("meta"):
        names = OperatorRegistry(MoETransformer(settings.model)).names
    coordinator = CheckpointCoordinator(engine, RoundRobinPlanner(names, 2), dist.get_rank(),
                                        dist.get_world_size(), replicas=1,
                                        ranks_per_node=ranks_per_node,
                                        device=torch.device("cpu"))
    replicator = coordinator.replicator
    assert replicator is not None
    staged: list[int] = []

    def fail_in_the_last_exchange(step: int) -> None:
        if step == steps - 1:
            staged.append(step)
            raise RuntimeError("staged: a source of this rank died in the exchange")

    if dist.get_rank() == 0:
        replicator.before_payload = fail_in_the_last_exchange
    for t in range(steps):
        engine.train_iteration(*sampler.iteration(t, shard))
    # Rank 0 closes its replicator only once rank 1's closed (or gave up): its own close
    # would release rank 1's thread, as a training thread stuck on rank 1 never does.
    stopped = False
    if dist.get_rank() == 0:
        replicator.drain()  # its thread reached the staged failure
    else:  # the timeout a survivor's recovery gives its replication thread
        stopped = replicator.close(timeout_s=10.0)
    dist.barrier()
    # The next iterations tell the user, once, that their snapshots are not replicated.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(steps, steps + 2):
            engine.train_iteration(*sampler.iteration(t, shard))
    if dist.get_rank() == 0:
        stopped = replicator.close(timeout_s=10.0)
    store = coordinator.store
    report = {"staged": staged, "stopped": stopped, "persisted": store.persisted_start,
              "replicated": {start: sorted(record.replicated)
                             for start, record in store.windows.items()},
              "error": None if replicator.error is None else str(replicator.error),
              "warned": [str(w.message) for w in caught
                         if "replication stopped" in str(w.message)]}
    everything: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, report)
    return {"ranks": everything}


def abandoned_replication_thread(settings: RunSettings) -> dict[str, Any]:
    """Two ranks on one node: rank 1's replication thread sleeps 5 s before it announces
    its first snapshot, so rank 0's thread waits for rank 1 to map rank 0's first slot.
    Rank 0 gives its thread 1 s to close and gives up on it; rank 1's thread then files
    rank 0's snapshot. Reports, per rank, what the replicator counted and holds and its
    error, after rank 1 closed."""
    import time

    from lightning_moe_ckpt.checkpointing.coordinator import CheckpointCoordinator
    from lightning_moe_ckpt.core.registry import OperatorRegistry
    from lightning_moe_ckpt.models.transformer import MoETransformer

    engine, _, sampler, shard = _rank_engine(settings)
    with torch.device("meta"):
        names = OperatorRegistry(MoETransformer(settings.model)).names
    rank = dist.get_rank()
    coordinator = CheckpointCoordinator(engine, RoundRobinPlanner(names, 2), rank,
                                        dist.get_world_size(), replicas=1, ranks_per_node=2,
                                        device=torch.device("cpu"))
    replicator = coordinator.replicator
    assert replicator is not None and replicator.mapping_peers == {1 - rank}
    slept: list[int] = []

    def sleep_once(step: int) -> None:
        if not slept:
            slept.append(step)
            time.sleep(5.0)

    if rank == 1:
        replicator.before_payload = sleep_once
    engine.train_iteration(*sampler.iteration(0, shard))
    if rank == 0:
        time.sleep(1.0)  # its thread waits on rank 1 by now
        stopped = replicator.close(timeout_s=1.0)
        counted = replicator.completed
    else:
        stopped = replicator.close(timeout_s=60.0)  # after the sleep: files rank 0's
    dist.barrier()  # rank 1 filed rank 0's snapshot
    time.sleep(0.5)  # an abandoned thread that went on would have counted it by now
    report = {"stopped": stopped, "slept": slept, "completed": replicator.completed,
              "counted_at_close": counted if rank == 0 else None,
              "held": {source: sorted(held) for source, held in
                       replicator.replicas.windows.items()},
              "error": None if replicator.error is None else str(replicator.error)}
    everything: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, report)
    return {"ranks": everything}


def replica_peers_of(rank: int, ranks_per_node: int = 1) -> list[int]:
    """Replica placement of the 4-rank test world with 2 replicas."""
    from lightning_moe_ckpt.replication.replicator import replica_peers

    return replica_peers(rank, dist.get_world_size(), 2, ranks_per_node=ranks_per_node)


def _corrupt_one_piece(replicas: Any, source: int, window_start: int) -> None:
    from lightning_moe_ckpt.replication.replicator import decode_snapshot
    from lightning_moe_ckpt.snapshots.codec import encode_payload

    held = replicas.windows[source][window_start]
    step = min(held)
    payload = decode_snapshot(held[step])
    piece = next(iter(payload["pieces"].values()))
    tensor = next(iter(piece["tensors"].values()))
    tensor.view(-1)[0] += 1  # the stored checksum no longer matches
    held[step] = encode_payload(payload)  # re-framed: only the tensor checksum can tell


def _damage_first_snapshot(replicas: Any, source: int, window_start: int,
                           how: str) -> Callable[[], None]:
    """Damage the first held snapshot of ``source``'s window: a flipped ``header`` byte, a
    ``crafted`` frame (every checksum valid around a piece layout with a negative shape),
    or a ``huge`` one (announced at 2**40 bytes, never allocated); returns how to undo it."""
    import struct

    from lightning_moe_ckpt.core.wire import dumps
    from lightning_moe_ckpt.snapshots.checksum import bytes_checksum
    from lightning_moe_ckpt.snapshots.codec import MAGIC

    held = replicas.windows[source][window_start]
    step = min(held)
    original = held[step]
    if how == "header":
        damaged = original.clone()
        damaged[-20] ^= 0x10  # inside the header, before its checksum and length
    elif how == "crafted":
        layout = dumps([("w", "float32", (-1,))])
        blob = struct.pack("<I", len(layout)) + layout + struct.pack("<I", 0)
        header = dumps({"step": step, "rank": source, "window_start": window_start,
                        "window": 1, "metadata": None,
                        "pieces": {"w": {"kind": "master", "checksum": 0,
                                         "frame_checksum": bytes_checksum(blob),
                                         "offset": len(MAGIC), "length": len(blob)}}})
        frame = (MAGIC + blob + header
                 + struct.pack("<IQ", bytes_checksum(header), len(header)))
        damaged = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    else:
        assert how == "huge", how
        damaged = torch.empty(2**40, dtype=torch.uint8, device="meta")
    held[step] = damaged

    def restore() -> None:
        held[step] = original

    return restore


def replication_check(settings: RunSettings, steps: int, window: int,
                      ranks_per_node: int = 1) -> dict[str, Any]:
    """Train with snapshots replicated to 2 peers; compare every rank's persisted window
    with the copies its peers hold (or, with all ranks on one node, the mappings of its
    shared memory), and report host memory over the run."""
    from lightning_moe_ckpt.checkpointing.coordinator import CheckpointCoordinator
    from lightning_moe_ckpt.core.registry import OperatorRegistry
    from lightning_moe_ckpt.models.transformer import MoETransformer
    from lightning_moe_ckpt.replication.replicator import CorruptCheckpointError, decode_snapshot

    engine, _, sampler, shard = _rank_engine(settings)
    with torch.device("meta"):
        names = OperatorRegistry(MoETransformer(settings.model)).names
    coordinator = CheckpointCoordinator(engine, RoundRobinPlanner(names, window), dist.get_rank(),
                                        dist.get_world_size(), replicas=2,
                                        ranks_per_node=ranks_per_node,
                                        device=torch.device("cpu"))
    windows_held = []
    for t in range(steps):
        engine.train_iteration(*sampler.iteration(t, shard))
        windows_held.append(len(coordinator.store.windows))
    replicator = coordinator.replicator
    assert replicator is not None
    replicator.drain()
    coordinator.drain_acks()
    coordinator.store.refresh()
    start = coordinator.store.persisted_start
    assert start is not None
    starts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(starts, start)
    common_start = min(starts)  # every rank's store still holds the older of the two
    fetched = {source: {step: view["pieces"] for step, view in
                        replicator.fetch_window(source, common_start).items()}
               for source in range(dist.get_world_size())}
    held = {source: {step: decode_snapshot(data)["pieces"]
                     for step, data in coordinator.replica_window(source, start).items()}
            for source in range(dist.get_world_size())}
    # The first holder's copy of rank 0's window gets a flipped value behind its checksum:
    # the fetch falls through to the second holder; once both copies are bad, it fails.
    first, second = replica_peers_of(0, ranks_per_node)
    replica_figures = {"copied_bytes": replicator.replicas.nbytes(),
                       "mapped_bytes": replicator.replicas.mapped_nbytes(),
                       "mapped_sources": sorted(replicator.mapped_sources),
                       "mapping_peers": sorted(replicator.mapping_peers),
                       "slot_bytes": replicator.slot_bytes_peak(),
                       "acknowledgements": replicator.acknowledgements,
                       "exchanges": replicator.exchanges,
                       "slots": 0 if replicator.slots is None else replicator.slots.allocations,
                       "snapshots": coordinator.measured.snapshots_taken}
    damaged = {}  # by damage: the steps fetched despite it, and from which holder
    for how in ("header", "crafted", "huge"):
        restore = (_damage_first_snapshot(replicator.replicas, 0, common_start, how)
                   if dist.get_rank() == first else None)
        damaged[how] = {"steps": sorted(replicator.fetch_window(0, common_start)),
                        "holder": replicator.last_holder}
        if restore is not None:
            restore()
    if dist.get_rank() == first:
        _corrupt_one_piece(replicator.replicas, 0, common_start)
    fetched_despite_corrupt = sorted(replicator.fetch_window(0, common_start))
    fetched_without_holder = sorted(replicator.fetch_window(0, common_start,
                                                            exclude=(first,)))
    if dist.get_rank() == second:
        _corrupt_one_piece(replicator.replicas, 0, common_start)
    try:
        replicator.fetch_window(0, common_start)
        corrupt_error = None
    except CorruptCheckpointError as error:
        corrupt_error = str(error)
    coordinator.flush()
    persisted = coordinator.store.persisted()
    assert persisted is not None
    local = {step: {op: {k: v.clone() for k, v in piece.tensors.items()}
                    for op, piece in snap.pieces.items()}
             for step, snap in persisted.snapshots.items()}
    everything: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, {"local": local, "held": held, "fetched": fetched,
                                        "common_start": common_start,
                                        "corrupt_error": corrupt_error,
                                        "fetched_without_holder": fetched_without_holder,
                                        "fetched_despite_corrupt": fetched_despite_corrupt,
                                        "damaged": damaged, "first": first, "second": second,
                                        "start": persisted.start,
                                        "windows_held": windows_held,
                                        **replica_figures,
                                        "peak": coordinator.store.peak_bytes,
                                        "window_bytes": persisted.nbytes})
    coordinator.close()
    return {"ranks": everything}
