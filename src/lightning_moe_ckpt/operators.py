"""Operator registry: the units of sparse checkpointing, their pieces and active/frozen state.

An operator is a named set of **pieces**; a piece is a whole parameter, or one slice of a
parameter along its expert dimension (dim 0 of a fused expert tensor such as
``mlp.experts.gate_up_proj`` of shape ``[E, ...]``). Which parameters (and slices) form
which operator is decided by the discovery rules of
:mod:`~lightning_moe_ckpt.operator_discovery` (ModuleList experts, fused experts, routers,
shared experts, embeddings, the output head, the rest of each block) or by a user
override. Names come from parameter names, which stay identical in every parallel layout,
so the registry of a pipeline stage or an expert-parallel shard uses the same names as the
full model and simply lists fewer operators.

Freezing an operator: a whole-parameter piece gets ``requires_grad=False`` (autograd skips
its weight-gradient GEMM, still propagates input gradients, and the optimizer skips it); a
slice piece is held by :class:`FrozenSlices`, which puts the slice's weights and
optimizer state back after every optimizer step (zero gradients are not enough: AdamW
moves zero-gradient slices through weight decay and its moments). A fused parameter whose
slices are all frozen gets ``requires_grad=False`` too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch import nn

OperatorKind = Literal["embed", "attn", "gate", "expert", "shared_experts", "head", "other"]

# Nominal master state per parameter element under AdamW with fp32 masters: 4-byte master
# weight plus two 4-byte moments. The simulator sizes models with it; the runtime schedule
# uses the bytes measured from the live optimizer (OptimizerStateAccess).
MASTER_WEIGHT_BYTES = 4
OPTIMIZER_STATE_BYTES = 8

# The one naming rule for routed experts: ``<...>.<block index>.<...>experts.<expert>``.
# Operators of experts are named this way by every discovery rule.
_EXPERT_OPERATOR = re.compile(r"^(?:[^.]+\.)*?(\d+)\.(?:[^.]+\.)*?experts\.(\d+)$")
# Parameters that belong to routed experts: ModuleList experts (``experts.<i>.``) or fused
# expert tensors owned directly by an ``experts`` module (``experts.<name>``).
_EXPERT_PARAMETER = re.compile(r"(?:^|\.)experts\.(?:\d+\.|[^.]+$)")


def expert_position(operator: str) -> tuple[int, int] | None:
    """``(layer, expert)`` of a routed-expert operator name, ``None`` for any other."""
    match = _EXPERT_OPERATOR.match(operator)
    return (int(match[1]), int(match[2])) if match else None


def is_expert_parameter(param_name: str) -> bool:
    """Whether a parameter holds routed-expert weights (sharded over expert parallelism)."""
    return _EXPERT_PARAMETER.search(param_name) is not None


@dataclass(frozen=True)
class Piece:
    """A whole parameter (``index is None``) or its slice ``index`` along dim 0."""

    param_name: str
    param: nn.Parameter
    index: int | None = None

    @property
    def key(self) -> str:
        """Name of the piece inside a snapshot (unique per rank)."""
        return self.param_name if self.index is None else f"{self.param_name}[{self.index}]"

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The piece's part of ``tensor`` (a tensor shaped like the parameter)."""
        return tensor if self.index is None else tensor[self.index]

    @property
    def numel(self) -> int:
        """Number of elements of the piece."""
        return self.view(self.param).numel()

    @property
    def compute_bytes(self) -> int:
        """Bytes of the piece's compute weights (the parameter's dtype)."""
        return self.numel * self.param.element_size()


@dataclass(frozen=True)
class BufferRef:
    """A persistent module buffer (BatchNorm statistics, a load-balancing bias updated
    outside the optimizer): training state that every snapshot of its operator carries.

    Read through the owning module, so a buffer the model reassigns is still found."""

    name: str  # as in model.named_buffers()
    module: nn.Module
    attr: str

    @property
    def tensor(self) -> torch.Tensor:
        """The live buffer."""
        tensor = self.module._buffers[self.attr]
        assert tensor is not None, self.name  # persistent_buffers() skipped None
        return tensor

    @property
    def snapshot_key(self) -> str:
        """Its name inside a snapshot piece (no parameter key contains a colon)."""
        return f"buffer:{self.name}"

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer."""
        return self.tensor.numel() * self.tensor.element_size()


def persistent_buffers(model: nn.Module) -> list[BufferRef]:
    """The buffers that ``model.state_dict()`` holds, in model order, each once. The
    others (rotary frequencies and the like) are rebuilt by the model itself."""
    found: dict[int, BufferRef] = {}
    for path, module in model.named_modules():
        for attr, tensor in module._buffers.items():
            if tensor is not None and attr not in module._non_persistent_buffers_set:
                name = f"{path}.{attr}" if path else attr
                found.setdefault(id(tensor), BufferRef(name, module, attr))
    return list(found.values())


@dataclass(frozen=True)
class OperatorBytes:
    """Byte sizes of one operator's state."""

    compute: int  # weights read by forward/backward
    master: int  # master weights (fp32 copies, or the parameters themselves)
    optimizer: int  # optimizer state

    @property
    def master_state(self) -> int:
        """Master weights plus optimizer state: what a snapshot takes for an active turn."""
        return self.master + self.optimizer


@dataclass(frozen=True)
class Operator:
    """One checkpointable unit and the pieces it owns."""

    name: str
    kind: OperatorKind
    layer: int | None
    expert: int | None
    pieces: tuple[Piece, ...]
    buffers: tuple[BufferRef, ...] = ()  # in every snapshot piece of the operator

    @property
    def params(self) -> tuple[tuple[str, nn.Parameter], ...]:
        """The parameters the operator touches (whole, even where it owns a slice)."""
        seen: dict[str, nn.Parameter] = {}
        for piece in self.pieces:
            seen.setdefault(piece.param_name, piece.param)
        return tuple(seen.items())

    @property
    def numel(self) -> int:
        """Number of parameter elements the operator owns."""
        return sum(piece.numel for piece in self.pieces)

    @property
    def nbytes(self) -> OperatorBytes:
        """Compute bytes from the real tensors; master state at the nominal AdamW size
        (the simulator's sizing; the runtime measures the live optimizer instead)."""
        compute = sum(piece.compute_bytes for piece in self.pieces) + self.buffer_bytes
        return OperatorBytes(compute, self.numel * MASTER_WEIGHT_BYTES + self.buffer_bytes,
                             self.numel * OPTIMIZER_STATE_BYTES)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the operator's persistent buffers."""
        return sum(buffer.nbytes for buffer in self.buffers)


OperatorOverride = Mapping[str, str] | Callable[[str, nn.Parameter], "str | None"]


class FrozenSlices:
    """Frozen pieces an optimizer step must leave untouched, restored around the step.

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
        self.frozen: dict[int, tuple[nn.Parameter, set[int | None]]] = {}
        self._held: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        self._stateless: list[Callable[[], None]] = []

    def __bool__(self) -> bool:
        return bool(self.frozen)

    def set(self, piece: Piece, frozen: bool) -> None:
        """Freeze (or activate) one piece."""
        param, indices = self.frozen.setdefault(id(piece.param), (piece.param, set()))
        (indices.add if frozen else indices.discard)(piece.index)
        if not indices:
            del self.frozen[id(param)]

    def is_frozen(self, piece: Piece) -> bool:
        """Whether ``piece`` is held frozen here."""
        entry = self.frozen.get(id(piece.param))
        return entry is not None and piece.index in entry[1]

    def all_frozen(self, param: nn.Parameter) -> bool:
        """Whether every slice of a fused ``param`` is frozen."""
        entry = self.frozen.get(id(param))
        return entry is not None and len(entry[1]) == param.shape[0]

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
            index = torch.tensor(sorted(i for i in indices if i is not None),
                                 device=param.device)
            for tensor in tensors_of(param):
                if tensor.shape[:1] == param.shape[:1] and tensor.dim() == param.dim():
                    self._held.append((tensor, index, tensor.index_select(0, index)))

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
    """The operators of a (possibly partial) model in model order, with freeze control."""

    def __init__(self, model: nn.Module, override: OperatorOverride | None = None,
                 freeze_by_restore: bool = False) -> None:
        from lightning_moe_ckpt.operator_discovery import discover_operators, unmatched_patterns

        self.operators: dict[str, Operator] = {
            op.name: op for op in discover_operators(model, override)}
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
            for piece in self[name].pieces:
                if piece.index is None and not self.freeze_by_restore:
                    self._hold(piece.param) if frozen else self._release(piece.param)
                elif piece.index is None:
                    self.frozen_slices.set(piece, frozen)
                else:
                    self.frozen_slices.set(piece, frozen)
                    touched[id(piece.param)] = piece.param
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
        return all(self.frozen_slices.is_frozen(piece)
                   or (piece.index is None and not piece.param.requires_grad)
                   for piece in self[name].pieces)

    def frozen(self) -> list[str]:
        """Names of the frozen operators."""
        return [name for name in self.operators if self.is_frozen(name)]

    def total_bytes(self) -> OperatorBytes:
        """Sum of every operator's nominal byte sizes."""
        sizes = [op.nbytes for op in self.operators.values()]
        return OperatorBytes(sum(s.compute for s in sizes), sum(s.master for s in sizes),
                             sum(s.optimizer for s in sizes))
