"""Seekable, layout-independent batch sampler.

The global batch of iteration ``t`` is ``global_batch`` windows of ``seq_len + 1`` tokens
whose start offsets are drawn from a generator seeded by a mix of ``(seed, t)`` alone.
Sample ``g`` of that batch belongs to micro-batch ``g // (global_batch / M)`` and, inside
it, to data shard ``(g mod (global_batch / M)) // b`` where ``b`` is the per-shard
micro-batch size. So:

* a micro-batch is a pure function of ``(seed, t, shard, micro-batch index)``: a replayed
  iteration, in this or a fresh process, sees exactly the same tokens;
* every layout (any number of micro-batches M and data shards) covers the same global
  batch, so the single-process run is always the reference;
* the data position is just the iteration number, which is part of the training state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_moe_ckpt.errors import ConfigError

_MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """SplitMix64 over ``values``: decorrelated generator seeds from small integers."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & _MASK64)) & _MASK64
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state >> 1  # torch.Generator.manual_seed takes a non-negative int64


@dataclass(frozen=True)
class BatchLayout:
    """How one iteration's global batch is cut into micro-batches and data shards."""

    global_batch: int
    microbatches: int = 1
    data_shards: int = 1

    def __post_init__(self) -> None:
        if self.global_batch <= 0:
            raise ConfigError(f"trainer.global_batch={self.global_batch} must be positive")
        if self.microbatches <= 0:
            raise ConfigError(f"parallel.microbatches={self.microbatches} must be positive")
        per_iteration = self.microbatches * self.data_shards
        if self.global_batch % per_iteration:
            raise ConfigError(
                f"trainer.global_batch={self.global_batch} must be divisible by "
                f"parallel.microbatches={self.microbatches} x data shards={self.data_shards} "
                f"(= {per_iteration})")

    @property
    def micro_batch_size(self) -> int:
        """Sequences in one micro-batch of one data shard."""
        return self.global_batch // (self.microbatches * self.data_shards)


class SeekableSampler:
    """Micro-batches of ``(inputs, targets)`` as a pure function of their coordinates."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, layout: BatchLayout, seed: int) -> None:
        if tokens.numel() < seq_len + 2:
            raise ConfigError(f"data.seq_len={seq_len} needs a corpus of at least {seq_len + 2} "
                              f"tokens, this split has {tokens.numel()}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.layout = layout
        self.seed = seed
        self._window = torch.arange(seq_len + 1)

    def offsets(self, iteration: int) -> torch.Tensor:
        """Start offsets of all ``global_batch`` samples of ``iteration``."""
        generator = torch.Generator().manual_seed(mix_seed(self.seed, iteration))
        high = self.tokens.numel() - self.seq_len - 1
        return torch.randint(0, high + 1, (self.layout.global_batch,), generator=generator,
                             device="cpu")

    def microbatch(self, iteration: int, shard: int,
                   index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` int64 ``[b, seq_len]`` of micro-batch ``index`` of ``shard``."""
        layout = self.layout
        if not 0 <= shard < layout.data_shards or not 0 <= index < layout.microbatches:
            raise IndexError(f"shard {shard} / micro-batch {index} outside layout {layout}")
        per_micro = layout.global_batch // layout.microbatches
        start = index * per_micro + shard * layout.micro_batch_size
        offsets = self.offsets(iteration)[start:start + layout.micro_batch_size]
        windows = self.tokens[offsets[:, None] + self._window].long()
        return windows[:, :-1], windows[:, 1:]

    def iteration(self, iteration: int, shard: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """All micro-batches of ``shard`` stacked: ``[M, b, seq_len]`` inputs and targets."""
        pairs = [self.microbatch(iteration, shard, m) for m in range(self.layout.microbatches)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def state_dict(self) -> dict[str, int]:
        """What identifies the sample stream (the position is the iteration number)."""
        return {"seed": self.seed, "seq_len": self.seq_len,
                "global_batch": self.layout.global_batch,
                "microbatches": self.layout.microbatches,
                "data_shards": self.layout.data_shards}


def validation_sampler(tokens: torch.Tensor, seq_len: int, layout: BatchLayout,
                       seed: int) -> SeekableSampler:
    """A sampler over the validation split: batch ``i`` is ``iteration(i, shard)``, shaped
    and sharded like a training iteration, with a seed stream of its own."""
    return SeekableSampler(tokens, seq_len, layout, mix_seed(seed, 0x7A1))
