"""lightning-moe-ckpt: sparse per-iteration checkpointing and exact recovery for
Mixture-of-Experts training with PyTorch Lightning and Fabric."""

from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.models import MoEModelConfig, MoETransformer

__version__ = "0.1.0"
__all__ = ["ConfigError", "MoEModelConfig", "MoETransformer", "__version__"]
