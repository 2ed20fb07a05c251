"""Operator registry: the units of sparse checkpointing, their byte sizes and active/frozen state.

An operator is each routed expert (``layers.3.moe.experts.17``), each gate
(``layers.3.moe.gate``), the shared experts of a layer (``layers.3.moe.shared_experts``),
the non-expert part of each block (``layers.3.attn``: attention and both norms), the
embedding (``embed``) and the output head with the final norm (``head``). Names are derived
from parameter names, which the model keeps identical in every parallel layout, so the
registry of a pipeline stage or an expert-parallel shard uses the same names as the full
model and simply lists fewer operators.

Freezing an operator sets ``requires_grad=False`` on its parameters: autograd then skips
the weight-gradient GEMMs but still propagates input gradients through it, and the
master-weight optimizer skips parameters without a gradient, leaving master weights,
moments and step counters untouched.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from torch import nn

OperatorKind = Literal["embed", "attn", "gate", "expert", "shared_experts", "head"]

# Master state per parameter element: fp32 master weight, plus AdamW's two fp32 moments.
MASTER_WEIGHT_BYTES = 4
OPTIMIZER_STATE_BYTES = 8

_EXPERT = re.compile(r"^layers\.(\d+)\.moe\.experts\.(\d+)\.")
_GATE = re.compile(r"^layers\.(\d+)\.moe\.gate\.")
_SHARED = re.compile(r"^layers\.(\d+)\.moe\.shared_experts\.")
_BLOCK = re.compile(r"^layers\.(\d+)\.")


def operator_of(param_name: str) -> tuple[str, OperatorKind, int | None, int | None]:
    """Map a parameter FQN to ``(operator name, kind, layer, expert)``."""
    if match := _EXPERT.match(param_name):
        layer, expert = int(match[1]), int(match[2])
        return f"layers.{layer}.moe.experts.{expert}", "expert", layer, expert
    if match := _GATE.match(param_name):
        return f"layers.{match[1]}.moe.gate", "gate", int(match[1]), None
    if match := _SHARED.match(param_name):
        return f"layers.{match[1]}.moe.shared_experts", "shared_experts", int(match[1]), None
    if match := _BLOCK.match(param_name):
        return f"layers.{match[1]}.attn", "attn", int(match[1]), None
    if param_name.startswith("embed."):
        return "embed", "embed", None, None
    if param_name.startswith("head."):
        return "head", "head", None, None
    raise ValueError(f"parameter {param_name!r} belongs to no known operator")


@dataclass(frozen=True)
class OperatorBytes:
    """Byte sizes of one operator's state."""

    compute: int  # weights read by forward/backward (bf16 or fp32)
    master: int  # fp32 master weights
    optimizer: int  # AdamW exp_avg + exp_avg_sq (per-tensor step counters are metadata)

    @property
    def master_state(self) -> int:
        """Master weights plus optimizer state: what a snapshot takes for an active turn."""
        return self.master + self.optimizer


@dataclass(frozen=True)
class Operator:
    """One checkpointable unit and the parameters it owns."""

    name: str
    kind: OperatorKind
    layer: int | None
    expert: int | None
    params: tuple[tuple[str, nn.Parameter], ...]

    @property
    def numel(self) -> int:
        """Number of parameter elements."""
        return sum(p.numel() for _, p in self.params)

    @property
    def nbytes(self) -> OperatorBytes:
        """Exact byte sizes, read from the parameters' real shapes and dtypes."""
        compute = sum(p.numel() * p.element_size() for _, p in self.params)
        return OperatorBytes(compute, self.numel * MASTER_WEIGHT_BYTES,
                             self.numel * OPTIMIZER_STATE_BYTES)


class OperatorRegistry:
    """The operators of a (possibly partial) model in model order, with freeze control."""

    def __init__(self, model: nn.Module) -> None:
        grouped: dict[str, tuple[OperatorKind, int | None, int | None,
                                 list[tuple[str, nn.Parameter]]]] = {}
        for param_name, param in model.named_parameters():
            name, kind, layer, expert = operator_of(param_name)
            grouped.setdefault(name, (kind, layer, expert, []))[3].append((param_name, param))
        self.operators: dict[str, Operator] = {
            name: Operator(name, kind, layer, expert, tuple(params))
            for name, (kind, layer, expert, params) in grouped.items()
        }

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
        for name in names:
            for _, param in self[name].params:
                param.requires_grad_(not frozen)

    def activate_all(self) -> None:
        """Normal training: every operator active."""
        self.set_frozen(self.names, frozen=False)

    def is_frozen(self, name: str) -> bool:
        """Whether the operator's parameters are excluded from weight gradients."""
        return not any(p.requires_grad for _, p in self[name].params)

    def frozen(self) -> list[str]:
        """Names of the frozen operators."""
        return [name for name in self.operators if self.is_frozen(name)]

    def total_bytes(self) -> OperatorBytes:
        """Sum of every operator's byte sizes."""
        sizes = [op.nbytes for op in self.operators.values()]
        return OperatorBytes(sum(s.compute for s in sizes), sum(s.master for s in sizes),
                             sum(s.optimizer for s in sizes))
