"""Expert popularity for ordering the sparse schedule: the four schemes of paper Appendix B.

A :class:`PopularityTracker` accumulates the routers' per-iteration counters (``[layers,
experts]`` tensors of hard counts: tokens routed to each expert, and soft counts: summed
gate probabilities) on their own device, with no host sync per iteration. A planner reads
them once per window: :meth:`PopularityTracker.publish` starts their host copy one
iteration before the boundary, and :meth:`PopularityTracker.published_frequency_matrix`
reads it there without waiting on the device (:meth:`PopularityTracker.frequencies` is
the blocking read, for reports).
Frequencies are in ``[0, 1]`` and keyed by operator name ``layers.{l}.moe.experts.{e}``:

* ``hard``: share of tokens that activate the expert, ``top_k x count / sum(counts)``,
  over every iteration seen (the paper's activation count over the data);
* ``soft``: the expert's share of the gate probability mass, likewise cumulative;
* ``ema``: hard counts under an exponential moving average ``A_t = alpha A_{t-1} +
  (1 - alpha) count_t`` (normalised by the same average of the layer's total, which cancels
  the start-up bias), so popularity can follow routing drift;
* ``capacity``: hard frequency divided by the expert's capacity factor, rescaled by the
  smallest factor so it stays in ``[0, 1]`` (experts with spare capacity rank earlier).

:func:`should_reorder` is the paper's stability rule: reorder only when at least
``fraction_threshold`` of the experts moved by more than ``change_threshold`` (relative).
:class:`HostMirror` is the one-iteration-late host copy the partial-expert planners use to
make per-iteration choices from device counters without a sync.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any, Literal, cast

import numpy as np
import torch

from lightning_moe_ckpt.errors import fmt, is_number, require

PopularityScheme = Literal["hard", "soft", "ema", "capacity"]
SCHEMES: tuple[PopularityScheme, ...] = ("hard", "soft", "ema", "capacity")


def expert_name(layer: int, expert: int) -> str:
    """Operator name of routed expert ``expert`` of layer ``layer``."""
    return f"layers.{layer}.moe.experts.{expert}"


def _check_counts(counts: torch.Tensor, shape: tuple[int, int], what: str) -> None:
    if tuple(counts.shape) != shape:
        raise ValueError(f"{what} has shape {tuple(counts.shape)}, expected [layers, experts] "
                         f"= {list(shape)}")


class PopularityTracker:
    """Per-expert activation frequencies from routing telemetry (device-side accumulation)."""

    def __init__(self, n_layers: int, n_experts: int, top_k: int = 1,
                 scheme: str = "hard", alpha: float = 0.9,
                 capacity_factors: Sequence[Sequence[float]] | torch.Tensor | None = None,
                 layer_ids: Sequence[int] | None = None) -> None:
        require(scheme in SCHEMES, f"{fmt('checkpoint.popularity', scheme)} is not one of "
                                   f"{', '.join(SCHEMES)}")
        require(is_number(alpha) and 0.0 <= alpha < 1.0,
                f"{fmt('checkpoint.ema_alpha', alpha)} must be a number in [0, 1)")
        require(1 <= top_k <= n_experts,
                f"model.top_k={top_k} must be in [1, model.n_experts={n_experts}]")
        self.scheme = cast(PopularityScheme, scheme)
        self.alpha = float(alpha)
        self.top_k = top_k
        self.shape = (n_layers, n_experts)
        self.layer_ids = list(layer_ids) if layer_ids is not None else list(range(n_layers))
        if len(self.layer_ids) != n_layers:
            raise ValueError(f"{len(self.layer_ids)} layer ids for {n_layers} layers")
        capacity = torch.ones(self.shape, dtype=torch.float64) if capacity_factors is None \
            else torch.as_tensor(capacity_factors, dtype=torch.float64)
        _check_counts(capacity, self.shape, "capacity_factors")
        require(bool((capacity > 0).all()), "every expert capacity factor must be > 0 "
                                            "(model.capacity_factor / capacity_factors)")
        # Score A / C rescaled by min(C): same order as the paper's A / C, values <= 1.
        self._capacity_scale = capacity.min() / capacity
        self._counts: torch.Tensor | None = None  # cumulative hard, soft, or EMA of hard
        self.iterations = 0
        self._published = HostMirror()  # the counters at the last publish, on their way
        self._unread = False  # whether that publication is still to be read

    def update(self, hard_counts: torch.Tensor, soft_counts: torch.Tensor | None = None) -> None:
        """Add one iteration's counters (device tensors; nothing leaves the device)."""
        counts = soft_counts if self.scheme == "soft" else hard_counts
        if counts is None:
            raise ValueError("the soft popularity scheme needs soft_counts")
        _check_counts(counts, self.shape, f"{self.scheme} counts")
        counts = counts.detach().to(torch.float64)
        if self._counts is None:
            self._counts = torch.zeros_like(counts)
        elif self._counts.device != counts.device:  # restored from a checkpoint elsewhere
            self._counts = self._counts.to(counts.device)
        if self.scheme == "ema":
            self._counts.mul_(self.alpha).add_(counts, alpha=1.0 - self.alpha)
        else:
            self._counts.add_(counts)
        self.iterations += 1

    @cached_property
    def names(self) -> tuple[str, ...]:
        """Expert operator names in the row-major order of :meth:`frequency_matrix`."""
        return tuple(expert_name(layer, expert) for layer in self.layer_ids
                     for expert in range(self.shape[1]))

    def frequency_matrix(self) -> np.ndarray:
        """Activation frequency per ``[layer, expert]`` in ``[0, 1]`` (float64; one host
        copy that waits for the device). All zeros before any routed token."""
        return self._shares(None if self._counts is None else self._counts.cpu().numpy())

    def publish(self) -> None:
        """Start copying the counters to the host (non-blocking on a GPU), for
        :meth:`published_frequency_matrix` to read an iteration or more later."""
        if self._counts is not None:
            self._published.publish(self._counts)
            self._unread = True

    def published_frequency_matrix(self) -> np.ndarray | None:
        """:meth:`frequency_matrix` of the counters as of the last :meth:`publish`, or
        ``None`` if nothing was published since the last read (each publication is read
        once). Published an iteration earlier, the copy has long finished: a blocking
        ``.cpu()`` here would instead drain the device's queue and wait behind the
        snapshot copies on the copy engine, once per window."""
        if not self._unread:
            return None
        self._unread = False
        counts = self._published.read()
        assert counts is not None  # published
        return self._shares(counts.numpy())

    def discard_published(self) -> None:
        """Drop a publication not yet read (a recovery rolled back the iterations it
        counted)."""
        self._unread = False

    def _shares(self, counts: np.ndarray | None) -> np.ndarray:
        """Frequencies from host counters (NumPy: on a few thousand values its operations
        cost a fraction of torch's dispatch)."""
        if counts is None:
            counts = np.zeros(self.shape, dtype=np.float64)
        total = counts.sum(axis=1, keepdims=True)
        share = np.divide(counts, total, out=np.zeros_like(counts), where=total > 0)
        if self.scheme != "soft":  # each token activates top_k experts
            share *= self.top_k
        if self.scheme == "capacity":
            share *= self._capacity_scale.numpy()
        return np.clip(share, 0.0, 1.0)

    def frequencies(self) -> dict[str, float]:
        """:meth:`frequency_matrix` by expert operator name."""
        return dict(zip(self.names, self.frequency_matrix().reshape(-1).tolist(), strict=True))

    def reset(self) -> None:
        """Forget everything observed."""
        self._counts, self.iterations = None, 0
        self._unread = False

    def state_dict(self) -> dict[str, Any]:
        """Counters stay on their device (a clone, no host sync); ``torch.save`` copes."""
        counts = None if self._counts is None else self._counts.detach().clone()
        return {"scheme": self.scheme, "alpha": self.alpha, "iterations": self.iterations,
                "counts": counts}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore counters saved by :meth:`state_dict` of a tracker with the same scheme."""
        if state["scheme"] != self.scheme:
            raise ValueError(f"popularity state of scheme {state['scheme']!r} cannot be loaded "
                             f"into a {self.scheme!r} tracker")
        counts = state["counts"]
        self._counts = None if counts is None else counts.detach().clone().to(torch.float64)
        self.iterations = int(state["iterations"])
        self._unread = False


def check_reorder_thresholds(change_threshold: float, fraction_threshold: float) -> None:
    """Raise :class:`~lightning_moe_ckpt.errors.ConfigError` for unusable thresholds."""
    require(is_number(change_threshold) and change_threshold >= 0,
            f"{fmt('checkpoint.reorder_change_threshold', change_threshold)} must be a "
            "number >= 0")
    require(is_number(fraction_threshold) and 0 < fraction_threshold <= 1,
            f"{fmt('checkpoint.reorder_fraction_threshold', fraction_threshold)} "
            "must be in (0, 1]")


def should_reorder(previous: Mapping[str, float], current: Mapping[str, float],
                   change_threshold: float = 0.10, fraction_threshold: float = 0.25) -> bool:
    """Whether frequencies moved by more than ``change_threshold`` (relative to
    ``previous``) for at least ``fraction_threshold`` of the experts both know.

    An expert that had frequency 0 changed iff it has a non-zero one now.
    """
    names = [name for name in current if name in previous]
    return frequencies_moved(np.array([previous[n] for n in names], dtype=np.float64),
                             np.array([current[n] for n in names], dtype=np.float64),
                             change_threshold, fraction_threshold)


def frequencies_moved(previous: np.ndarray, current: np.ndarray,
                      change_threshold: float = 0.10, fraction_threshold: float = 0.25) -> bool:
    """:func:`should_reorder` over aligned frequency vectors: a few array operations,
    whatever the number of experts (it runs at every window boundary)."""
    check_reorder_thresholds(change_threshold, fraction_threshold)
    if previous.size == 0:
        return False
    was_zero = previous == 0
    relative = np.abs(current - previous) / np.where(was_zero, 1.0, np.abs(previous))
    moved = np.where(was_zero, current != 0, relative > change_threshold)
    return int(moved.sum()) >= fraction_threshold * previous.size


class HostMirror:
    """Host copy of a device tensor that is read one publication late, without a sync.

    :meth:`publish` issues a non-blocking copy into a host buffer (pinned on CUDA) and
    records an event; :meth:`read` returns the previously published values, waiting on
    that event. Published after optimizer step ``t`` and read after step ``t+1``, the copy
    finished long ago (the device has since run iteration ``t+1``), so the wait is free in
    practice and the host never stalls the device's run-ahead at publication time.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._event: Any = None

    def publish(self, tensor: torch.Tensor) -> None:
        """Start copying ``tensor``'s current values to the host."""
        tensor = tensor.detach()
        if self._buffer is None or self._buffer.shape != tensor.shape \
                or self._buffer.dtype != tensor.dtype:
            self._buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                                       pin_memory=tensor.is_cuda)
        self._buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        self._event = None
        if tensor.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def read(self) -> torch.Tensor | None:
        """The values of the last :meth:`publish` (a host copy), or ``None`` if none yet."""
        if self._buffer is None:
            return None
        if self._event is not None:
            self._event.synchronize()
        return self._buffer.clone()

    def clear(self) -> None:
        """Forget the published values."""
        self._buffer, self._event = None, None
