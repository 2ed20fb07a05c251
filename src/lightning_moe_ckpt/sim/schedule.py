"""MoEvement's sparse schedule in the simulator: the runtime's Algorithm 1 on modelled bytes.

The simulator does not plan windows itself: it hands each stage's operators, with the
bytes one GPU holds of each (``1 / ranks`` of every operator) and their popularity, to
:func:`lightning_moe_ckpt.planning.schedule.plan_window`, the code the training runtime
uses, and reads the result back in terms of its own :class:`OperatorCost` records. The
per-iteration byte budget is passed as the bandwidth of a one-second iteration, so the
window comes out exactly as the runtime would plan it for that budget: operators in
ascending popularity (popular experts last), each turn as large as its snapshot (master
state of the turn + compute weights of every later turn) still fits. :func:`fixed_window`
asks the same code for a given ``W`` (a window measured on a real run, for calibration).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_moe_ckpt.errors import require
from lightning_moe_ckpt.planning.schedule import (
    OperatorSpec,
    WindowSchedule,
    order_operators,
    plan_window,
)
from lightning_moe_ckpt.sim.workload import OperatorCost

# plan_window needs a positive bandwidth; a budget this small fits no operator, which is
# what a zero or negative budget means (one operator per turn, the stall charged later).
_NOTHING_FITS_BYTES = 1e-9


def _per_gpu_specs(operators: Sequence[OperatorCost], ranks: int) -> tuple[OperatorSpec, ...]:
    """The runtime's view of a stage: each operator's bytes on one GPU (rounded to whole
    bytes, as the runtime counts them) and its popularity."""
    return tuple(OperatorSpec(op.name, round(op.compute_bytes / ranks),
                              round(op.master_state_bytes / ranks), min(1.0, op.activation))
                 for op in operators)


def ordered_costs(operators: Sequence[OperatorCost]) -> tuple[OperatorCost, ...]:
    """The runtime's order (ascending popularity, ties in model order) of ``operators``."""
    by_name = {op.name: op for op in operators}
    return tuple(by_name[name] for name in order_operators(_per_gpu_specs(operators, 1)))


@dataclass(frozen=True)
class SparseSchedule:
    """A stage's window: the turns of its operators and each snapshot's bytes on one GPU."""

    turns: tuple[tuple[OperatorCost, ...], ...]  # turns[i]: master state in snapshot i
    snapshot_bytes: tuple[float, ...]  # per GPU, one per snapshot of the window
    fits: bool  # whether every snapshot moves within the budget

    @property
    def window(self) -> int:
        return len(self.turns)

    @property
    def order(self) -> tuple[OperatorCost, ...]:
        return tuple(op for turn in self.turns for op in turn)

    def frozen_after(self, snapshot: int) -> frozenset[str]:
        """Operators still frozen after loading snapshot ``snapshot`` during conversion."""
        return frozenset(op.name for turn in self.turns[snapshot + 1:] for op in turn)

    @property
    def largest_bytes(self) -> float:
        return max(self.snapshot_bytes)

    @property
    def window_bytes(self) -> float:
        """Bytes of all snapshots of one window on one GPU (what recovery fetches)."""
        return float(sum(self.snapshot_bytes))


def _from_runtime(planned: WindowSchedule, operators: Sequence[OperatorCost],
                  specs: Sequence[OperatorSpec]) -> SparseSchedule:
    by_name = {op.name: op for op in operators}
    spec_of = {spec.name: spec for spec in specs}
    turns = tuple(tuple(by_name[name] for name in turn) for turn in planned.turns)
    sizes = tuple(float(planned.snapshot_bytes(i, spec_of)) for i in range(planned.window))
    return SparseSchedule(turns, sizes, planned.fits)


def find_window(operators: Sequence[OperatorCost], ranks: int,
                budget_bytes: float) -> SparseSchedule:
    """Algorithm 1 over a stage's operators for a per-GPU, per-iteration ``budget_bytes``.
    If nothing fits: one operator per snapshot, ``fits=False`` (the stall is the caller's
    to charge)."""
    specs = _per_gpu_specs(operators, ranks)
    planned = plan_window(specs, 1.0, max(budget_bytes, _NOTHING_FITS_BYTES))
    return _from_runtime(planned, operators, specs)


def fixed_window(operators: Sequence[OperatorCost], ranks: int, window: int) -> SparseSchedule:
    """The runtime's schedule of exactly ``window`` snapshots (largest snapshot minimised),
    capped at one operator per snapshot."""
    require(isinstance(window, int) and window >= 1,
            f"window W={window!r} must be an integer >= 1 (checkpoint.window)")
    specs = _per_gpu_specs(operators, ranks)
    planned = plan_window(specs, 1.0, _NOTHING_FITS_BYTES, min(window, len(specs)))
    return _from_runtime(planned, operators, specs)
