"""CUDA path of the snapshot capture: pinned host buffers, side-stream copies ordered after
the optimizer step, exact values, stall measured only in the wait. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from lightning_moe_ckpt.core.target import StepHooks
from lightning_moe_ckpt.planning.planner import CapturePlan
from lightning_moe_ckpt.snapshots.capture import SnapshotCapture
from lightning_moe_ckpt.training.engine import TrainingEngine
from moe_recipes.settings import settings_from_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class _Wait(StepHooks):
    def __init__(self, snapshots: SnapshotCapture) -> None:
        self.snapshots = snapshots

    def before_optimizer_step(self, step: int) -> None:
        self.snapshots.wait_copies()

    def after_optimizer_step(self, step: int, result: object) -> None:
        return None


@pytest.mark.parametrize(("precision", "batch_bytes"),
                         [("32", None), ("bf16-master", None), ("32", 3000)])
def test_cuda_snapshots_are_exact_and_pinned(precision: str, batch_bytes: int | None) -> None:
    """Snapshots equal the state after their step; with ``batch_bytes`` small, the copy
    thread issues them in many batches and splits tensors across them."""
    torch.backends.cudnn.deterministic = True
    settings = settings_from_config(OmegaConf.create({
        "model": {"max_seq_len": 64}, "data": {"seq_len": 64},
        "trainer": {"precision": precision, "global_batch": 16, "max_steps": 6}}))
    engine = TrainingEngine.local(settings, device="cuda")
    registry = engine.registry
    snapshots = SnapshotCapture(registry, engine.state, 0, torch.device("cuda"))
    if batch_bytes is not None:
        snapshots.copy_batch_bytes = batch_bytes  # before the first copy list is cut
    engine.hooks.append(_Wait(snapshots))
    names = registry.names
    generator = torch.Generator().manual_seed(0)
    taken, expected = [], []
    for step in range(6):
        tokens = torch.randint(0, 256, (2, 8, 65), generator=generator).cuda()
        engine.train_iteration(tokens[..., :-1], tokens[..., 1:])
        plan = CapturePlan(step, tuple(names[step % 3::3]), tuple(names[(step + 1) % 3::3]),
                           step - step % 3, step % 3, 3, None)
        want = {}
        for operator in plan.master:
            for name, _ in registry[operator].params:
                master = engine.optimizer.master[name]
                want[(operator, f"{name}/master")] = master.detach().cpu().clone()
                for key, value in engine.optimizer.inner.state[master].items():
                    want[(operator, f"{name}/{key}")] = value.detach().cpu().clone()
        for operator in plan.compute:
            for name, param in registry[operator].params:
                want[(operator, name)] = param.detach().cpu().clone()
        expected.append(want)
        taken.append(snapshots.issue(plan, {}))
    snapshots.close()
    for snapshot, want in zip(taken, expected, strict=True):
        for (operator, name), tensor in want.items():
            held = snapshot.pieces[operator].tensors[name]
            assert held.is_pinned(), name
            assert torch.equal(held, tensor), (snapshot.step, name)
        assert all(piece.verify() for piece in snapshot.pieces.values())
    assert snapshots.pool.allocations > 0
    cut = [copies.batches for copies in snapshots.copy_lists.values()]
    assert all(batches is not None for batches in cut)
    if batch_bytes is not None:  # the small batches did split tensors
        assert any(segment.stop is not None for batches in cut if batches is not None
                   for batch in batches.segments for segment in batch)


def test_device_metadata_reaches_the_host_with_the_copies() -> None:
    """The clip coefficient stays on the device in the training thread; the snapshot
    holds a pinned host copy of its value once its copies are done."""
    settings = settings_from_config(OmegaConf.create({
        "model": {"max_seq_len": 64}, "data": {"seq_len": 64},
        "trainer": {"global_batch": 16, "max_steps": 1}}))
    engine = TrainingEngine.local(settings, device="cuda")
    snapshots = SnapshotCapture(engine.registry, engine.state, 0, torch.device("cuda"))
    clip = torch.tensor(0.375, device="cuda") * 2
    names = engine.registry.names
    snapshot = snapshots.issue(CapturePlan(0, tuple(names), (), 0, 0, 1, None),
                               {"clip_coef": clip, "lr": 1e-3})
    del clip  # the allocator may hand its block out again: the copy must still read 0.75
    torch.empty(1, device="cuda").fill_(-1.0)
    snapshots.close()
    held = snapshot.metadata["clip_coef"]
    assert held.device.type == "cpu" and held.is_pinned()
    assert torch.equal(held, torch.tensor(0.75))
    assert snapshot.metadata["lr"] == 1e-3
