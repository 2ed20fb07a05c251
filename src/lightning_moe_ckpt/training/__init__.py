"""Single training iteration shared by Trainer and Fabric, the LightningModule, and the
recipe runner that writes the run's artifacts."""

from lightning_moe_ckpt.training.core import IterationResult, train_iteration
from lightning_moe_ckpt.training.engine import TrainingEngine
from lightning_moe_ckpt.training.lightning_module import MoELanguageModule
from lightning_moe_ckpt.training.run import build_dataloaders, run_training
from lightning_moe_ckpt.training.settings import RunSettings, settings_from_config

__all__ = ["IterationResult", "MoELanguageModule", "RunSettings", "TrainingEngine",
           "build_dataloaders", "run_training", "settings_from_config", "train_iteration"]
