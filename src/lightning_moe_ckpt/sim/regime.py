"""What a checkpoint policy costs: the :class:`Regime` and the :class:`Policy` interface.

A regime is a policy's behaviour while its parameters stay fixed: how often it starts a
checkpoint (``interval``), how many iterations one complete checkpoint spans (``window``:
MoEvement's ``W_sparse``, 1 for dense checkpoints), the stall each checkpoint adds beyond
what overlaps with training, the slowdown its traffic causes by sharing PCIe, host memory
and the network with training (``interference``; stall and interference together are
``T_ckpt`` of the ETTR formula), and the recovery model.
Most policies have one regime for the whole run. MoC changes regime after failures (its
lost-token budget forces more experts per snapshot), so a policy exposes a state that
:meth:`Policy.after_failure` advances; ``rng=None`` asks for the expected transition.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from lightning_moe_ckpt.sim.recovery import RecoveryModel


@dataclass(frozen=True)
class Regime:
    """A policy's checkpoint cadence, stall and recovery while its parameters hold.

    Args:
        interval: Iterations between checkpoint starts.
        window: Iterations one complete checkpoint spans (MoEvement's ``W_sparse``, 1 for
            dense checkpoints).
        stall_s: Stall per checkpoint beyond the overlap with training, seconds.
        iteration_s: Fault-free iteration time, seconds.
        recovery: The recovery-time model.
        snapshot_bytes_per_gpu: Largest single snapshot a GPU moves.
        note: Describes the regime in reports (e.g. MoC's K).
        interference: Slowdown fraction from checkpoint traffic sharing links.
    """

    interval: int
    window: int
    stall_s: float
    iteration_s: float
    recovery: RecoveryModel
    snapshot_bytes_per_gpu: float
    note: str = ""
    interference: float = 0.0

    @property
    def stall_overhead(self) -> float:
        """Stall share of the iteration time: ``stall / (T_iter x interval)``."""
        return self.stall_s / (self.iteration_s * self.interval)

    @property
    def overhead(self) -> float:
        """Runtime overhead fraction, ``T_ckpt / (T_iter x interval)``: stall plus
        interference."""
        return self.stall_overhead + self.interference

    @property
    def overhead_s_per_iteration(self) -> float:
        return self.overhead * self.iteration_s


class Policy(ABC):
    """A checkpoint policy planned for one job (and, where it depends on it, one MTBF)."""

    name: str = ""
    dynamic: bool = False  # whether failures change the regime

    def initial_state(self) -> object:
        return None

    @abstractmethod
    def regime(self, state: object) -> Regime:
        """The regime in force in ``state``."""

    def after_failure(self, state: object, rng: np.random.Generator | None) -> object:
        """State after one more failure (expected transition when ``rng`` is None)."""
        return state


class StaticPolicy(Policy):
    """A policy with a single regime."""

    def __init__(self, name: str, regime: Regime) -> None:
        self.name = name
        self._regime = regime

    def regime(self, state: object) -> Regime:
        return self._regime
