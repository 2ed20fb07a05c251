"""Master state of operator parts, read from and written to any torch optimizer.

The master state of a parameter is its master weight (the parameter itself, or the fp32
copy a :class:`~lightning_moe_ckpt.core.precision.MasterWeightOptimizer` keeps) plus every
tensor in ``optimizer.state[master]`` (AdamW/Adam: ``exp_avg``, ``exp_avg_sq``, ``step``;
SGD: ``momentum_buffer``; foreach and fused variants alike). State tensors shaped like the
parameter are sliced with the part; anything else (AdamW's scalar ``step``) is one value
shared by the whole parameter and is stored whole, under ``<part>/<field>/shared``, in
every slice part. Because all slices of a parameter advance together in the run being
reproduced, every slice of one snapshot carries the same shared value, and loading any of
them restores it exactly.

Snapshot tensor names: ``<part key>`` for compute weights, ``<part key>/master`` and
``<part key>/<field>`` for master state. Byte sizes come from the live tensors.

A :class:`StateFingerprint` of some parts tells, without Python work per tensor, whether
the tensors :meth:`OptimizerStateAccess.master_sources` and ``compute_sources`` returned
are still the live ones: the snapshot capture reuses its copy lists while it matches.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_moe_ckpt.core.operators import BufferRef, Part, local_tensor
from lightning_moe_ckpt.core.precision import MasterWeightOptimizer
from lightning_moe_ckpt.errors import ConfigError

_SHARED = "/shared"


class StateFingerprint:
    """Identity of the tensors behind some parts' sources, checked in C-level loops.

    Sources go stale when a parameter's or master's storage is replaced (``.data = ...``),
    when ``optimizer.state`` is replaced (``load_state_dict``), gains or loses an entry
    (the first step, :meth:`OptimizerStateAccess.clear`), or when a state dict or one of
    its tensors is replaced (a restore, an optimizer that does not update in place). Each
    of these changes one of the identities or sizes recorded here. :meth:`matches` costs
    about 0.1 us per tensor (``map`` over builtins, no bytecode per tensor).
    """

    def __init__(self, access: OptimizerStateAccess, parts: Iterable[Part],
                 buffers: Iterable[BufferRef] = ()) -> None:
        self.optimizer = access.optimizer
        self.state = access.optimizer.state
        self.entries = len(self.state)
        bases: dict[int, torch.Tensor] = {}  # parameters and masters (the state's keys)
        for part in parts:
            for tensor in (part.param, access.master(part.param)):
                bases[id(tensor)] = tensor
        # A buffer the model reassigns (module.x = new tensor) is a new object in its
        # module's _buffers.
        held = list(buffers)
        self.buffer_dicts = [buffer.module._buffers for buffer in held]
        self.buffer_attrs = [buffer.attr for buffer in held]
        self.buffer_tensors = [buffer.tensor for buffer in held]
        for tensor in self.buffer_tensors:
            bases[id(tensor)] = tensor
        self.bases = list(bases.values())
        # Storage is read through the local shard of a sharded (DTensor) parameter.
        self.locals = [local_tensor(t) for t in self.bases]
        self.pointers = list(map(torch.Tensor.data_ptr, self.locals))
        self.keys = [t for t in self.bases if t in self.state]
        self.dicts: list[dict[str, Any]] = [self.state[key] for key in self.keys]
        # Every state dict in the optimizer's order: compared by identity without hashing a
        # tensor key (``Tensor.__hash__`` is Python code, 2 us a call), a replaced dict of
        # another rank's or an unrelated parameter only costs a rebuild.
        self.all_dicts = list(self.state.values())
        self.sizes = list(map(len, self.dicts))
        self.owners = [d for d in self.dicts for _ in d]
        self.fields = [f for d in self.dicts for f in d]
        self.values = [v for d in self.dicts for v in d.values()]

    def _live_locals(self) -> list[torch.Tensor]:
        """The bases' local tensors now (a DTensor's may be swapped for a new shard)."""
        if all(map(operator.is_, self.bases, self.locals)):
            return self.locals  # plain tensors: their own storage, read in C
        return [local_tensor(t) for t in self.bases]

    def matches(self) -> bool:
        """Whether every recorded tensor is still the live one."""
        state = self.state
        return (self.optimizer.state is state and len(state) == self.entries
                and list(map(torch.Tensor.data_ptr, self._live_locals())) == self.pointers
                and all(map(operator.is_, map(dict.get, self.buffer_dicts, self.buffer_attrs),
                            self.buffer_tensors))
                and all(map(operator.is_, state.values(), self.all_dicts))
                and list(map(len, self.dicts)) == self.sizes
                and all(map(operator.is_, map(dict.get, self.owners, self.fields),
                            self.values)))


class OptimizerStateAccess:
    """Reads and restores master state of parts in ``optimizer`` (any torch optimizer).

    Args:
        optimizer: The optimizer; a
            :class:`~lightning_moe_ckpt.core.precision.MasterWeightOptimizer` declares its
            master weights, any other steps the parameters themselves.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.masters: dict[int, torch.Tensor] = (
            optimizer.masters_by_param() if isinstance(optimizer, MasterWeightOptimizer) else {})

    def master(self, param: nn.Parameter) -> torch.Tensor:
        """The tensor the optimizer steps for ``param``."""
        return self.masters.get(id(param), param)

    def state_of(self, param: nn.Parameter) -> dict[str, Any] | None:
        """The optimizer's state of ``param`` (``None`` before its first step)."""
        state = self.optimizer.state.get(self.master(param))
        return state if state else None

    def step_tensors(self, param: nn.Parameter) -> list[torch.Tensor]:
        """Every tensor an optimizer step may write for ``param`` (frozen slices are
        saved from these): the parameter, its master copy and its state tensors, each as
        this rank holds it (a sharded one's local shard)."""
        master = self.master(param)
        tensors = [param.data] if master is param else [param.data, master.data]
        state = self.optimizer.state.get(master, {})
        return [local_tensor(t) for t in
                tensors + [v for v in state.values() if isinstance(v, torch.Tensor)]]

    def compute_sources(self, part: Part) -> dict[str, torch.Tensor]:
        """Live compute weights of ``part``."""
        return {part.key: part.view(part.param.detach())}

    def master_sources(self, part: Part) -> dict[str, torch.Tensor]:
        """Live master weight and optimizer state of ``part`` (this rank's shards)."""
        master = self.master(part.param)
        sources = {f"{part.key}/master": part.view(master.detach())}
        for field, value in self.optimizer.state.get(master, {}).items():
            if not isinstance(value, torch.Tensor):
                raise ConfigError(
                    f"{type(self.optimizer).__name__} keeps optimizer.state[...][{field!r}]"
                    f" as {type(value).__name__}; sparse checkpointing needs tensor state")
            if part.index is not None and value.shape == master.shape:
                sources[f"{part.key}/{field}"] = part.view(value)
            elif part.index is not None:
                sources[f"{part.key}/{field}{_SHARED}"] = local_tensor(value)
            else:
                sources[f"{part.key}/{field}"] = local_tensor(value)
        return sources

    def master_state_bytes(self, part: Part) -> int:
        """Bytes of the part's master state as the optimizer holds it now."""
        return sum(t.numel() * t.element_size() for t in self.master_sources(part).values())

    @torch.no_grad()
    def load_compute(self, part: Part, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore the part's compute weights."""
        part.view(part.param.data).copy_(tensors[part.key])

    @torch.no_grad()
    def load_master(self, part: Part, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore the part's master weight (compute weights rounded from it) and its
        optimizer state; a part captured before the optimizer had state clears it."""
        param, master = part.param, self.master(part.param)
        part.view(master.data).copy_(tensors[f"{part.key}/master"])
        if master is not param:
            part.view(param.data).copy_(part.view(master.data))
        prefix = f"{part.key}/"
        fields = {name[len(prefix):]: value for name, value in tensors.items()
                  if name.startswith(prefix) and name != f"{part.key}/master"}
        if not fields:
            self.optimizer.state.pop(master, None)
            return
        state = self.optimizer.state.setdefault(master, {})
        for field, value in fields.items():
            if field.endswith(_SHARED) or part.index is None:
                name = field.removesuffix(_SHARED)
                state[name] = self._placed(master, name, value, state.get(name))
                continue
            if field not in state:  # shaped like the master, sharded like it too
                state[field] = torch.zeros_like(master, dtype=value.dtype)
            part.view(state[field]).copy_(value)

    def _placed(self, master: torch.Tensor, name: str, value: torch.Tensor,
                live: torch.Tensor | None) -> torch.Tensor:
        """``value`` as a new state tensor where the optimizer would have put it (a
        sharded state tensor keeps its sharding: ``value`` is written into its shard)."""
        if isinstance(live, DTensor) or (live is None and isinstance(master, DTensor)
                                         and local_tensor(master).shape == value.shape):
            target = live if live is not None else torch.zeros_like(master, dtype=value.dtype)
            local_tensor(target).copy_(value)
            return target
        if live is not None and live.shape == value.shape and live.dtype == value.dtype:
            return value.to(live.device, copy=True)
        if value.shape == master.shape:
            return value.to(master.device, copy=True)
        # Scalars (AdamW's step) live on the CPU unless the group is fused or capturable.
        group = next((g for g in self.optimizer.param_groups
                      if any(p is master for p in g["params"])), {})
        on_device = bool(group.get("fused")) or bool(group.get("capturable"))
        return value.to(master.device if on_device else "cpu", copy=True)

    @torch.no_grad()
    def clear(self) -> None:
        """Drop every parameter's optimizer state (what a dead worker loses)."""
        self.optimizer.state.clear()
