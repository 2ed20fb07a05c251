"""MoE transformer: configuration, router, experts and the decoder model."""

from lightning_moe_ckpt.models.config import MoEModelConfig
from lightning_moe_ckpt.models.moe import Expert, MoELayer
from lightning_moe_ckpt.models.router import RouterOutput, TopKRouter
from lightning_moe_ckpt.models.transformer import MoETransformer

__all__ = ["Expert", "MoELayer", "MoEModelConfig", "MoETransformer", "RouterOutput", "TopKRouter"]
