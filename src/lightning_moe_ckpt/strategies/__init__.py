"""Lightning strategies for expert + pipeline + data parallel MoE training.

``MoEParallelStrategy`` exists twice, for Fabric (:mod:`.fabric`) and for the Trainer
(:mod:`.trainer`), over one :class:`~.core.MoEParallelCore`. Importing this package
registers both under the name ``"moe_parallel"`` in Lightning's registries.
"""

import lightning.fabric.strategies as _fabric_strategies
import lightning.pytorch.strategies as _trainer_strategies

from lightning_moe_ckpt.strategies.core import MoEParallelCore
from lightning_moe_ckpt.strategies.fabric import STRATEGY_NAME
from lightning_moe_ckpt.strategies.fabric import MoEParallelStrategy as FabricMoEParallelStrategy
from lightning_moe_ckpt.strategies.trainer import MoEParallelStrategy as TrainerMoEParallelStrategy

FabricMoEParallelStrategy.register_strategies(_fabric_strategies.STRATEGY_REGISTRY)
TrainerMoEParallelStrategy.register_strategies(_trainer_strategies.StrategyRegistry)

__all__ = ["STRATEGY_NAME", "FabricMoEParallelStrategy", "MoEParallelCore",
           "TrainerMoEParallelStrategy"]
