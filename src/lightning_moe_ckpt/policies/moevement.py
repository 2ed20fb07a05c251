"""Capture planners: which operators each checkpoint policy snapshots after each optimizer step.

Every policy answers the same question through the :class:`Planner` interface: after
optimizer step ``t``, which operators' master state and which operators' compute weights
go into the snapshot (a :class:`CapturePlan`), or none at all. The snapshot capture executes
plans without knowing the policy. Planners see the routers' telemetry through
:meth:`Planner.observe`, called for iteration ``t`` *before* :meth:`Planner.plan` for
``t`` (the tokens of iteration ``t`` are in the state captured after step ``t``); the
telemetry stays on the device and a planner never forces a host sync per iteration.
Plans name operators from the specs a planner was given (the whole model's or one rank's);
the engine skips names its rank does not hold.

This module holds ``moevement`` (:class:`MoEvementPlanner`) and the factory; the interface
and ``none`` are in ``planner_base``, the dense baselines in ``planners_dense`` and the
partial-expert ones (MoC, MoEtion) in ``planners_partial``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

import numpy as np
import torch
from typing_extensions import override

from lightning_moe_ckpt.errors import fmt, is_number, require
from lightning_moe_ckpt.planning.planner import (
    BasePlanner,
    CapturePlan,
    expert_layout,
)
from lightning_moe_ckpt.planning.popularity import (
    PopularityTracker,
    check_reorder_thresholds,
    frequencies_moved,
)
from lightning_moe_ckpt.planning.schedule import (
    OperatorSpec,
    WindowSchedule,
    plan_window,
)


class WindowAgreement(Protocol):
    """How the ranks settle on one W, the largest any of them proposes.

    :meth:`start` sends this rank's proposal and returns at once; :meth:`result` is the W
    agreed for the last proposal, waiting only if it is not in yet. Every rank starts
    the same number of agreements in the same order (one per window boundary, and one
    more at the first boundary after a start or a recovery)."""

    def start(self, window: int) -> None:
        """Propose ``window`` (non-blocking)."""

    def result(self) -> int:
        """The agreed W of the last :meth:`start`."""


class MoEvementPlanner(BasePlanner):
    """``checkpoint=moevement``: one sparse snapshot per iteration, W per window.

    Each window's :class:`~lightning_moe_ckpt.planning.schedule.WindowSchedule` is fixed
    when the window starts and recorded in every plan of the window. At a window boundary
    the planner reads the popularity tracker once and reorders only if
    :func:`~lightning_moe_ckpt.planning.popularity.should_reorder` says the frequencies
    moved enough since the order in force was built (not while the window is a single
    iteration, where the order changes nothing). A new profile (:meth:`set_profile`)
    also takes effect at the next boundary. Without a profile or a forced ``window`` it
    plans nothing (the engine profiles the first iterations). ``window_agreement`` turns
    this rank's smallest fitting W into the W all ranks use (the largest), so window
    boundaries line up across a recovery group; a larger W is cut by the forced rule,
    whose snapshots are never larger. The agreement runs in the background: the W
    proposed at one boundary is used from the next one on (at the first boundary after a
    start or a recovery, which every rank reaches together, the ranks wait for it), so
    no boundary holds the training thread in a collective. Agreements are at least
    ``agreement_every`` iterations apart (a boundary in between keeps the W last agreed):
    with W = 1 every iteration is a boundary, and a world-wide all-reduce per iteration
    costs each rank CPU (about 0.3 ms with four gloo ranks on two cores) that grows with
    the world. Boundaries fall on the same iterations on every rank, so every rank skips
    the same ones. A W that grows on one rank thus takes effect on all of them at the
    second agreement after it, at most ``2 * agreement_every`` iterations or two windows
    later (its snapshots exceed the budget until then, which the stall measures).
    """

    name = "moevement"
    wants_profile = True

    def __init__(self, specs: Sequence[OperatorSpec], *, iteration_time_s: float | None = None,
                 bandwidth_bytes_per_s: float | None = None, window: int | None = None,
                 popularity: str = "hard", ema_alpha: float = 0.9, top_k: int = 1,
                 n_layers: int | None = None, n_experts: int | None = None,
                 capacity_factors: Sequence[Sequence[float]] | torch.Tensor | None = None,
                 reorder_change_threshold: float = 0.10,
                 reorder_fraction_threshold: float = 0.25,
                 window_agreement: WindowAgreement | None = None,
                 agreement_every: int = 16, headroom: float = 1.0) -> None:
        if not specs:
            raise ValueError("moevement needs at least one operator to checkpoint")
        require(is_number(headroom) and 0 < headroom <= 1,
                f"{fmt('checkpoint.headroom', headroom)} must be a number in (0, 1]: the "
                "share of an iteration a snapshot's copy may take")
        self.headroom = headroom
        require(isinstance(agreement_every, int) and agreement_every >= 1,
                f"agreement_every={agreement_every!r} must be an integer >= 1")
        check_reorder_thresholds(reorder_change_threshold, reorder_fraction_threshold)
        if window is not None:
            require(isinstance(window, int) and window >= 1,
                    f"{fmt('checkpoint.window', window)} must be an integer >= 1")
            if window > len(specs):
                warnings.warn(
                    f"checkpoint.window={window} exceeds the {len(specs)} operators to "
                    f"checkpoint here: the last {window - len(specs)} snapshots of every "
                    "window capture nothing, and a failure rolls back up to two windows",
                    UserWarning, stacklevel=2)
        self.specs = {spec.name: spec for spec in specs}
        layout = expert_layout(list(self.specs), n_layers, n_experts)
        self.tracker = (PopularityTracker(layout.n_layers, layout.n_experts, top_k, popularity,
                                          ema_alpha, capacity_factors)
                        if layout.experts else None)
        self.forced_window = window
        self.change_threshold = reorder_change_threshold
        self.fraction_threshold = reorder_fraction_threshold
        self.window_agreement = window_agreement
        self.agreement_every = agreement_every
        self._next_agreement = 0  # the first iteration whose boundary agrees again
        # The W last agreed; None until the first agreement after a start or a recovery
        # (a proposal is on its way from then on).
        self._agreed: int | None = None
        self._needed: int | None = None  # this rank's own smallest fitting W (its proposal)
        self.profile: tuple[float, float] | None = None
        if iteration_time_s is not None and bandwidth_bytes_per_s is not None:
            self.profile = (float(iteration_time_s), float(bandwidth_bytes_per_s))
        self.reorders = 0
        self.schedule: WindowSchedule | None = None
        self.window_start: int | None = None
        self._next: int | None = None  # the iteration that continues the current window
        self._stale = True  # schedule must be rebuilt at the next boundary
        # The tracker's entries of the experts this planner holds (row-major positions),
        # and their frequencies when the order in force was built.
        self._held = ([] if self.tracker is None else
                      [(i, name) for i, name in enumerate(self.tracker.names)
                       if name in self.specs])
        self._held_index = np.array([i for i, _ in self._held], dtype=np.int64)
        self._ordered_by: np.ndarray | None = None

    @override
    def set_profile(self, iteration_time_s: float, bandwidth_bytes_per_s: float) -> None:
        """New measured inputs; used from the next window on."""
        self.profile = (float(iteration_time_s), float(bandwidth_bytes_per_s))
        self._stale = True

    @override
    def update_specs(self, specs: Sequence[OperatorSpec]) -> None:
        for spec in specs:
            if spec.name in self.specs:  # sizes change, learned popularity stays
                self.specs[spec.name] = replace(
                    self.specs[spec.name], compute_bytes=spec.compute_bytes,
                    master_state_bytes=spec.master_state_bytes)
        self._stale = True

    @override
    def observe(self, iteration: int, hard_counts: torch.Tensor,
                soft_counts: torch.Tensor) -> None:
        if self.tracker is not None:
            self.tracker.update(hard_counts, soft_counts)

    @override
    def plan(self, iteration: int) -> CapturePlan | None:
        schedule, start = self.schedule, self.window_start
        if (schedule is None or start is None or self._next != iteration
                or iteration - start >= schedule.window):
            if not self._start_window(iteration):
                return None
            schedule, start = self.schedule, iteration
            assert schedule is not None
        self._next = iteration + 1
        index = iteration - start
        if self.tracker is not None and index == schedule.window - 1 and schedule.window > 1:
            # The next boundary reads the counters: copied from here, they reach the host
            # while the device runs one more iteration, and reading them costs no sync.
            self.tracker.publish()
        return CapturePlan(iteration, schedule.master_at(index), schedule.compute_at(index),
                           start, index, schedule.window, schedule.to_dict())

    @override
    def on_recovery(self, iteration: int) -> None:
        self._next = None  # the next plan starts a fresh window
        if self.tracker is not None:  # the next boundary reads the counters as they are
            self.tracker.discard_published()
        # Every rank recovers together: all of them agree afresh at the next boundary (a
        # proposal still on its way belongs to the groups before the failure).
        self._agreed = None

    def _start_window(self, iteration: int) -> bool:
        if self.profile is None and self.forced_window is None:
            return False
        # A window of one iteration takes every operator's full state at once: the order,
        # all that popularity decides, changes nothing then, so the tracker is not read
        # (nor the copy lists rebuilt for a new order) until the window grows.
        single = self.schedule is not None and self.schedule.window == 1 and not self._stale
        if not single and self._maybe_reorder():
            self._stale = True
        if self._stale or self.schedule is None:
            self.schedule = self._build()
            self._stale = False
            self._needed = self.schedule.window
        if self.window_agreement is not None:
            self._apply_agreement(self.window_agreement, iteration)
        self.window_start = iteration
        return True

    def _apply_agreement(self, agreement: WindowAgreement, iteration: int) -> None:
        """Use the W agreed for the previous boundary's proposals and propose this one's:
        the collective completes while the window runs instead of at the boundary, where
        it would wait for the slowest rank's optimizer step (several ms per iteration at
        W = 1 with four ranks on two cores)."""
        assert self.schedule is not None
        # What this rank needs, not the W last agreed: a need proposed at one boundary is
        # applied only at the next, when the schedule in force may be another rank's.
        proposed = self._needed if self._needed is not None else self.schedule.window
        if self._agreed is None:  # first boundary: nothing agreed yet, wait for it
            agreement.start(proposed)
        elif iteration < self._next_agreement:
            # No agreement at this boundary: the W last agreed stands (a schedule rebuilt
            # here for this rank's own need must not change it).
            if self._agreed != self.schedule.window:
                self.schedule = self._build(forced=self._agreed)
            return
        agreed = agreement.result()
        agreement.start(proposed)  # for the next agreement
        self._agreed = agreed
        self._next_agreement = iteration + self.agreement_every
        if agreed != self.schedule.window:
            self.schedule = self._build(forced=agreed)

    def _build(self, forced: int | None = None) -> WindowSchedule:
        # Without a profile (forced window only) the budget is unknown: plan against an
        # infinite one, so `fits` only reflects a profile when there is one.
        iteration_s, bandwidth = self.profile or (1.0, float("inf"))
        schedule = plan_window(list(self.specs.values()), iteration_s, bandwidth,
                               forced if forced is not None else self.forced_window,
                               headroom=self.headroom)
        return schedule if self.profile else replace(schedule, budget_bytes=None)

    def _maybe_reorder(self) -> bool:
        """Read the tracker and adopt its frequencies if they moved past the thresholds
        relative to the order in force (array operations over the experts; a Python pass
        over them only when the order changes).

        The frequencies are those published at the last iteration of the window that
        ends here, one iteration old: reading the counters as they are now would wait for
        the device at every boundary. Only a boundary with no publication before it (the
        first one, after a recovery, or after windows of one iteration) reads them with
        that wait."""
        if self.tracker is None or self.tracker.iterations == 0:
            return False
        frequencies = self.tracker.published_frequency_matrix()
        if frequencies is None:
            frequencies = self.tracker.frequency_matrix()
        current = frequencies.reshape(-1)[self._held_index]
        previous = self._ordered_by
        if previous is None:
            previous = np.array([self.specs[name].popularity for _, name in self._held],
                                dtype=np.float64)
        if not frequencies_moved(previous, current, self.change_threshold,
                                 self.fraction_threshold):
            return False
        for (_, name), share in zip(self._held, current.tolist(), strict=True):
            self.specs[name] = replace(self.specs[name], popularity=share)
        self._ordered_by = current
        self.reorders += 1
        return True

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "popularity": {name: spec.popularity for name, spec in self.specs.items()},
            "ordered_by": None if self._ordered_by is None else dict(zip(
                (name for _, name in self._held), self._ordered_by.tolist(), strict=True)),
            "schedule": None if self.schedule is None else self.schedule.to_dict(),
            "window_start": self.window_start, "next": self._next, "stale": self._stale,
            "needed_window": self._needed,
            "profile": None if self.profile is None else list(self.profile),
            "reorders": self.reorders,
            "tracker": None if self.tracker is None else self.tracker.state_dict(),
        }

    @override
    def load_state_dict(self, d: dict[str, Any]) -> None:
        for name, share in d["popularity"].items():
            if name in self.specs:
                self.specs[name] = replace(self.specs[name], popularity=float(share))
        ordered_by = d["ordered_by"]
        self._ordered_by = None if ordered_by is None else np.array(
            [float(ordered_by[name]) for _, name in self._held], dtype=np.float64)
        schedule = d["schedule"]
        self.schedule = None if schedule is None else WindowSchedule.from_dict(schedule)
        self.window_start, self._next, self._stale = d["window_start"], d["next"], d["stale"]
        self._agreed = None  # every rank loads together (a resume): agree afresh
        self._needed = d.get("needed_window")  # absent from states saved before it existed
        self.profile = None if d["profile"] is None else (d["profile"][0], d["profile"][1])
        self.reorders = int(d["reorders"])
        if self.tracker is not None and d["tracker"] is not None:
            self.tracker.load_state_dict(d["tracker"])
