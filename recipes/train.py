"""Train an MoE transformer: ``python recipes/train.py [hydra overrides]``.

Config: ``conf/train.yaml`` (groups model, data, parallel, hardware, trainer; top-level
``api`` and ``out_dir``). Writes ``final_state.pt``, ``metrics.json`` and ``training.png``
to ``out_dir``.
"""

# ruff: noqa: E402  (imports follow gc.disable(), below)
from __future__ import annotations

import gc

# The imports build about half a million long-lived objects (torch, Lightning, Hydra):
# collecting while they are built is wasted work, and so is traversing them in every full
# collection during training and in the collections at exit. Frozen, the collector skips
# them; every worker process runs this script (launched, supervised or replacing one).
gc.disable()

import json
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from lightning_moe_ckpt.errors import ConfigError
from moe_recipes.command_line import EXIT_USAGE, check_command_line
from moe_recipes.runner import run_training

gc.freeze()
gc.enable()


@hydra.main(config_path="../conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    try:
        metrics = run_training(cfg)
    except ConfigError as error:  # found once the run was set up: one line too
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USAGE) from None
    if not metrics:  # ranks other than 0 write nothing
        return
    losses = metrics["loss"]
    summary = {
        "out_dir": cfg.out_dir,
        "steps": metrics["steps"],
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
        "val": metrics["validation"][-1] if metrics["validation"] else None,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    check_command_line(Path(__file__).resolve().parent.parent / "conf")  # error: ..., exit 2
    main()
    gc.freeze()  # the work is written: exit without traversing what training built
