"""A user's own Fabric loop over a HF Qwen3-MoE split by ``FabricMoEParallelStrategy``.

Run as ``python -m tests.distributed.fabric_user_parallel OUT PP EP [STEP:RANK]`` from the
repository root; Fabric's launcher re-runs it for the other ranks. The loop is the user's:
``strategy.parallelize(model)``, a plain AdamW, ``fabric.setup``, and a step function of
``strategy.forward_backward``, the protected target's clipping and ``optimizer.step()``,
protected by ``SparseCheckpointing.protect``. With ``STEP:RANK`` a simulated failure of that
rank at that step is recovered. Rank 0 saves every rank's report to ``OUT``.
"""

# ruff: noqa: E402  (imports follow gc.disable(), below)
from __future__ import annotations

import faulthandler
import gc
import os
import sys
from typing import Any

# One intra-op thread in every layout, so every layout runs the same CPU kernels.
os.environ["OMP_NUM_THREADS"] = "1"

# Imports build about half a million long-lived objects: skip collecting while they are
# built and traversing them later (as recipes/train.py does).
gc.disable()
import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_moe_ckpt.callbacks import SparseCheckpointing
from lightning_moe_ckpt.strategies import FabricMoEParallelStrategy
from lightning_moe_ckpt.testing import AtSchedule, FailureInjector
from tests.anymodel.models import qwen3_moe
from tests.distributed.staged_workloads import full_state

gc.freeze()
gc.enable()
# The variable above reaches a fresh interpreter's OpenMP; a rank forked with torch already
# imported (tests.forked) takes its thread count from this call.
torch.set_num_threads(1)

STEPS, BATCH, SEQ, MICROBATCHES, WINDOW, CLIP = 8, 4, 16, 2, 2, 0.5
RUN_TIMEOUT_S = 240.0


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def main(pp: int, ep: int, out: str, fail: str | None = None) -> None:
    # Bounded time even when recovery is broken: every rank dumps its stacks and exits.
    faulthandler.dump_traceback_later(RUN_TIMEOUT_S, exit=True)
    torch.use_deterministic_algorithms(True)
    strategy = FabricMoEParallelStrategy(pp=pp, ep=ep, microbatches=MICROBATCHES)
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=pp * ep)
    fabric.launch()
    model = strategy.parallelize(qwen3_moe(seed=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)
    checkpointing = SparseCheckpointing("moevement", replicas=0 if pp * ep == 1 else 1,
                                        window=WINDOW)

    def train_step(batch: torch.Tensor) -> torch.Tensor:
        loss = strategy.forward_backward(batch[:, :-1], batch[:, 1:], token_loss)
        assert checkpointing.target is not None  # protect() set it
        checkpointing.target.clip_gradients([p.grad for p in model.parameters()
                                             if p.grad is not None], CLIP)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    checkpointing.hook_into(strategy.core)  # boundary logging before the first batch
    step = checkpointing.protect(fabric, model, optimizer, train_step)
    injector = None
    if fail is not None:
        at, rank = (int(part) for part in fail.split(":"))
        injector = FailureInjector(AtSchedule([{"step": at, "rank": rank}]), checkpointing)
        assert checkpointing.target is not None
        injector.attach(checkpointing.target, rank=fabric.global_rank,
                        world_size=fabric.world_size)
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (STEPS, ep, BATCH, SEQ + 1), generator=generator)
    losses = {index: step(tokens[index, strategy.data_shard]) for index in range(STEPS)}
    checkpointing.close()
    assert strategy.core.mesh is not None and checkpointing.coordinator is not None
    state = full_state(model.module, optimizer.optimizer, strategy.core.mesh.get_group("ep"))
    report = {"rank": dist.get_rank(), "state": state, "losses": losses,
              "paused_forward_backward": checkpointing.coordinator.paused_forward_backward,
              "faults": {} if injector is None else injector.metrics()}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, report)
    if dist.get_rank() == 0:
        torch.save(parts, out)
    dist.destroy_process_group()  # as every distributed script should, before exit


if __name__ == "__main__":
    main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[1], sys.argv[4] if len(sys.argv) > 4
         else None)
    gc.freeze()  # the report is written: exit without traversing what training built
