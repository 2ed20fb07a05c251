"""Where a user's DataLoader stands in its epoch, kept with every durable checkpoint.

Lightning resumes a run from a checkpoint at the step it was saved, but a plain DataLoader
starts its epoch over: a run resumed mid-epoch would read other batches than the run that
was not interrupted. :class:`DataPosition` records, with each durable checkpoint, the
epoch, how many batches of it were trained, and the shuffling generator's state when the
epoch began; on resume it puts the generator back before the epoch's order is drawn and
has the sampler skip the batches already trained (their indices only: no data is loaded
for them). Then the resumed run reads exactly the batches the uninterrupted one read.

It knows the loaders it can position: a ``RandomSampler`` with its own ``generator``
(``DataLoader(shuffle=True, generator=g)``), a ``DistributedSampler`` (its order follows
its seed and epoch) and a ``SequentialSampler``, each under the DataLoader's
``BatchSampler``. For any other (``shuffle=True`` without a generator draws its order from
the global RNG when the epoch begins, a custom batch sampler) it warns once, at the first
checkpoint taken, naming why.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

__all__ = ["DATA_POSITION_KEY", "DataPosition"]

# Key of the data position in a durable checkpoint.
DATA_POSITION_KEY = "lightning_moe_ckpt/data_position"


class DataPosition:
    """The data position of a Trainer's training loader, saved and restored."""

    def __init__(self) -> None:
        self._trainer: L.Trainer | None = None
        self._batch_size = 0
        # The generator's state when the current epoch's order was drawn, and now.
        self._epoch_generator: torch.Tensor | None = None
        self._pending: dict[str, Any] | None = None  # loaded with a checkpoint
        self._warned = False

    def train_starts(self, trainer: L.Trainer) -> bool:
        """``on_train_start``: watch the loader's sampler, so that each epoch's order is
        known when it is drawn and a resumed epoch's is drawn as it was; whether the loader
        is positioned so."""
        sampler, self._batch_size = self._positionable(trainer, warn=False)
        if sampler is None:
            self._pending = None
            return False
        self._trainer = trainer
        _watch(sampler, self)
        return True

    def iteration_begins(self, sampler: Sampler[Any]) -> int:
        """A watched sampler is about to draw an epoch's order: how many indices to skip.

        Resumed inside the checkpoint's epoch, the generator gets that epoch's state back
        and the indices of the batches already trained are skipped. Resumed after it
        (the checkpoint followed the epoch's last batch), the generator continues from
        where that epoch left it, and from the draw the DataLoader makes for the new
        epoch's worker seed (``_BaseDataLoaderIter``) before the order is drawn."""
        generator = _generator(sampler)
        pending, self._pending = self._pending, None
        skip = 0
        if pending is not None:
            epoch = None if self._trainer is None else self._trainer.current_epoch
            if epoch == pending["epoch"]:  # resumed inside the checkpoint's epoch
                skip = pending["batches"] * self._batch_size
                if generator is not None and pending["generator"] is not None:
                    generator.set_state(pending["generator"])
            elif generator is not None and pending["generator_now"] is not None:
                generator.set_state(pending["generator_now"])
                torch.empty((), dtype=torch.int64).random_(generator=generator)
        self._epoch_generator = None if generator is None else generator.get_state()
        return skip

    def state(self, trainer: L.Trainer) -> dict[str, Any]:
        """What a checkpoint taken now keeps: epoch, batches trained in it, the
        generator's state when the epoch's order was drawn and now."""
        # Processed: the batches trained in this epoch, the one whose end hook saves the
        # checkpoint included (Lightning resumes after it, at that batch index).
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        sampler, _ = self._positionable(trainer, warn=True)
        generator = None if sampler is None else _generator(sampler)
        return {"epoch": trainer.current_epoch,
                "batches": int(progress.processed),  # type: ignore[attr-defined]
                "generator": self._epoch_generator,
                "generator_now": None if generator is None else generator.get_state()}

    def load(self, state: dict[str, Any]) -> None:
        """A checkpoint's position, applied when the resumed run draws its first order."""
        self._pending = state

    def _positionable(self, trainer: L.Trainer, warn: bool
                      ) -> tuple[Sampler[Any] | None, int]:
        """The sampler to position and the batch size, or ``(None, 0)`` for a loader it
        cannot position, with a warning the first time ``warn`` (a checkpoint is taken)."""
        loader = trainer.train_dataloader
        why = None
        if not isinstance(loader, DataLoader):
            why = f"the training loader is a {type(loader).__name__}, not one DataLoader"
        elif not isinstance(loader.batch_sampler, BatchSampler):
            why = "its batch sampler is not a BatchSampler"
        else:
            sampler = loader.batch_sampler.sampler
            if isinstance(sampler, RandomSampler) and sampler.generator is None:
                why = ("it shuffles without a generator of its own (the order is drawn from "
                       "the global RNG when the epoch begins): pass DataLoader(..., "
                       "generator=torch.Generator().manual_seed(seed))")
            elif not isinstance(sampler, RandomSampler | DistributedSampler
                                | SequentialSampler):
                why = f"its sampler is a {type(sampler).__name__}"
            else:
                return sampler, loader.batch_sampler.batch_size
        if warn and not self._warned:
            self._warned = True
            warnings.warn(f"a run resumed mid-epoch from a durable checkpoint reads other "
                          f"batches than the run that was not interrupted: {why}",
                          UserWarning, stacklevel=3)
        return None, 0


def _generator(sampler: Sampler[Any]) -> torch.Generator | None:
    """The generator a sampler draws its order from (a ``RandomSampler``'s own)."""
    return sampler.generator if isinstance(sampler, RandomSampler) else None


def _watch(sampler: Sampler[Any], position: DataPosition) -> None:
    """Let ``position`` see (and skip into) every order ``sampler`` draws: its class
    becomes a subclass whose iteration asks ``position`` first."""
    base = type(sampler)
    if getattr(base, "_watched_by", None) is not None:
        base._watched_by = position  # type: ignore[attr-defined]
        return

    class Watched(base):  # type: ignore[valid-type,misc]
        _watched_by = position

        def __iter__(self) -> Any:
            skip = type(self)._watched_by.iteration_begins(self)
            indices = iter(base.__iter__(self))
            for _ in range(skip):
                next(indices, None)
            yield from indices

    sampler.__class__ = Watched
