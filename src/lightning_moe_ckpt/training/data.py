"""A run's data: the corpus, the training and validation samplers, and loader datasets.

Training item ``t`` is iteration ``t``'s micro-batches for one data shard, so the data
position is the optimizer step. Validation batches are shaped and sharded like training
iterations (drawn from the validation split with their own seed stream), which lets the
same pipeline schedule and collectives evaluate them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, Dataset

from lightning_moe_ckpt.data import (
    BatchLayout,
    SeekableSampler,
    TokenCorpus,
    stdlib_corpus,
    textfile_corpus,
    validation_sampler,
)
from lightning_moe_ckpt.training.settings import DataSettings, TrainingSettings


@dataclass(frozen=True)
class RunData:
    """Corpus and samplers of one run."""

    corpus: TokenCorpus
    train: SeekableSampler
    val: SeekableSampler


class IterationDataset(Dataset[dict[str, Any]]):
    """Item ``i`` is iteration ``start + i`` of ``sampler`` for data shard ``shard``."""

    def __init__(self, sampler: SeekableSampler, stop: int, start: int = 0,
                 shard: int = 0) -> None:
        self.sampler, self.start, self.stop, self.shard = sampler, start, stop, shard

    def __len__(self) -> int:
        return self.stop - self.start

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[index] for index in range(len(self)))

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        iteration = self.start + index
        inputs, targets = self.sampler.iteration(iteration, self.shard)
        return {"iteration": iteration, "inputs": inputs, "targets": targets}


def build_corpus(data: DataSettings) -> TokenCorpus:
    """The corpus named by ``data.name``."""
    if data.name == "textfile":
        return textfile_corpus(data.path, data.val_fraction)
    return stdlib_corpus(data.val_percent)


def build_data(settings: TrainingSettings) -> RunData:
    """Corpus, training sampler and validation sampler for ``settings``."""
    corpus = build_corpus(settings.data)
    layout = BatchLayout(settings.global_batch, settings.layout.microbatches,
                         settings.layout.data_shards)
    seq_len = settings.data.seq_len
    return RunData(corpus, SeekableSampler(corpus.train, seq_len, layout, settings.seed),
                   validation_sampler(corpus.val, seq_len, layout, settings.seed))


def build_dataloaders(settings: TrainingSettings, shard: int = 0
                      ) -> tuple[DataLoader[dict[str, Any]], DataLoader[dict[str, Any]]]:
    """``(train, validation)`` loaders of one data shard; train item ``t`` is iteration ``t``.

    Args:
        settings: The run's settings (data, layout, batch sizes, steps, seed).
        shard: The data shard to read (``MoEParallelCore.data_shard``: the same on every
            stage of a pipeline).

    Returns:
        The train loader (``settings.max_steps`` items) and the validation loader
        (``settings.val_batches`` items).
    """
    data = build_data(settings)
    train = IterationDataset(data.train, settings.max_steps, shard=shard)
    val = IterationDataset(data.val, settings.val_batches, shard=shard)
    return DataLoader(train, batch_size=None), DataLoader(val, batch_size=None)
