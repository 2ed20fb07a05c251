"""Snapshot engine: exact copies under a mutate-after-issue race, stall accounting,
checksums, buffer reuse, and the store's two-window bound."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from lightning_moe_ckpt.core.optimizer_state import OptimizerStateAccess
from lightning_moe_ckpt.core.precision import PRECISIONS, Precision
from lightning_moe_ckpt.core.registry import OperatorRegistry
from lightning_moe_ckpt.core.target import StepHooks
from lightning_moe_ckpt.snapshots.capture import SnapshotCapture
from lightning_moe_ckpt.snapshots.checksum import tensor_checksum
from lightning_moe_ckpt.snapshots.snapshot import (
    HostBufferPool,
    PieceBuffers,
    PieceLayout,
    Snapshot,
)
from lightning_moe_ckpt.snapshots.store import SnapshotStore
from lightning_moe_ckpt.training.engine import TrainingEngine
from moe_recipes.settings import settings_from_config
from tests.anymodel.models import bias_balanced_moe
from tests.unit.capture_plans import Plan, round_robin


def _engine(precision: Precision) -> TrainingEngine:
    settings = settings_from_config(OmegaConf.create({
        "model": {"max_seq_len": 16}, "data": {"seq_len": 16},
        "trainer": {"precision": precision, "global_batch": 8, "max_steps": 10}}))
    return TrainingEngine.local(settings)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (2, 4, 17), generator=torch.Generator().manual_seed(step))
    return tokens[..., :-1], tokens[..., 1:]


def _live(engine: TrainingEngine, operator: str, kind: str) -> dict[str, torch.Tensor]:
    registry = engine.registry
    out = {}
    for name, param in registry[operator].params:
        if kind == "compute":
            out[name] = param.detach().clone()
            continue
        master = engine.optimizer.master[name]
        out[f"{name}/master"] = master.detach().clone()
        for key, value in engine.optimizer.inner.state[master].items():
            out[f"{name}/{key}"] = value.clone()
    return out


@pytest.mark.parametrize("precision", PRECISIONS)
def test_slow_copy_never_holds_post_step_values(precision: Precision) -> None:
    engine = _engine(precision)
    registry = engine.registry
    snapshots = SnapshotCapture(registry, engine.state, rank=0, device=torch.device("cpu"),
                               copy_delay_s=0.05)
    engine.hooks.append(_WaitHook(snapshots))
    names = registry.names
    expected = {}
    taken = []
    for step in range(4):
        engine.train_iteration(*_batch(step))
        plan = Plan(step, tuple(names[step::4]), tuple(names[(step + 1) % 4::4]), 0, step, 4)
        expected[step] = {op: _live(engine, op, "master") for op in plan.master}
        expected[step].update({op: _live(engine, op, "compute") for op in plan.compute})
        taken.append(snapshots.issue(plan, {"step": step}))  # type: ignore[arg-type]
    snapshots.close()
    assert snapshots.stall_s > 0  # the 50 ms copy outlived each iteration: the wait counted
    for snapshot in taken:
        assert snapshot.checksummed.is_set()
        for operator, piece in snapshot.pieces.items():
            want = expected[snapshot.step][operator]
            assert piece.tensors.keys() == want.keys()
            for name, tensor in want.items():
                assert torch.equal(piece.tensors[name], tensor), (snapshot.step, name)
            assert piece.verify()


class _WaitHook(StepHooks):
    def __init__(self, snapshots: SnapshotCapture) -> None:
        self.snapshots = snapshots

    def before_optimizer_step(self, step: int) -> None:
        self.snapshots.wait_copies()

    def after_optimizer_step(self, step: int, result: object) -> None:
        return None


def test_checksum_detects_a_flipped_bit() -> None:
    tensors = {"w": torch.arange(12, dtype=torch.float32).view(3, 4)}
    before = tensor_checksum(tensors)
    tensors["w"].view(torch.int32)[1, 2] ^= 1
    assert tensor_checksum(tensors) != before


@pytest.mark.timeout(60)  # broken, the wait would never return
def test_a_failed_copy_is_raised_in_the_training_threads_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy thread that fails does not leave training waiting forever: the next wait
    raises, naming the rank, and the snapshot stays unchecksummed (unusable)."""
    engine = _engine("32")
    engine.train_iteration(*_batch(0))
    snapshots = SnapshotCapture(engine.registry, engine.state, rank=3,
                               device=torch.device("cpu"))

    def fail(job: object, checksum: bool) -> None:
        raise OSError("copy broke")

    monkeypatch.setattr(snapshots, "_copy", fail)
    plan = round_robin(tuple(engine.registry.names), 0, 2)
    snapshot = snapshots.issue(plan, {})  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="rank 3: taking snapshots failed") as raised:
        snapshots.wait_copies()
    assert isinstance(raised.value.__cause__, OSError)
    assert snapshot.checksummed.wait(timeout=30)
    assert snapshot.pieces and all(piece.checksum is None for piece in snapshot.pieces.values())
    assert snapshots.pieces_checksummed == 0
    snapshots.close()


@pytest.mark.timeout(60)  # broken, the wait would never return
def test_a_checksum_failing_after_some_pieces_leaves_none_checksummed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Host pieces are checksummed as they are copied: one failing after others were done
    leaves the whole snapshot without checksums, not half of it with them."""
    engine = _engine("32")
    engine.train_iteration(*_batch(0))
    snapshots = SnapshotCapture(engine.registry, engine.state, rank=3,
                               device=torch.device("cpu"))
    calls = []
    checksum = snapshots.checksums.checksum

    def fail_third(*args: object) -> int:
        calls.append(args)
        if len(calls) == 3:
            raise OSError("checksum broke")
        return checksum(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(snapshots.checksums, "checksum", fail_third)
    snapshot = snapshots.issue(Plan(0, tuple(engine.registry.names), (), 0, 0, 1), {})  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="rank 3: taking snapshots failed"):
        snapshots.wait_copies()
    assert len(calls) == 3 and len(snapshot.pieces) > 3
    assert snapshot.checksummed.wait(timeout=30)
    assert all(piece.checksum is None for piece in snapshot.pieces.values())
    assert snapshots.pieces_checksummed == 0
    snapshots.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checksum_thread", [True, False], ids=["own thread", "copy thread"])
def test_an_interrupted_copy_stays_unchecksummed_once_the_failure_is_handled(
        monkeypatch: pytest.MonkeyPatch, checksum_thread: bool) -> None:
    """Whether a copy was cut short is decided when it completes: the failure injector
    clears the interrupted steps as soon as the training thread's wait returns, which may
    be before the checksum thread (CUDA's, forced here) reaches that snapshot, or before
    the copy thread, which checksums on CPU, goes on to checksum it."""
    engine = _engine("32")
    engine.train_iteration(*_batch(0))
    snapshots = SnapshotCapture(engine.registry, engine.state, rank=0,
                               device=torch.device("cpu"), checksum_thread=checksum_thread)
    assert len(snapshots._threads) == (2 if checksum_thread else 1)
    names = tuple(engine.registry.names)
    release = threading.Event()
    checksum_copied = snapshots._checksum_copied

    def held_checksum(snapshot: Snapshot, usable: bool) -> None:
        if snapshot.step == 1:  # the cut one: checksummed only after the injector cleared
            release.wait()
        checksum_copied(snapshot, usable)

    monkeypatch.setattr(snapshots, "_checksum_copied", held_checksum)
    first = snapshots.issue(round_robin(names, 0, 2), {})  # type: ignore[arg-type]
    snapshots.interrupt_copy(1)
    cut = snapshots.issue(round_robin(names, 1, 2), {})  # type: ignore[arg-type]
    snapshots.wait_copies()
    snapshots.interrupted_steps.clear()  # what the failure injector does next
    release.set()
    assert cut.checksummed.wait(timeout=30)
    assert all(piece.checksum is None for piece in cut.pieces.values())
    assert first.pieces and all(piece.verify() for piece in first.pieces.values())
    snapshots.close()


@pytest.mark.timeout(60)  # broken, a wait would never return
@pytest.mark.parametrize("checksum_thread", [True, False], ids=["own thread", "copy thread"])
def test_hand_offs_run_once_checksummed_in_issue_order(
        monkeypatch: pytest.MonkeyPatch, checksum_thread: bool) -> None:
    """A consumer (replication, persistence) gets a snapshot only once each piece has its
    checksum, on the thread that checksummed it and before the snapshot's event is set (so
    waiting for the engine's checksums covers every hand-off), in the order the snapshots
    were issued; one registered after the checksums runs at once, on the caller's thread."""
    engine = _engine("32")
    engine.train_iteration(*_batch(0))
    snapshots = SnapshotCapture(engine.registry, engine.state, rank=0,
                               device=torch.device("cpu"), checksum_thread=checksum_thread)
    release = threading.Event()
    copy = snapshots._copy

    def held_copy(job: Any, checksum: bool) -> list[int] | None:
        if job.snapshot.step == 0:
            release.wait()
        return copy(job, checksum)

    monkeypatch.setattr(snapshots, "_copy", held_copy)
    handed: list[tuple[int, bool, bool, str]] = []

    def consume(snapshot: Snapshot) -> None:
        handed.append((snapshot.step,
                       all(piece.checksum is not None for piece in snapshot.pieces.values()),
                       snapshot.checksummed.is_set(), threading.current_thread().name))

    names = tuple(engine.registry.names)
    issued = []
    for step in range(3):
        snapshot = snapshots.issue(round_robin(names, step, 3), {})  # type: ignore[arg-type]
        snapshot.when_checksummed(consume)
        issued.append(snapshot)
    assert handed == []  # the first copy is held, the others wait behind it
    release.set()
    snapshots.wait_copies()
    snapshots.wait_checksums()
    assert [step for step, *_ in handed] == [0, 1, 2]
    assert all(checksummed and not event_set for _, checksummed, event_set, _ in handed)
    helper = "snapshot-checksum" if checksum_thread else "snapshot-copy"
    assert {thread for *_, thread in handed} == {helper}
    issued[0].when_checksummed(consume)
    assert handed[3][0] == 0 and handed[3][3] == threading.current_thread().name
    snapshots.close()


def test_buffers_are_reused_and_store_keeps_two_windows() -> None:
    engine = _engine("32")
    registry = engine.registry
    pool = HostBufferPool(pin_memory=False)
    snapshots = SnapshotCapture(registry, engine.state, 0, torch.device("cpu"), pool)
    store = SnapshotStore(pool, replicas=0)
    released: list[int] = []
    store.release_listeners.append(released.append)
    names = registry.names
    window = 3
    sizes = []
    for step in range(12):
        engine.train_iteration(*_batch(step))
        plan = round_robin(tuple(names), step, window)
        start = plan.window_start
        store.add(snapshots.issue(plan, {}))  # type: ignore[arg-type]
        snapshots.wait_copies()
        for snap in store.windows[start].snapshots.values():
            snap.checksummed.wait()
        store.refresh()
        assert len(store.windows) <= 2
        # Counted as windows come and go: the sum over what is held.
        assert store.host_bytes() == sum(r.nbytes for r in store.windows.values())
        sizes.append(pool.allocations)
    snapshots.close()
    # Logs are kept from the previous persisted window's start (the fallback point).
    assert store.persisted_start == 9 and released == [0, 3, 6]
    # After the first two windows, buffers of freed windows are reused: no new allocations.
    assert sizes[-1] == sizes[2 * window - 1]
    assert store.peak_bytes <= 2 * max(r.nbytes for r in store.windows.values()) + 1
    store.discard_except(9)
    assert store.host_bytes() == store.windows[9].nbytes > 0
    store.discard_all()
    assert store.host_bytes() == 0


def _replace_state_tensor(engine: TrainingEngine) -> None:
    """An optimizer that assigns new state tensors instead of updating them in place."""
    for state in engine.optimizer.inner.state.values():
        state["exp_avg"] = state["exp_avg"] + 1.0


def _replace_parameter_storage(engine: TrainingEngine) -> None:
    """``param.data = ...``: the same Parameter object over new storage."""
    for master in engine.optimizer.master.values():
        master.data = master.data * 2.0


def _replace_state_dicts(engine: TrainingEngine) -> None:
    """New per-parameter state dicts (as a restore builds them), their tensors moved."""
    state = engine.optimizer.inner.state
    for master in list(state):
        state[master] = {name: value * 3.0 for name, value in state[master].items()}


@pytest.mark.parametrize("replace", [_replace_state_tensor, _replace_parameter_storage,
                                     _replace_state_dicts])
def test_copy_lists_are_reused_and_follow_replaced_tensors(replace: object) -> None:
    engine = _engine("bf16-master")
    names = tuple(engine.registry.names)
    pool = HostBufferPool(pin_memory=False)
    snapshots = SnapshotCapture(engine.registry, engine.state, 0, torch.device("cpu"), pool)
    engine.train_iteration(*_batch(0))
    plans = [Plan(i, names[i::2], names[i + 1::2], 0, i, 2) for i in range(2)]
    for step in range(1, 5):
        engine.train_iteration(*_batch(step))
        snapshots.issue(plans[step % 2], {})
        snapshots.wait_copies()
    assert snapshots.copy_list_builds == 2  # one per plan shape, then reused
    # Each operator's layout once per kind the shapes use.
    assert snapshots.layout_builds == len({(op, "master") for p in plans for op in p.master}
                                          | {(op, "compute") for p in plans for op in p.compute})
    before = snapshots.layout_builds
    assert callable(replace)
    replace(engine)
    plan = plans[1]
    expected = {op: _live(engine, op, "master") for op in plan.master}
    expected.update({op: _live(engine, op, "compute") for op in plan.compute})
    snapshot = snapshots.issue(plan, {})
    snapshots.close()
    assert snapshots.copy_list_builds == 3  # the stale list was rebuilt
    # Every layout was dropped with the stale list; the plan's own were built again.
    assert snapshots.layout_builds == before + len(plan.master) + len(plan.compute)
    for operator, piece in snapshot.pieces.items():
        assert piece.tensors.keys() == expected[operator].keys()
        for name, tensor in expected[operator].items():
            assert torch.equal(piece.tensors[name], tensor), name
        assert piece.verify()


def test_a_reordered_plan_reuses_each_operators_layout() -> None:
    """A popularity reorder gives new plan shapes of the same operators: their copy lists
    are put together from the layouts already built, and copy what the plan asks for."""
    engine = _engine("bf16-master")
    names = tuple(engine.registry.names)
    snapshots = SnapshotCapture(engine.registry, engine.state, 0, torch.device("cpu"),
                               HostBufferPool(pin_memory=False))
    engine.train_iteration(*_batch(0))
    orders = [names, names[::-1], names[1:] + names[:1]]
    for step, order in enumerate(orders, start=1):
        engine.train_iteration(*_batch(step))
        for index in range(2):  # a window of two: halves of the order, then the rest
            plan = Plan(step, order[index::2], order[index + 1::2] if index == 0 else (),
                        0, index, 2)
            snapshot = snapshots.issue(plan, {})
            snapshots.wait_copies()
            kinds = {op: "master" for op in plan.master} | {op: "compute" for op in plan.compute}
            assert snapshot.pieces.keys() == kinds.keys()
            for operator, piece in snapshot.pieces.items():
                assert piece.kind == kinds[operator]
                expected = _live(engine, operator, piece.kind)
                assert piece.tensors.keys() == expected.keys()
                for name, tensor in expected.items():
                    assert torch.equal(piece.tensors[name], tensor), name
    snapshots.close()
    assert snapshots.copy_list_builds == 2 * len(orders)  # every shape is new
    # Every operator's master layout, and the compute layouts of the odd-placed ones.
    used = {(op, "master") for op in names}
    used |= {(op, "compute") for order in orders for op in order[1::2]}
    assert snapshots.layout_builds == len(used)


def test_module_buffers_are_held_as_of_issue_while_the_copy_runs_behind() -> None:
    """A forward changes a balancing bias in place while the previous step's copy may
    still run: the snapshot holds the buffer as it was at issue, the weights too."""
    model = bias_balanced_moe()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model(tokens).float().square().mean().backward()
    optimizer.step()
    registry = OperatorRegistry(model)
    snapshots = SnapshotCapture(registry, OptimizerStateAccess(optimizer), rank=0,
                               device=torch.device("cpu"), copy_delay_s=0.2)
    names = tuple(registry.names)
    held = {op.name: {b.snapshot_key: b.tensor.clone() for b in op.buffers}
            for op in registry if op.buffers}
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert any(".router" in name for name in held)
    snapshot = snapshots.issue(Plan(0, names[::2], names[1::2], 0, 0, 1), {})  # type: ignore[arg-type]
    with torch.no_grad():
        model(tokens)  # the next forward: every bias and token counter moves
    assert not snapshot.copied.is_set()  # ... while the copy behind it still runs
    live = {op.name: {b.snapshot_key: b.tensor for b in op.buffers} for op in registry}
    assert all(not torch.equal(value, live[operator][key])
               for operator, buffers in held.items() for key, value in buffers.items()
               if key.endswith("tokens_seen"))
    snapshots.close()
    for operator, buffers in held.items():
        piece = snapshot.pieces[operator]
        for key, value in buffers.items():
            assert torch.equal(piece.tensors[key], value), (operator, key)
        assert piece.verify()
    for piece in snapshot.pieces.values():
        if piece.kind == "compute":
            for name, tensor in piece.tensors.items():
                if not name.startswith("buffer:"):
                    assert torch.equal(tensor, weights[name]), name


def test_a_packed_piece_is_copied_in_runs_split_by_buffers_copied_at_issue() -> None:
    """Mixed dtypes, a 0-d step and a buffer copied at issue in the middle: two runs, each
    one concatenation into the block, and the buffer's bytes between them untouched."""
    sources = {"a": torch.randn(3, 2), "b": torch.arange(4, dtype=torch.int64),
               "c": torch.tensor(7.0, dtype=torch.float64), "d": torch.randn(5)}
    layout = PieceLayout.of("op", "master", sources, at_issue=["b"])
    assert [span[:2] for span in layout.behind_spans] == [(0, 1), (2, 4)]
    buffers = PieceBuffers.allocate(layout, pin_memory=False)
    assert buffers.block is not None and buffers.behind_blocks is not None
    assert layout.byte_runs is not None
    buffers.tensors["b"].fill_(-1)  # as the copy at issue left it
    for run, block in zip(layout.byte_runs, buffers.behind_blocks, strict=True):
        torch.cat(run, out=block)
    for name in "acd":
        assert torch.equal(buffers.tensors[name], sources[name]), name
    assert torch.equal(buffers.tensors["b"], torch.full((4,), -1))


def test_a_non_contiguous_source_is_copied_tensor_by_tensor() -> None:
    """A parameter (and so its optimizer state) with transposed strides has no flat byte
    view: its piece is copied tensor by tensor, the others by concatenation, all exact."""
    model = bias_balanced_moe()
    transposed = next(p for p in model.parameters() if p.dim() == 2)
    transposed.data = transposed.data.t().contiguous().t()
    assert not transposed.is_contiguous()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model(tokens).float().square().mean().backward()
    optimizer.step()
    registry = OperatorRegistry(model)
    access = OptimizerStateAccess(optimizer)
    snapshots = SnapshotCapture(registry, access, rank=0, device=torch.device("cpu"))
    names = tuple(registry.names)
    snapshot = snapshots.issue(Plan(0, names, (), 0, 0, 1), {})  # type: ignore[arg-type]
    copies = snapshots.copy_list(Plan(0, names, (), 0, 0, 1))  # type: ignore[arg-type]
    assert sum(layout.byte_runs is None for layout in copies.pieces) == 1
    snapshots.close()
    for layout in copies.pieces:
        piece = snapshot.pieces[layout.operator]
        for name, source in zip(layout.names, layout.sources, strict=True):
            assert torch.equal(piece.tensors[name], source), (layout.operator, name)
        assert piece.verify()
