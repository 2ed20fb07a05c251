"""Ranks agreeing on one integer: the largest any of them proposes.

The moevement planner agrees on W this way in the background, between window boundaries,
so that every rank's windows start at the same iterations; the dense planners agree on a
measured checkpoint interval ``k`` the same way, in one call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["LargestAcrossRanks"]


class LargestAcrossRanks:
    """The largest of one integer proposed by every rank: an all-reduce MAX over the
    default group, started without waiting (:meth:`start`) and collected later
    (:meth:`result`), or both at once (a call). The moevement planner agrees on W in the
    background with it; the dense planners agree on a measured ``k`` by calling it."""

    def __init__(self) -> None:
        self._last: tuple[torch.Tensor, dist.Work] | None = None  # the tensor reduced in place

    def start(self, value: int) -> None:
        """Propose ``value``; the all-reduce runs in the background."""
        proposal = torch.tensor([value], dtype=torch.int64)
        self._last = proposal, dist.all_reduce(proposal, op=dist.ReduceOp.MAX, async_op=True)

    def result(self) -> int:
        """The largest value of the last proposal (waits until every rank made it)."""
        if self._last is None:
            raise RuntimeError("LargestAcrossRanks.result() before any start()")
        proposal, work = self._last
        work.wait()
        return int(proposal)

    def __call__(self, value: int) -> int:
        self.start(value)
        return self.result()
