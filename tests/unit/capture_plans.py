"""Capture plans for tests that drive the snapshot capture without a planner."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    """The fields of a capture plan the engine, the store and the codec read."""

    iteration: int
    master: tuple[str, ...]
    compute: tuple[str, ...]
    window_start: int
    window_index: int
    window: int
    schedule: dict | None = None


def round_robin(names: tuple[str, ...], step: int, window: int) -> Plan:
    """SS_step of round-robin windows: master state of every ``window``-th operator from
    the window index on, compute weights of the operators whose turn is still to come."""
    start, index = step - step % window, step % window
    return Plan(step, names[index::window],
                tuple(n for i in range(index + 1, window) for n in names[i::window]),
                start, index, window)
