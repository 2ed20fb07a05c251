"""The built-in MoE transformer's training, shared by the Trainer and Fabric: its
settings, engine, executors (local, distributed, a user's staged model), data, the
LightningModules and the consolidated end state."""

from lightning_moe_ckpt.training.data import build_dataloaders
from lightning_moe_ckpt.training.engine import TrainingEngine
from lightning_moe_ckpt.training.iteration import IterationResult, train_iteration
from lightning_moe_ckpt.training.lightning_module import MoELanguageModule
from lightning_moe_ckpt.training.settings import DataSettings, OptimSettings, TrainingSettings

__all__ = ["DataSettings", "IterationResult", "MoELanguageModule", "OptimSettings",
           "TrainingEngine", "TrainingSettings", "build_dataloaders", "train_iteration"]
