"""The built-in model's training settings: model, data, layout, optimizer, precision and
the run's length, as plain typed values.

A recipe builds them from its own configuration (``recipes/moe_recipes/settings.py``
validates the Hydra config into a subclass that adds its checkpointing, fault and
launch settings); a Python user constructs them directly, e.g.
``TrainingSettings(max_steps=20)``: every field has the recipe's default, and the layout
defaults to one process (``TrainingSettings.for_layout(pp=2, ep=2, microbatches=4)`` for
another).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_moe_ckpt.core.layout import ParallelPlan
from lightning_moe_ckpt.core.precision import Precision
from lightning_moe_ckpt.models.config import MoEModelConfig


@dataclass(frozen=True)
class OptimSettings:
    """AdamW, LR schedule (linear warm-up then cosine) and gradient clipping.

    Args:
        lr: AdamW's peak learning rate.
        min_lr_ratio: The cosine schedule's final learning rate as a share of the peak.
        warmup_steps: Linear warm-up steps before the cosine decay.
        weight_decay: AdamW's weight decay.
        betas: AdamW's betas.
        eps: AdamW's epsilon.
        max_grad_norm: Global gradient-norm clipping (across every stage and expert shard);
            ``None``: no clipping.
    """

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0


@dataclass(frozen=True)
class DataSettings:
    """Which corpus, and the sequence length.

    Args:
        name: The corpus: ``"stdlib"`` (the running Python's standard-library sources, no
            download) or ``"textfile"`` (any UTF-8 text file).
        seq_len: Tokens per sequence; at most the model's ``max_seq_len``.
        path: ``textfile`` only, required: the text file.
        val_percent: ``stdlib`` only: the share of source files (chosen by a hash of their
            path) held out for validation.
        val_fraction: ``textfile`` only: the last fraction of the file's bytes is the
            validation split.
    """

    name: str = "stdlib"
    seq_len: int = 64
    path: str | None = None
    val_percent: float = 5.0
    val_fraction: float = 0.05


@dataclass(frozen=True, kw_only=True)
class TrainingSettings:
    """What the built-in model's training needs: the model, its data, the parallel layout,
    the optimizer, the precision, the seed and the run's length and batch sizes.

    Every field is keyword-only and has the recipe's default.

    Args:
        model: The built-in model's shape.
        data: The corpus and the sequence length.
        layout: The parallel layout; ``None``: one process.
        optim: The optimizer, LR schedule and clipping.
        precision: ``"32"`` (fp32 everything) or ``"bf16-master"`` (bf16 compute weights,
            fp32 master weights and optimizer state).
        seed: Seed of the initialisation and the data order.
        max_steps: Optimizer steps to train (the LR schedule ends there).
        global_batch: Sequences per optimizer step, over all micro-batches and data
            shards.
        val_every: Validate every this many steps (the recipe's loops read it; a Trainer
            of your own takes ``val_check_interval`` instead).
        val_batches: Validation batches each time.
        log_every: Log metrics every this many steps (the recipe's loops read it; a Trainer
            of your own takes ``log_every_n_steps`` instead).
    """

    model: MoEModelConfig = field(default_factory=MoEModelConfig)
    data: DataSettings = field(default_factory=DataSettings)
    layout: ParallelPlan = None  # type: ignore[assignment]  # None: one process (post-init)
    optim: OptimSettings = field(default_factory=OptimSettings)
    precision: Precision = "32"
    seed: int = 0
    max_steps: int = 200
    global_batch: int = 16
    val_every: int = 50
    val_batches: int = 4
    log_every: int = 10

    @classmethod
    def for_layout(cls, *, pp: int = 1, dp: int = 1, ep: int = 1, microbatches: int = 1,
                   schedule: str = "1f1b", dp_shard: int = 1, **fields: Any
                   ) -> TrainingSettings:
        """Settings for a ``pp x dp x dp_shard x ep`` layout (validated against the
        model); ``fields`` are the other fields, e.g. ``max_steps=20``."""
        model = fields.get("model", MoEModelConfig())
        return cls(layout=ParallelPlan.validate(pp=pp, dp=dp, ep=ep, microbatches=microbatches,
                                                schedule=schedule, model=model,
                                                dp_shard=dp_shard), **fields)

    def __post_init__(self) -> None:
        if self.layout is None:
            object.__setattr__(self, "layout", ParallelPlan.validate(
                pp=1, dp=1, ep=1, microbatches=1, schedule="1f1b", model=self.model))
