"""The recipe's progress bar names the steps a run trains, not ``Epoch 0/-2``."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader

from moe_recipes.progress import steps_progress_bar


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_bar_describes_the_run_by_its_steps() -> None:
    bar = steps_progress_bar()
    seen: list[str] = []

    class Spy(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
            train_bar = getattr(bar, "train_progress_bar", None)
            if train_bar is not None and hasattr(train_bar, "desc"):  # tqdm
                seen.append(str(train_bar.desc))
            else:  # rich
                seen.append(bar._get_train_description(trainer.current_epoch))

    trainer = L.Trainer(max_steps=3, callbacks=[bar, Spy()], logger=False,
                        enable_checkpointing=False, enable_model_summary=False,
                        accelerator="cpu")
    trainer.fit(_Tiny(), DataLoader(torch.ones(8, 2), batch_size=2))
    assert seen and all("Training 3 steps" in text for text in seen), seen
    assert not any("-2" in text for text in seen)
