"""A user's PipelineTrainable LightningModule (HF Qwen3-MoE) under the Trainer strategy.

Run as a script: ``python tests/distributed/trainer_user_parallel.py PP EP SHARDS OUT``
(the Trainer's launcher re-runs it for the other ranks). Rank 0 saves the full state
(expert shards gathered) and the losses to ``OUT``.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path
from typing import Any

# One intra-op thread in every layout (Lightning would give each of N processes
# cores // N), so every layout runs the same CPU kernels.
os.environ["OMP_NUM_THREADS"] = "1"

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_moe_ckpt.callbacks import FailureInjector, SparseCheckpointing
from lightning_moe_ckpt.recovery import AtSchedule
from lightning_moe_ckpt.strategies import TrainerMoEParallelStrategy  # noqa: E402
from lightning_moe_ckpt.training.pipeline_module import PipelineTrainable  # noqa: E402
from tests.anymodel.models import qwen3_moe  # noqa: E402

STEPS, BATCH, SEQ, MICROBATCHES, WINDOW = int(os.environ.get("STEPS", "3")), 4, 16, 2, 2


class UserModule(PipelineTrainable, L.LightningModule):
    """A plain next-token module with the three declared pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.model = qwen3_moe(seed=0)
        self.losses: list[torch.Tensor] = []

    def parallel_model(self) -> nn.Module:
        return self.model

    def split_batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        (tokens,) = batch
        return tokens[:, :-1], tokens[:, 1:]

    def microbatch_loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float().flatten(0, 1), targets.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = self.split_batch(batch)
        return self.microbatch_loss(self.model(input_ids=inputs).logits, targets)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(outputs["loss"].detach().clone())

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if os.environ.get("GRADS"):
            torch.save({n: p.grad.clone() for n, p in self.model.named_parameters()
                        if p.grad is not None},
                       f"{os.environ['GRADS']}.{dist.get_rank()}.{self.global_step}")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3)


def main(pp: int, ep: int, shards: int, out: str, fail: str | None = None) -> None:
    # Bounded time even when recovery is broken: every rank dumps its stacks and exits.
    faulthandler.dump_traceback_later(float(os.environ.get("RUN_TIMEOUT_S", "240")),
                                      exit=True)
    torch.use_deterministic_algorithms(True)
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (STEPS * BATCH * shards, SEQ + 1), generator=generator)
    world = pp * ep
    per_rank = BATCH * (shards if world == 1 else 1)
    module = UserModule()
    strategy = TrainerMoEParallelStrategy(pp=pp, ep=ep, microbatches=MICROBATCHES *
                                          (shards if world == 1 else 1))
    checkpointing = SparseCheckpointing("moevement", replicas=1 if world > 1 else 0,
                                        window=WINDOW,
                                        upstream_logging=pp > 1 and not os.environ.get("GLOBAL"))
    callbacks: list[L.Callback] = [checkpointing]
    injector = None
    if fail is not None:
        step, rank = (int(part) for part in fail.split(":"))
        injector = FailureInjector(AtSchedule([{"step": step, "rank": rank}]), checkpointing)
        callbacks.append(injector)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=per_rank))
    state = {name: {"param": p.detach().clone(),
                    **{k: v.clone() for k, v in trainer.optimizers[0].state[p].items()
                       if k != "step"}}
             for name, p in module.model.named_parameters()}
    report = {"rank": dist.get_rank(), "state": state,
              "losses": {step: loss for step, loss in enumerate(module.losses)},
              "metrics": checkpointing.metrics(1.0),
              "faults": {} if injector is None else injector.metrics()}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, report)
    if dist.get_rank() == 0:
        torch.save(parts, out)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
         sys.argv[5] if len(sys.argv) > 5 else None)
