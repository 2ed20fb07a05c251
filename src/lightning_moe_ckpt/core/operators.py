"""Operator registry: the units of sparse checkpointing, their parts and active/frozen state.

An operator is a named set of **parts**; a part is a whole parameter, or one slice of a
parameter along its expert dimension (dim 0 of a fused expert tensor such as
``mlp.experts.gate_up_proj`` of shape ``[E, ...]``). Which parameters (and slices) form
which operator is decided by the discovery rules of
:mod:`~lightning_moe_ckpt.core.discovery` (ModuleList experts, fused experts, routers,
shared experts, embeddings, the output head, the rest of each block) or by a user
override. Names come from parameter names, which stay identical in every parallel layout,
so the registry of a pipeline stage or an expert-parallel shard uses the same names as the
full model and simply lists fewer operators.

Freezing an operator: a whole-parameter part gets ``requires_grad=False`` (autograd skips
its weight-gradient GEMM, still propagates input gradients, and the optimizer skips it); a
slice part is held by :class:`FrozenSlices`, which puts the slice's weights and
optimizer state back after every optimizer step (zero gradients are not enough: AdamW
moves zero-gradient slices through weight decay and its moments). A fused parameter whose
slices are all frozen gets ``requires_grad=False`` too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor

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


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: a sharded parameter's (a DTensor's) local
    shard, a view that shares its storage; any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_like(value: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``value``, a rank's local shard read back from a file, as a DTensor laid out as
    ``reference`` when that is one (and ``value`` is not); otherwise ``value``.

    Args:
        value: The tensor read back.
        reference: The live tensor it belongs to (a parameter or its optimizer state).

    Returns:
        ``value`` in ``reference``'s layout.
    """
    if not isinstance(reference, DTensor) or isinstance(value, DTensor):
        return value
    return DTensor.from_local(value, reference.device_mesh, reference.placements,
                              shape=reference.shape, stride=reference.stride())


@dataclass(frozen=True)
class Part:
    """A whole parameter (``index is None``) or its slice ``index`` along dim 0: the
    ``index``-th row, or with ``chunks`` the ``index``-th of that many equal blocks of
    rows (experts stacked in blocks along dim 0)."""

    param_name: str
    param: nn.Parameter
    index: int | None = None
    chunks: int | None = None

    @property
    def key(self) -> str:
        """Name of the part inside a snapshot (unique per rank)."""
        return self.param_name if self.index is None else f"{self.param_name}[{self.index}]"

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part's part of ``tensor`` (a tensor shaped like the parameter): of its
        local shard when it is sharded, so ``index`` counts the shard's own slices."""
        local = local_tensor(tensor)
        if self.index is None:
            return local
        if self.chunks is not None:
            return local.unflatten(0, (self.chunks, -1))[self.index]
        return local[self.index]

    @property
    def numel(self) -> int:
        """Number of elements of the part on this rank."""
        return self.view(self.param.detach()).numel()

    @property
    def compute_bytes(self) -> int:
        """Bytes of the part's compute weights on this rank (the parameter's dtype)."""
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
    """One checkpointable unit and the parts it owns.

    Args:
        name: The operator's name, derived from parameter names (the same in every
            parallel layout).
        kind: ``"embed"``, ``"attn"``, ``"gate"``, ``"expert"``, ``"shared_experts"``,
            ``"head"`` or ``"other"``.
        layer: The block (layer) index; ``None`` outside the blocks.
        expert: The routed expert's index; ``None`` for any other operator.
        parts: Whole parameters and slices of fused expert parameters it owns.
        buffers: Persistent module buffers, in every snapshot piece of the operator.
    """

    name: str
    kind: OperatorKind
    layer: int | None
    expert: int | None
    parts: tuple[Part, ...]
    buffers: tuple[BufferRef, ...] = ()

    @property
    def params(self) -> tuple[tuple[str, nn.Parameter], ...]:
        """The parameters the operator touches (whole, even where it owns a slice)."""
        seen: dict[str, nn.Parameter] = {}
        for part in self.parts:
            seen.setdefault(part.param_name, part.param)
        return tuple(seen.items())

    @property
    def numel(self) -> int:
        """Number of parameter elements the operator owns."""
        return sum(part.numel for part in self.parts)

    @property
    def nbytes(self) -> OperatorBytes:
        """Compute bytes from the real tensors; master state at the nominal AdamW size
        (the simulator's sizing; the runtime measures the live optimizer instead)."""
        compute = sum(part.compute_bytes for part in self.parts) + self.buffer_bytes
        return OperatorBytes(compute, self.numel * MASTER_WEIGHT_BYTES + self.buffer_bytes,
                             self.numel * OPTIMIZER_STATE_BYTES)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the operator's persistent buffers."""
        return sum(buffer.nbytes for buffer in self.buffers)


OperatorOverride = Mapping[str, str] | Callable[[str, nn.Parameter], "str | None"]
