"""Training iteration shared by Trainer and Fabric: settings, engine, executors, data,
the LightningModule and the end-of-run artifacts."""

from lightning_moe_ckpt.training.core import IterationResult, train_iteration
from lightning_moe_ckpt.training.data import build_dataloaders
from lightning_moe_ckpt.training.engine import TrainingEngine
from lightning_moe_ckpt.training.lightning_module import MoELanguageModule
from lightning_moe_ckpt.training.settings import RunSettings, settings_from_config

__all__ = ["IterationResult", "MoELanguageModule", "RunSettings", "TrainingEngine",
           "build_dataloaders", "settings_from_config", "train_iteration"]
