"""Two-process run of the Qwen3-MoE LightningModule with its parameters sharded by FSDP2.

``configure_model`` calls ``fully_shard`` on every decoder layer and on the root, under
Lightning's own ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)``;
``SparseCheckpointing`` is the only thing of this library the script adds. Run as a
script: ``python tests/sharded/fsdp_workload.py OUT_DIR [FAIL_AT[:KIND]] [--ddp]
[--durable]`` on both ranks, as ``torchrun`` starts them (``--ddp``: the same model
replicated, for the unsharded figures; ``--durable``: a durable checkpoint every 3 steps
into ``OUT_DIR/durable``, and the run resumes by itself from the newest committed one
there, as the durable tier's guide shows); with a real ``KIND`` rank 1 really fails at
``FAIL_AT``, which needs the script to run under ``python -m lightning_moe_ckpt.supervise
--workers 2``: ``kill`` (the failure injector's, as the step begins), ``kill_in_forward``
(SIGKILL once the second decoder layer's forward ran) or ``kill_in_backward`` (once the
first layer's backward ran). Each rank writes its local shards, optimizer state, losses,
the snapshot bytes, its pid and its recoveries to ``OUT_DIR/rank<r>.pt``.
"""

# ruff: noqa: E402  (imports follow gc.disable(), below)
from __future__ import annotations

import gc
import os
import signal
import sys
from pathlib import Path
from typing import Any

gc.disable()
import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_moe_ckpt.callbacks import SparseCheckpointing
from lightning_moe_ckpt.recovery import newest_committed_durable
from lightning_moe_ckpt.testing import AtSchedule, FailureInjector
from tests.anymodel.harness import STEPS, WINDOW, StepLosses
from tests.anymodel.models import LMModule, qwen3_moe, random_token_loader

gc.freeze()
gc.enable()

FAILED_RANK = 1
# Below the gradient norms here: every step is clipped, by the norm over both ranks' shards.
CLIP = 0.05


class ShardedLM(LMModule):
    """The user's module: FSDP2 on every decoder layer and on the root."""

    def configure_model(self) -> None:
        if isinstance(next(self.model.parameters()), DTensor):
            return  # configure_model may run again (a resumed fit)
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class KillMidStep(L.Callback):
    """Rank 1 SIGKILLs itself inside step ``step``: in a forward or backward hook of a
    decoder layer, while its peer is in the middle of the same pass. A process replacing
    it does not fail again."""

    def __init__(self, step: int, where: str) -> None:
        self.step, self.where = step, where

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if (trainer.global_rank != FAILED_RANK or trainer.global_step != self.step
                or "MOE_REPLACES" in os.environ):
            return
        layers = pl_module.model.model.layers  # type: ignore[union-attr]

        def die(*_: Any) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        if self.where == "forward":
            layers[1].register_forward_hook(die)
        else:
            layers[0].register_full_backward_hook(die)


def _local(tensor: Any) -> Any:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def main(out: Path, fail: str | None, ddp: bool, durable: bool = False) -> None:
    torch.set_num_threads(1)
    module = (LMModule if ddp else ShardedLM)(qwen3_moe(seed=0))
    durable_dir = out / "durable"
    checkpointing = SparseCheckpointing(
        "moevement", replicas=1, window=WINDOW, durable_every=3 if durable else None,
        durable_dir=str(durable_dir) if durable else None)
    # The user's script starts again where the stopped job left off (None: afresh).
    resume = newest_committed_durable(durable_dir) if durable else None
    spy = StepLosses()
    callbacks: list[L.Callback] = [checkpointing, spy]
    injector = None
    if fail is not None:
        step, *kind = fail.split(":")
        if kind and kind[0].startswith("kill_in_"):
            callbacks.append(KillMidStep(int(step), kind[0].removeprefix("kill_in_")))
        else:
            event = {"step": int(step), "rank": FAILED_RANK,
                     "kind": kind[0] if kind else "simulated"}
            injector = FailureInjector(AtSchedule([event], 2), checkpointing,
                                       struck_log=out / "struck.jsonl")
            callbacks.append(injector)
    strategy: Any = "ddp" if ddp else ModelParallelStrategy(data_parallel_size=2,
                                                           tensor_parallel_size=1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks,
                        gradient_clip_val=CLIP)
    trainer.fit(module, random_token_loader(n_batches=2 * (STEPS + 2)), ckpt_path=resume)
    optimizer = trainer.optimizers[0]
    names = {id(p): n for n, p in module.named_parameters()}
    assert checkpointing.coordinator is not None
    metrics = checkpointing.coordinator.metrics(1.0)
    torch.save({
        "params": {n: _local(p.detach()).clone() for n, p in module.named_parameters()},
        "sharded": [n for n, p in module.named_parameters() if isinstance(p, DTensor)],
        "optimizer": {names[id(p)]: {k: _local(v).clone() for k, v in state.items()
                                     if isinstance(v, torch.Tensor)}
                      for p, state in optimizer.state.items() if state},
        "losses": spy.losses, "frozen_during_replay": spy.frozen_during_replay,
        "clip_during_replay": spy.clip_during_replay,
        "fired": 0 if injector is None else injector.counter.total,
        "recoveries": [] if injector is None else injector.recoveries,
        "snapshot_bytes_per_iter": metrics["snapshot_bytes_per_iter"],
        "operators": checkpointing.operator_names(),
        "pid": os.getpid(), "resumed_from": resume,
        "real_recoveries": ([] if checkpointing.peer_failures is None
                            else checkpointing.peer_failures.recoveries),
    }, out / f"rank{trainer.global_rank}.pt")
    torch.distributed.destroy_process_group()  # as every distributed script should


if __name__ == "__main__":
    arguments = [a for a in sys.argv[1:] if a not in ("--ddp", "--durable")]
    main(Path(arguments[0]), arguments[1] if len(arguments) > 1 else None, "--ddp" in sys.argv,
         "--durable" in sys.argv)
    gc.freeze()  # the report is written: exit without traversing what training built
