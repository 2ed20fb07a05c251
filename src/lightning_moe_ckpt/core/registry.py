"""The operator registry: a model's operators in model order, and their freeze control.

:class:`OperatorRegistry` discovers a model's operators (:mod:`.discovery`) and freezes or
activates them: a whole parameter by ``requires_grad``, a slice of a fused expert tensor
by :class:`FrozenSlices` (saved before the optimizer step and put back after it, weights
and optimizer state, since zero gradients are not enough under AdamW).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_moe_ckpt.core.discovery import discover_operators, unmatched_patterns
from lightning_moe_ckpt.core.operators import (
    Operator,
    OperatorBytes,
    OperatorOverride,
    Part,
    local_tensor,
)


class FrozenSlices:
    """Frozen parts an optimizer step must leave untouched, restored around the step.

    Slices of fused parameters are always frozen this way; whole parameters only when
    the registry freezes by restore (``requires_grad`` cannot change under DDP, whose
    reducer expects a gradient for every parameter it registered). :meth:`hold` (right
    before the optimizer step) saves the frozen part of every tensor the step may write:
    the parameter, its master copy and every optimizer-state tensor shaped like it, and,
    for whole parameters, the shared scalars too (or that there was no state);
    :meth:`release` (right after) writes them back. A slice's shared scalars (AdamW's
    ``step``) are one value per parameter: they advance with the active slices, which is
    exactly what the uninterrupted run did.
    """

    def __init__(self) -> None:
        # Per parameter: its frozen slice indices (None: the whole parameter) and, for
        # experts stacked in blocks of rows, the number of blocks.
        self.frozen: dict[int, tuple[nn.Parameter, set[int | None]]] = {}
        self.chunks: dict[int, int] = {}
        self._held: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        self._stateless: list[Callable[[], None]] = []

    def __bool__(self) -> bool:
        return bool(self.frozen)

    def set(self, part: Part, frozen: bool) -> None:
        """Freeze (or activate) one part."""
        param, indices = self.frozen.setdefault(id(part.param), (part.param, set()))
        (indices.add if frozen else indices.discard)(part.index)
        if part.chunks is not None:
            self.chunks[id(param)] = part.chunks
        if not indices:
            del self.frozen[id(param)]

    def is_frozen(self, part: Part) -> bool:
        """Whether ``part`` is held frozen here."""
        entry = self.frozen.get(id(part.param))
        return entry is not None and part.index in entry[1]

    def all_frozen(self, param: nn.Parameter) -> bool:
        """Whether every slice this rank holds of a fused ``param`` is frozen."""
        entry = self.frozen.get(id(param))
        slices = self.chunks.get(id(param), local_tensor(param).shape[0])
        return entry is not None and len(entry[1]) == slices

    @torch.no_grad()
    def hold(self, tensors_of: Callable[[nn.Parameter], list[torch.Tensor]],
             state_of: Callable[[nn.Parameter], dict[str, Any] | None]) -> None:
        """Save the frozen parts of ``tensors_of(param)`` (the tensors a step writes);
        ``state_of(param)`` is the parameter's optimizer state (``None``: none yet)."""
        self._held, self._stateless = [], []
        for param, indices in self.frozen.values():
            if not param.requires_grad:
                continue  # the optimizer skips the whole parameter
            if None in indices:  # a whole parameter frozen by restore
                for tensor in tensors_of(param):
                    self._held.append((tensor, None, tensor.clone()))
                if state_of(param) is None:
                    self._stateless.append(partial(_drop_state, state_of, param))
                continue
            held = local_tensor(param)  # this rank's shard of a sharded parameter
            index = torch.tensor(sorted(i for i in indices if i is not None),
                                 device=held.device)
            chunks = self.chunks.get(id(param))
            for tensor in tensors_of(param):  # local tensors
                if tensor.shape[:1] == held.shape[:1] and tensor.dim() == held.dim():
                    rows = tensor if chunks is None else tensor.unflatten(0, (chunks, -1))
                    self._held.append((rows, index, rows.index_select(0, index)))

    @torch.no_grad()
    def release(self) -> None:
        """Put the held parts back."""
        for tensor, index, saved in self._held:
            if index is None:
                tensor.copy_(saved)
            else:
                tensor.index_copy_(0, index, saved)
        for drop in self._stateless:
            drop()
        self._held, self._stateless = [], []


def _drop_state(state_of: Callable[[nn.Parameter], dict[str, Any] | None],
                param: nn.Parameter) -> None:
    state = state_of(param)
    if state is not None:
        state.clear()


class OperatorRegistry:
    """The operators of a (possibly partial) model in model order, with freeze control.

    Args:
        model: The model, whole or one rank's part.
        override: Operator discovery's override (see :func:`discover_operators`);
            ``None``: the built-in rules alone.
        freeze_by_restore: Freeze whole parameters too by restoring them around the step
            (:class:`FrozenSlices`) instead of through ``requires_grad``, which cannot
            change under DDP.
    """

    def __init__(self, model: nn.Module, override: OperatorOverride | None = None,
                 freeze_by_restore: bool = False) -> None:
        self.operators: dict[str, Operator] = {
            op.name: op for op in discover_operators(model, override)}
        # A sharded parameter's requires_grad cannot change under FSDP2 (its unsharded
        # parameter keeps the value it was set up with): freeze by restore there too.
        freeze_by_restore = freeze_by_restore or any(
            isinstance(p, DTensor) for p in model.parameters())
        # Patterns of a mapping override that claim nothing here: an error on a whole model,
        # legitimate on a pipeline stage (the checkpointing callback decides).
        self.unmatched_patterns = unmatched_patterns(model, override)
        self.frozen_slices = FrozenSlices()
        # requires_grad of the parameters set_frozen froze, as the user had it: activating
        # them gives it back instead of making every parameter trainable.
        self._user_requires_grad: dict[int, bool] = {}
        # Whole parameters too are frozen by restoring them around the step (DDP).
        self.freeze_by_restore = freeze_by_restore

    def __len__(self) -> int:
        return len(self.operators)

    def __iter__(self) -> Iterator[Operator]:
        return iter(self.operators.values())

    def __contains__(self, name: object) -> bool:
        return name in self.operators

    def __getitem__(self, name: str) -> Operator:
        try:
            return self.operators[name]
        except KeyError:
            raise KeyError(f"no operator named {name!r} in this model "
                           f"({len(self.operators)} operators)") from None

    @property
    def names(self) -> list[str]:
        """Operator names in model order."""
        return list(self.operators)

    def set_frozen(self, names: Iterable[str], frozen: bool = True) -> None:
        """Freeze (or activate) the named operators."""
        if isinstance(names, str):  # would be read letter by letter
            raise TypeError(f"set_frozen takes operator names, not the one string {names!r}; "
                            f"pass [{names!r}]")
        touched: dict[int, nn.Parameter] = {}
        for name in names:
            for part in self[name].parts:
                if part.index is None and not self.freeze_by_restore:
                    self._hold(part.param) if frozen else self._release(part.param)
                elif part.index is None:
                    self.frozen_slices.set(part, frozen)
                else:
                    self.frozen_slices.set(part, frozen)
                    touched[id(part.param)] = part.param
        if self.freeze_by_restore:
            return  # requires_grad stays: every parameter keeps its gradient
        for param in touched.values():  # a fused tensor computes while any slice is active
            if self.frozen_slices.all_frozen(param):
                self._hold(param)
            else:
                self._release(param)

    def _hold(self, param: nn.Parameter) -> None:
        """Stop ``param``'s gradient, remembering the user's own ``requires_grad``."""
        self._user_requires_grad.setdefault(id(param), param.requires_grad)
        param.requires_grad_(False)

    def _release(self, param: nn.Parameter) -> None:
        """Give back the ``requires_grad`` the user had before :meth:`_hold` (a parameter
        the user froze stays frozen; one never held here is left as it is)."""
        held = self._user_requires_grad.pop(id(param), None)
        if held is not None:
            param.requires_grad_(held)

    def activate_all(self) -> None:
        """Normal training: every operator active."""
        self.set_frozen(self.names, frozen=False)

    def is_frozen(self, name: str) -> bool:
        """Whether the operator takes no optimizer update."""
        return all(self.frozen_slices.is_frozen(part)
                   or (part.index is None and not part.param.requires_grad)
                   for part in self[name].parts)

    def frozen(self) -> list[str]:
        """Names of the frozen operators."""
        return [name for name in self.operators if self.is_frozen(name)]

    def total_bytes(self) -> OperatorBytes:
        """Sum of every operator's nominal byte sizes."""
        sizes = [op.nbytes for op in self.operators.values()]
        return OperatorBytes(sum(s.compute for s in sizes), sum(s.master for s in sizes),
                             sum(s.optimizer for s in sizes))
