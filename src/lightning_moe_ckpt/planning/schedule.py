"""The sparse checkpoint schedule: paper Algorithm 1 generalised to real, unequal operator sizes.

Operators are ordered by ascending popularity (popular experts last, so they stay frozen
longest during sparse-to-dense replay; non-expert operators see every token and come last)
and the order is cut into ``W`` consecutive *turns*. Snapshot ``i`` of a window carries the
master state of turn ``i`` and the compute weights of every later turn, so it costs
``master(turn i) + compute(turns i+1..W-1)`` bytes, and it must move device-to-host within
one iteration: ``bytes <= budget = iteration_time x bandwidth``. Algorithm 1 assumes equal
operators and equal-count turns; with real sizes the first snapshot, which carries all the
later compute weights, is the heavy one, so :func:`plan_window` cuts turns greedily: each
turn reaches as far along the order as its snapshot still fits (see :func:`_greedy_bounds`
for why that gives the smallest ``W`` of any cut of the order). A forced ``W``
(``checkpoint.window``, or the W the ranks agreed on) is cut so that its largest snapshot is
as small as possible; a W beyond the operator count (a small pipeline stage among larger
ones) takes one operator per turn and leaves the last turns empty. When
no cut fits at all, the schedule takes one operator per turn and says ``fits=False``: the
engine then reports the resulting stall instead of failing.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_moe_ckpt.core.operators import expert_position
from lightning_moe_ckpt.core.optimizer_state import OptimizerStateAccess
from lightning_moe_ckpt.core.registry import OperatorRegistry
from lightning_moe_ckpt.errors import fmt, is_number, require


@dataclass(frozen=True)
class OperatorSpec:
    """What the schedule needs to know about one operator."""

    name: str  # layout-independent operator name, e.g. "layers.3.moe.experts.17"
    compute_bytes: int  # compute weights (bf16 or fp32)
    master_state_bytes: int  # fp32 master weights + optimizer state
    popularity: float  # activation frequency in [0, 1]; non-expert operators: 1.0

    def __post_init__(self) -> None:
        if self.compute_bytes < 0 or self.master_state_bytes < 0:
            raise ValueError(f"operator {self.name!r} has negative byte sizes "
                             f"({self.compute_bytes}, {self.master_state_bytes})")
        if not 0.0 <= self.popularity <= 1.0:  # also rejects NaN
            raise ValueError(f"operator {self.name!r} has popularity {self.popularity}, "
                             "expected a frequency in [0, 1]")


def specs_from_registry(registry: OperatorRegistry,
                        state: OptimizerStateAccess | None = None,
                        popularity: Mapping[str, float] | None = None,
                        expert_default: float = 0.0) -> tuple[OperatorSpec, ...]:
    """Specs of a registry's operators in model order with their byte sizes: compute
    weights from the parameters, master state measured from ``state`` (the live
    optimizer; nominal AdamW sizes without one).

    Experts take their popularity from ``popularity`` (``expert_default`` when absent);
    every other operator processes every token and gets 1.0.
    """
    popularity = popularity or {}
    specs = []
    for op in registry:
        nbytes = op.nbytes
        master_state = (nbytes.master_state if state is None else
                        sum(state.master_state_bytes(part) for part in op.parts)
                        + op.buffer_bytes)
        share = popularity.get(op.name, expert_default) if op.kind == "expert" else 1.0
        specs.append(OperatorSpec(op.name, nbytes.compute, master_state, float(share)))
    return tuple(specs)


def order_operators(specs: Sequence[OperatorSpec]) -> tuple[str, ...]:
    """Names by ascending popularity (popular last); ties keep the given order (stable)."""
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        duplicates = sorted({name for name in names if names.count(name) > 1})
        raise ValueError(f"duplicate operator names: {', '.join(duplicates)}")
    return tuple(spec.name for spec in sorted(specs, key=lambda spec: spec.popularity))


@dataclass(frozen=True)
class WindowSchedule:
    """One window: the order and which operators' master state each snapshot captures.

    ``fits`` is False when even one operator per snapshot exceeds the per-iteration budget;
    training then goes on with this schedule and the engine reports the stall.
    """

    window: int  # W
    order: tuple[str, ...]  # ascending popularity (popular last)
    turns: tuple[tuple[str, ...], ...]  # turns[i]: master state captured in snapshot i
    fits: bool = True
    budget_bytes: float | None = None  # iteration_time x bandwidth it was planned for

    def __post_init__(self) -> None:
        if self.window != len(self.turns) or self.window < 1:
            raise ValueError(f"window={self.window} but {len(self.turns)} turns")
        captured = sum(1 for turn in self.turns if turn)
        if any(not turn for turn in self.turns[:captured]):
            raise ValueError("only the last turns may capture no operator (a window longer "
                             "than the operator count)")
        if tuple(itertools.chain.from_iterable(self.turns)) != self.order:
            raise ValueError("turns must cut the order into consecutive pieces, each "
                             "operator exactly once")

    def master_at(self, i: int) -> tuple[str, ...]:
        """Operators whose master state snapshot ``i`` captures."""
        return self.turns[self._index(i)]

    def compute_at(self, i: int) -> tuple[str, ...]:
        """Operators not yet captured after snapshot ``i``: their compute weights go in it
        (and they stay frozen after loading it during sparse-to-dense conversion)."""
        return tuple(itertools.chain.from_iterable(self.turns[self._index(i) + 1:]))

    def turn_of(self, name: str) -> int:
        """Index of the snapshot that captures ``name``'s master state."""
        for i, turn in enumerate(self.turns):
            if name in turn:
                return i
        raise KeyError(f"operator {name!r} is not in this schedule")

    def snapshot_bytes(self, i: int, specs: Mapping[str, OperatorSpec]) -> int:
        """Bytes snapshot ``i`` moves: master state of its turn + compute of later turns."""
        return (sum(specs[name].master_state_bytes for name in self.master_at(i))
                + sum(specs[name].compute_bytes for name in self.compute_at(i)))

    def largest_snapshot_bytes(self, specs: Mapping[str, OperatorSpec]) -> int:
        """The binding snapshot of the window."""
        return max(self.snapshot_bytes(i, specs) for i in range(self.window))

    def to_dict(self) -> dict[str, Any]:
        """Plain Python types, for snapshot metadata."""
        return {"window": self.window, "order": list(self.order),
                "turns": [list(turn) for turn in self.turns], "fits": self.fits,
                "budget_bytes": self.budget_bytes}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WindowSchedule:
        """Inverse of :meth:`to_dict` (validates the contents)."""
        budget = d.get("budget_bytes")
        return cls(int(d["window"]), tuple(str(n) for n in d["order"]),
                   tuple(tuple(str(n) for n in turn) for turn in d["turns"]),
                   bool(d.get("fits", True)), None if budget is None else float(budget))

    def _index(self, i: int) -> int:
        if not 0 <= i < self.window:
            raise IndexError(f"snapshot index {i} outside window 0..{self.window - 1}")
        return i


class _Prefix:
    """Prefix sums over the ordered operators: the cost of any turn in O(1)."""

    def __init__(self, ordered: Sequence[OperatorSpec]) -> None:
        self.n = len(ordered)
        self.master = [0, *itertools.accumulate(s.master_state_bytes for s in ordered)]
        self.compute = [0, *itertools.accumulate(s.compute_bytes for s in ordered)]
        # Turn [a, b) costs master[b] - master[a] + compute[n] - compute[b]
        #   = reach[b] - master[a] + compute[n], with reach[b] = master[b] - compute[b].
        reach = [m - c for m, c in zip(self.master, self.compute, strict=True)]
        # suffix_min[b] = min(reach[b:]) is non-decreasing in b, so "the last b whose turn
        # fits" is a binary search even when reach itself is not monotone.
        self.suffix_min = list(itertools.accumulate(reversed(reach), min))[::-1]

    def cost(self, start: int, end: int) -> int:
        """Bytes of the snapshot whose turn is ``order[start:end]``."""
        return (self.master[end] - self.master[start]
                + self.compute[self.n] - self.compute[end])

    def furthest_end(self, start: int, budget: float) -> int | None:
        """The largest ``end > start`` whose turn ``[start, end)`` fits ``budget``."""
        limit = budget + self.master[start] - self.compute[self.n]
        end = bisect.bisect_right(self.suffix_min, limit) - 1
        return end if end > start else None


def _greedy_bounds(prefix: _Prefix, budget: float) -> list[int] | None:
    """Turn boundaries ``[0, b1, ..., n]`` of the greedy cut, or ``None`` if nothing fits.

    Rule: each turn, starting where the previous one ended, reaches the furthest end whose
    snapshot fits. Early turns, whose snapshots carry most of the not-yet-captured compute
    weights, therefore hold fewer operators and later turns more.

    Why it is the smallest ``W`` of any cut of the order: turn ``[a, b)`` fits iff
    ``reach[b] <= budget - compute[n] + master[a]``, and the right side grows with ``a``
    (master bytes are >= 0). So a turn that fits from ``a`` also fits from any ``a' >= a``
    as long as it ends after ``a'``. By induction the greedy boundary after ``k`` turns is
    never behind that of any other feasible cut: if ``g_k >= s_k``, the first boundary
    ``s_j > g_k`` of the other cut fits from ``s_{j-1} <= g_k``, hence from ``g_k``, so
    ``g_{k+1} >= s_j >= s_{k+1}``. The greedy cut reaches ``n`` first. The same argument
    shows the turn count never increases when the budget grows.
    """
    bounds = [0]
    while bounds[-1] < prefix.n:
        end = prefix.furthest_end(bounds[-1], budget)
        if end is None:
            return None
        bounds.append(end)
    return bounds


def _min_max_cut(prefix: _Prefix, window: int) -> list[int]:
    """Boundaries of exactly ``window`` turns with the smallest possible largest snapshot:
    the smallest integer budget at which the greedy cut needs at most ``window`` turns,
    then the most crowded turns split in half until there are ``window``. Splitting a turn
    never enlarges a snapshot when each operator's master state is at least its compute
    weights (12 vs 2 or 4 bytes per parameter), so the result is optimal among all cuts
    into ``window`` turns."""
    if window >= prefix.n:  # one operator per turn; turns past the last capture nothing
        return [*range(prefix.n + 1), *[prefix.n] * (window - prefix.n)]
    low, high = 0, prefix.cost(0, prefix.n)  # one turn always fits the whole master state
    while low < high:  # the greedy turn count is non-increasing in the budget
        middle = (low + high) // 2
        bounds = _greedy_bounds(prefix, middle)
        if bounds is not None and len(bounds) - 1 <= window:
            high = middle
        else:
            low = middle + 1
    found = _greedy_bounds(prefix, low)
    assert found is not None  # the initial high fits the one-turn cut
    bounds = found
    while len(bounds) - 1 < window:
        widths = [b - a for a, b in itertools.pairwise(bounds)]
        widest = widths.index(max(widths))  # widths sum to n >= window, so max >= 2
        bounds.insert(widest + 1, bounds[widest] + widths[widest] // 2)
    return bounds


def _schedule(ordered: Sequence[OperatorSpec], bounds: Sequence[int], fits: bool,
              budget: float) -> WindowSchedule:
    names = tuple(spec.name for spec in ordered)
    turns = tuple(names[a:b] for a, b in itertools.pairwise(bounds))
    return WindowSchedule(len(turns), names, turns, fits, float(budget))


def plan_window(specs: Sequence[OperatorSpec], iteration_time_s: float,
                bandwidth_bytes_per_s: float, forced_window: int | None = None,
                headroom: float = 1.0) -> WindowSchedule:
    """The window for ``specs``: the smallest ``W`` whose every snapshot moves within
    ``headroom`` of one iteration (greedy cut of the popularity order), or exactly
    ``forced_window`` turns.

    The budget is ``headroom x iteration_time_s x bandwidth_bytes_per_s``: with a
    headroom below one, no snapshot's copy takes the whole iteration, so the training
    stream's own reads and the optimizer step find the copy engine idle part of the time.
    If no cut fits, one operator per turn with ``fits=False`` (the engine reports stall).
    """
    require(is_number(headroom) and 0 < headroom <= 1,
            f"{fmt('checkpoint.headroom', headroom)} must be a number in (0, 1]: the share "
            "of an iteration a snapshot's copy may take")
    require(iteration_time_s > 0, f"iteration time {iteration_time_s} s must be > 0 "
                                  "(profiled, or set by checkpoint.iteration_time_s)")
    require(bandwidth_bytes_per_s > 0,
            f"device-to-host bandwidth {bandwidth_bytes_per_s} B/s must be > 0 "
            "(profiled, or set by checkpoint.bandwidth_bytes_per_s)")
    if not specs:
        raise ValueError("no operators to schedule")
    by_name = {spec.name: spec for spec in specs}
    ordered = [by_name[name] for name in order_operators(specs)]
    prefix = _Prefix(ordered)
    budget = headroom * iteration_time_s * bandwidth_bytes_per_s
    if forced_window is not None:
        require(isinstance(forced_window, int) and forced_window >= 1,
                f"{fmt('checkpoint.window', forced_window)} must be an integer >= 1")
        bounds = _min_max_cut(prefix, forced_window)
        largest = max(prefix.cost(a, b) for a, b in itertools.pairwise(bounds))
        return _schedule(ordered, bounds, largest <= budget, budget)
    greedy = _greedy_bounds(prefix, budget)
    if greedy is None:
        return _schedule(ordered, range(len(ordered) + 1), False, budget)
    return _schedule(ordered, greedy, True, budget)


def dense_bytes(specs: Iterable[OperatorSpec]) -> int:
    """A dense snapshot: every operator's master state at once."""
    return sum(spec.master_state_bytes for spec in specs)


__all__ = ["OperatorSpec", "WindowSchedule", "dense_bytes", "expert_position",
           "order_operators", "plan_window", "specs_from_registry"]
