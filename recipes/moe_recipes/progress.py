"""The recipe's progress bar: Lightning's, describing the run by the steps it trains.

A run bounded by ``trainer.max_steps`` leaves ``max_epochs`` at -1, which Lightning's bars
show as ``Epoch 0/-2``; this one reads ``Training 200 steps`` (its count shows how many
are done).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from typing_extensions import override


def _description(trainer: L.Trainer) -> str:
    return f"Training {trainer.max_steps} steps"


class _RichStepsBar(RichProgressBar):
    @override
    def _get_train_description(self, current_epoch: int) -> str:
        return _description(self.trainer)


class _TQDMStepsBar(TQDMProgressBar):
    @override
    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description(_description(trainer))


def steps_progress_bar() -> ProgressBar:
    """Lightning's progress bar (Rich where it is installed, else tqdm), named by steps."""
    return _RichStepsBar() if _RICH_AVAILABLE else _TQDMStepsBar()
