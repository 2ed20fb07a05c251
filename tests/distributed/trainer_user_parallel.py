"""A user's PipelineTrainable LightningModule under the Trainer strategy.

Run as ``python -m tests.distributed.trainer_user_parallel OUT MODEL PP EP SHARDS
[STEP:RANK[:KIND]]`` from the repository root; the Trainer's launcher re-runs it for the
other ranks. ``MODEL``: ``qwen3_moe`` (a HF Qwen3-MoE, split by the built-in plan) or
``grouped_experts`` (a torchtitan-style model with its own ``parallelize_fn``). One process
runs ``SHARDS`` data shards as micro-batches (the reference); several run ``pp x ep`` with
one shard per ``ep`` rank. With ``STEP:RANK`` a simulated failure of that rank at that
step is recovered by the library; with a real ``KIND`` (``kill``, ``exit``, ...) the rank
really fails, which needs the script to run under ``python -m lightning_moe_ckpt.supervise``
(``SUPERVISED_TIMEOUT_S`` its ``--timeout-s``). Rank 0 saves every rank's report (the full
state, expert shards gathered, its losses, its recovery figures, its pid) to ``OUT``.
"""

# ruff: noqa: E402  (imports follow gc.disable(), below)
from __future__ import annotations

import faulthandler
import gc
import os
import sys
from collections.abc import Callable
from typing import Any

# One intra-op thread in every layout (Lightning would give each of N processes
# cores // N), so every layout runs the same CPU kernels. Run as a script only: a test that
# imports this module's names must leave its own process's threads and environment alone
# (the runs it starts afterwards inherit them).
RUN_AS_SCRIPT = __name__ == "__main__"
if RUN_AS_SCRIPT:
    os.environ["OMP_NUM_THREADS"] = "1"

# Imports build about half a million long-lived objects: skip collecting while they are
# built and traversing them later (as recipes/train.py does).
gc.disable()
import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_moe_ckpt.callbacks import SparseCheckpointing
from lightning_moe_ckpt.parallel.model_plans import ParallelizeFn
from lightning_moe_ckpt.strategies import TrainerMoEParallelStrategy
from lightning_moe_ckpt.testing import AtSchedule, FailureInjector
from lightning_moe_ckpt.training.pipeline_module import PipelineTrainable
from tests.anymodel.models import grouped_experts_moe, qwen3_moe
from tests.distributed.staged_workloads import full_state, parallelize_grouped_experts

gc.freeze()
gc.enable()
# The variable above reaches a fresh interpreter's OpenMP; a rank forked with torch already
# imported (tests.forked) takes its thread count from this call.
if RUN_AS_SCRIPT:
    torch.set_num_threads(1)

STEPS, BATCH, SEQ, MICROBATCHES, WINDOW = 8, 4, 16, 2, 2
CLIP = 0.5  # below the gradient norms here: every step is clipped
RUN_TIMEOUT_S = 240.0
SUPERVISED_TIMEOUT_S = 30.0  # the supervisor's --timeout-s when a fault is real


class UserModule(PipelineTrainable, L.LightningModule):
    """A plain next-token module with the three declared pieces."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: dict[int, torch.Tensor] = {}

    def parallel_model(self) -> nn.Module:
        return self.model

    def split_batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        (tokens,) = batch
        return tokens[:, :-1], tokens[:, 1:]

    def microbatch_loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float().flatten(0, 1), targets.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = self.split_batch(batch)
        output = self.model(inputs)
        return self.microbatch_loss(output if isinstance(output, torch.Tensor) else
                                    output.logits, targets)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses[self.global_step - 1] = outputs["loss"].detach().clone()

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        # A per-step warm-up: a replacement's replay must step it as the Trainer did.
        warm_up = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 6))
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": warm_up, "interval": "step"}}


MODELS: dict[str, tuple[Callable[..., nn.Module], ParallelizeFn | None]] = {
    "qwen3_moe": (qwen3_moe, None),
    "grouped_experts": (grouped_experts_moe, parallelize_grouped_experts),
}


def main(model: str, pp: int, ep: int, shards: int, out: str, fail: str | None = None
         ) -> None:
    # Bounded time even when recovery is broken: every rank dumps its stacks and exits.
    faulthandler.dump_traceback_later(RUN_TIMEOUT_S, exit=True)
    torch.use_deterministic_algorithms(True)
    world = pp * ep
    one_process = world == 1
    data_shards = shards if one_process else ep  # dp = 1: one shard per ep rank
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (STEPS * BATCH * data_shards, SEQ + 1), generator=generator)
    builder, parallelize_fn = MODELS[model]
    module = UserModule(builder(seed=0))
    strategy = TrainerMoEParallelStrategy(
        pp=pp, ep=ep, microbatches=MICROBATCHES * (shards if one_process else 1),
        parallelize_fn=parallelize_fn, recovery_timeout_s=SUPERVISED_TIMEOUT_S)
    checkpointing = SparseCheckpointing("moevement", replicas=0 if one_process else 1,
                                        window=WINDOW)
    callbacks: list[L.Callback] = [checkpointing]
    injector = None
    if fail is not None:
        step, rank, *kind = fail.split(":")
        event = {"step": int(step), "rank": int(rank), "kind": kind[0] if kind else "simulated"}
        injector = FailureInjector(AtSchedule([event]), checkpointing)
        callbacks.append(injector)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=CLIP, callbacks=callbacks)
    loader = DataLoader(TensorDataset(tokens), batch_size=BATCH * (shards if one_process else 1))
    trainer.fit(module, loader)
    assert strategy.core.mesh is not None and checkpointing.coordinator is not None
    state = full_state(module.model, trainer.optimizers[0], strategy.core.mesh.get_group("ep"))
    handler = checkpointing.peer_failures
    report = {"rank": dist.get_rank(), "pid": os.getpid(), "state": state,
              "losses": module.losses,
              "paused_forward_backward": checkpointing.coordinator.paused_forward_backward,
              "faults": {} if injector is None else injector.metrics(),
              "real_recoveries": [] if handler is None else handler.recoveries}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, report)
    if dist.get_rank() == 0:
        torch.save(parts, out)
    dist.destroy_process_group()  # as every distributed script should, before exit


if __name__ == "__main__":
    main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[1],
         sys.argv[6] if len(sys.argv) > 6 else None)
    gc.freeze()  # the report is written: exit without traversing what training built
