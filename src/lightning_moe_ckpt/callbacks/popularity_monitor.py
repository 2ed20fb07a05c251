"""``PopularityMonitor`` callback: expert popularity over training, for users and plots.

It accumulates every iteration's routing counts (the global ``[layers, experts]`` counts of
the iteration result, no host sync) into a
:class:`~lightning_moe_ckpt.planning.popularity.PopularityTracker` with the chosen scheme
(``hard``, ``soft``, ``ema``, ``capacity``) and, every ``log_every_n_steps``, logs per layer
the share of the most popular expert and the normalised entropy of the popularity (1 =
perfectly balanced). The checkpoint schedule keeps its own tracker; this one is for
observation. Trainer: pass it in ``callbacks``; Fabric: call :meth:`attach` with the engine.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_moe_ckpt.core.target import StepHooks, StepResult
from lightning_moe_ckpt.planning.popularity import PopularityTracker as _Tracker
from lightning_moe_ckpt.training.engine import TrainingEngine
from lightning_moe_ckpt.training.lightning_module import MoELanguageModule


class PopularityMonitor(L.Callback, StepHooks):
    """Tracks and logs expert popularity.

    Args:
        scheme: How popularity is counted: ``"hard"`` (tokens routed), ``"soft"`` (gate
            probability mass), ``"ema"`` (a moving average of tokens routed) or
            ``"capacity"`` (tokens routed divided by the expert's capacity factor).
        alpha: The moving average's weight of the past, for ``scheme="ema"``.
        log_every_n_steps: Log the per-layer statistics every this many steps.
    """

    def __init__(self, scheme: str = "hard", alpha: float = 0.9,
                 log_every_n_steps: int = 10) -> None:
        self.scheme, self.alpha, self.log_every_n_steps = scheme, alpha, log_every_n_steps
        self.tracker: _Tracker | None = None
        self._pending: dict[str, Any] | None = None

    def attach(self, engine: TrainingEngine) -> None:
        """Start tracking ``engine``'s routing."""
        model = engine.settings.model
        self.tracker = _Tracker(model.n_layers, model.n_experts, model.top_k, self.scheme,
                                self.alpha)
        if self._pending is not None:
            self.tracker.load_state_dict(self._pending)
            self._pending = None
        engine.hooks.append(self)

    @override
    def after_optimizer_step(self, step: int, result: StepResult) -> None:
        assert self.tracker is not None
        if result.expert_load is not None and result.soft_load is not None:
            self.tracker.update(result.expert_load, result.soft_load)

    def shares(self) -> torch.Tensor:
        """Popularity ``[layers, experts]`` normalised per layer (one host copy)."""
        assert self.tracker is not None
        frequencies = self.tracker.frequencies()
        n_layers, n_experts = self.tracker.shape
        table = torch.zeros(n_layers, n_experts, dtype=torch.float64)
        for name, value in frequencies.items():
            parts = name.split(".")
            table[int(parts[1]), int(parts[4])] = value
        return table / table.sum(dim=1, keepdim=True).clamp(min=1e-300)

    def layer_statistics(self) -> dict[str, float]:
        """Per layer: the top expert's share and the normalised popularity entropy."""
        shares = self.shares()
        entropy = -(shares * shares.clamp(min=1e-300).log()).sum(dim=1) / math.log(shares.shape[1])
        values = {}
        for layer in range(shares.shape[0]):
            values[f"popularity/layer{layer}_top_share"] = float(shares[layer].max())
            values[f"popularity/layer{layer}_entropy"] = float(entropy[layer])
        return values

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not isinstance(pl_module, MoELanguageModule):
            raise TypeError("PopularityMonitor tracks the built-in MoELanguageModule; for "
                            "your own model SparseCheckpointing reads the routers itself")
        self.attach(pl_module.engine_or_raise())

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step % self.log_every_n_steps == 0:
            pl_module.log_dict(self.layer_statistics(), rank_zero_only=True)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {} if self.tracker is None else self.tracker.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict or None
