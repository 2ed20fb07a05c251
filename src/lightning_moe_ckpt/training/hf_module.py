"""A Hugging Face MoE causal LM as an ordinary LightningModule, for ``model=hf_qwen3_moe``.

This is the path a user's own model takes: a plain LightningModule with automatic
optimization, ``torch.optim.AdamW`` and a step-wise LR schedule, trained by ``L.Trainer``
with ``gradient_clip_val``; ``SparseCheckpointing`` discovers its operators (fused experts
sliced per expert) and follows its optimizer. The model is a Qwen3-MoE randomly
initialised from a config of the recipe's shape (no download); batches come from the
recipe's seekable sampler, flattened over micro-batches.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_moe_ckpt.core.target import StepIndexedData, UserModelParallelism
from lightning_moe_ckpt.data.sampler import SeekableSampler
from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.models.config import MoEModelConfig
from lightning_moe_ckpt.training.data import IterationDataset
from lightning_moe_ckpt.training.history import TrainingHistory
from lightning_moe_ckpt.training.iteration import build_scheduler, language_model_loss
from lightning_moe_ckpt.training.pipeline_module import PipelineTrainable
from lightning_moe_ckpt.training.settings import TrainingSettings


def build_hf_model(cfg: MoEModelConfig, seed: int) -> nn.Module:
    """A randomly initialised ``Qwen3MoeForCausalLM`` of ``cfg``'s shape."""
    try:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    except ImportError as error:
        raise ConfigError(f"model.family={cfg.family!r} needs transformers: install the "
                          "[hf] extra (pip install 'lightning-moe-ckpt[hf]')") from error
    options: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=4 * cfg.d_model,
        moe_intermediate_size=cfg.expert_hidden, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads,
        head_dim=cfg.head_dim, num_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
        max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=False, use_cache=False,
        rms_norm_eps=cfg.norm_eps, initializer_range=cfg.init_std,
        # The reference kernels: deterministic on every backend.
        attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**options))


class HFLanguageModule(StepIndexedData, PipelineTrainable, L.LightningModule):
    """Next-byte prediction with a Hugging Face MoE, automatic optimization; under
    ``MoEParallelStrategy`` its model is split by the built-in plan."""

    def __init__(self, settings: TrainingSettings, history: TrainingHistory,
                 sampler: SeekableSampler) -> None:
        super().__init__()
        self.settings = settings
        self.history = history
        self.sampler = sampler
        self.model = build_hf_model(settings.model, settings.seed)

    @override
    def parallel_model(self) -> nn.Module:
        return self.model

    @override
    def split_batch(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return batch["inputs"].flatten(0, 1), batch["targets"].flatten(0, 1)

    @override
    def microbatch_loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return language_model_loss(output, targets)

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        inputs, targets = self.split_batch(batch)
        loss = self.microbatch_loss(self.model(input_ids=inputs).logits, targets)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def train_dataloader(self) -> DataLoader[dict[str, Any]]:
        strategy = self.trainer.strategy
        shard = strategy.data_shard if isinstance(strategy, UserModelParallelism) else 0
        # Indexed by step: a resumed run reads on from the checkpoint's step (max_steps items
        # from there, as Lightning restores its count of the epoch's batches too).
        start = self.trainer.global_step
        return DataLoader(IterationDataset(self.sampler, start + self.settings.max_steps,
                                           start=start, shard=shard), batch_size=None)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.history.start_iteration()

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.history.record_loss(loss.detach())

    @override
    def configure_optimizers(self) -> Any:
        optim = self.settings.optim
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, betas=optim.betas,
                                      eps=optim.eps, weight_decay=optim.weight_decay)
        scheduler = build_scheduler(optimizer, optim, self.settings.max_steps)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
