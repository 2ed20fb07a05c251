"""Two-process DDP run of the Qwen3-MoE LightningModule (``strategy="ddp"``, gloo on CPU).

Run as a script: ``python tests/anymodel/ddp_workload.py OUT_DIR [FAIL_AT]``; Lightning's
launcher starts rank 1 by running the same command (or start both ranks, as ``torchrun``
does). Each rank writes its parameters,
optimizer state, per-step losses and the injector's count to ``OUT_DIR/rank<r>.pt``.
"""

# ruff: noqa: E402  (imports follow gc.disable(), below)
from __future__ import annotations

import gc
import sys
from pathlib import Path

# Imports build about half a million long-lived objects: skip collecting while they are
# built and traversing them later (as recipes/train.py does).
gc.disable()
import lightning as L
import torch

from lightning_moe_ckpt.callbacks import SparseCheckpointing
from lightning_moe_ckpt.testing import AtSchedule, FailureInjector
from tests.anymodel.harness import STEPS, WINDOW, StepLosses, optimizer_state
from tests.anymodel.models import LMModule, qwen3_moe, random_token_loader

gc.freeze()
gc.enable()


def main(out: Path, fail_at: int | None) -> None:
    torch.set_num_threads(1)
    module = LMModule(qwen3_moe(seed=0))
    checkpointing = SparseCheckpointing("moevement", replicas=1, window=WINDOW)
    spy = StepLosses()
    callbacks: list[L.Callback] = [checkpointing, spy]
    injector = None
    if fail_at is not None:
        injector = FailureInjector(AtSchedule([{"step": fail_at, "rank": 0}], 2),
                                   checkpointing)
        callbacks.append(injector)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, random_token_loader(n_batches=2 * (STEPS + 2)))
    torch.save({"params": {n: p.detach().clone() for n, p in module.named_parameters()},
                "optimizer": optimizer_state(module, trainer.optimizers[0]),
                "losses": spy.losses, "fired": 0 if injector is None else injector.counter.total,
                "recoveries": [] if injector is None else injector.recoveries,
                "frozen_during_replay": spy.frozen_during_replay},
               out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
    gc.freeze()  # the report is written: exit without traversing what training built
