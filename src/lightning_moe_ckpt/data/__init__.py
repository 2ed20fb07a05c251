"""Corpora and the seekable, deterministic sampler."""

from lightning_moe_ckpt.data.corpus import TokenCorpus, stdlib_corpus, textfile_corpus
from lightning_moe_ckpt.data.sampler import (
    BatchLayout,
    SeekableSampler,
    mix_seed,
    validation_sampler,
)

__all__ = ["BatchLayout", "SeekableSampler", "TokenCorpus", "mix_seed", "stdlib_corpus",
           "textfile_corpus", "validation_sampler"]
