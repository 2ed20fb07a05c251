"""Per-operator work and state of a model, and its split into pipeline stages.

Parameter counts come from the library's own :class:`MoETransformer` and
:class:`OperatorRegistry`, built on the meta device (no memory). Like the paper's profiler
(Appendix C) a repeated layer is represented by one instance: the model is built with one
layer and that layer's operators are replicated with their real names for every layer.
FLOPs per token follow from the parameter counts (2 per weight per routed token for the
forward GEMM; the input-gradient and weight-gradient GEMMs cost the same again each),
plus the causal attention core, which has no weights and is always recomputed. A frozen
operator skips the weight-gradient GEMM, saving a third of its cost (paper §3.5).
Stages are contiguous layer ranges that minimise the slowest stage (the 1F1B bottleneck).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lightning_moe_ckpt.core.operators import OperatorKind
from lightning_moe_ckpt.core.registry import OperatorRegistry
from lightning_moe_ckpt.models.config import MoEModelConfig
from lightning_moe_ckpt.models.transformer import MoETransformer
from lightning_moe_ckpt.sim.inputs import JobPlan, PrecisionSpec

NON_EXPERT_KINDS: frozenset[str] = frozenset({"embed", "attn", "gate", "shared_experts", "head"})


@dataclass(frozen=True)
class OperatorCost:
    """One checkpointable operator: state bytes (whole operator) and FLOPs per token."""

    name: str
    kind: OperatorKind
    layer: int | None
    numel: int
    compute_bytes: float
    master_state_bytes: float
    forward_flops: float  # per token entering the layer (routed experts weighted by share)
    input_grad_flops: float
    weight_grad_flops: float
    activation: float  # fraction of tokens that use it: its popularity (1 for non-experts)

    @property
    def active_flops(self) -> float:
        """Forward + backward per token for an active operator."""
        return self.forward_flops + self.input_grad_flops + self.weight_grad_flops

    @property
    def frozen_flops(self) -> float:
        """Forward + input gradient only: what a frozen operator costs during replay."""
        return self.forward_flops + self.input_grad_flops

    @property
    def is_expert(self) -> bool:
        return self.kind == "expert"


@dataclass(frozen=True)
class _TemplateOp:
    suffix: str  # name without the "layers.0." prefix (or the full name outside layers)
    kind: OperatorKind
    in_layer: bool
    numel: int
    compute_bytes: int
    master_state_bytes: int


@functools.lru_cache(maxsize=32)
def _template(cfg: MoEModelConfig, dtype: torch.dtype) -> tuple[_TemplateOp, ...]:
    """Operators of a one-layer copy of ``cfg`` built on the meta device, in model order."""
    one_layer = dataclasses.replace(cfg, n_layers=1)
    with torch.device("meta"):
        model = MoETransformer(one_layer)
    model.to(dtype)
    ops = []
    for op in OperatorRegistry(model):
        in_layer = op.layer is not None
        suffix = op.name.removeprefix("layers.0.") if in_layer else op.name
        size = op.nbytes
        ops.append(_TemplateOp(suffix, op.kind, in_layer, op.numel, size.compute,
                               size.master_state))
    return tuple(ops)


def uniform_shares(cfg: MoEModelConfig) -> np.ndarray:
    """Token share of each expert within its layer when routing is balanced."""
    return np.full((cfg.n_layers, cfg.n_experts), 1.0 / cfg.n_experts)


def build_operators(cfg: MoEModelConfig, precision: PrecisionSpec, seq_len: int,
                    shares: np.ndarray | None = None) -> tuple[OperatorCost, ...]:
    """All operators of ``cfg`` in model order with bytes under ``precision``.

    ``shares[l, e]`` is expert ``e``'s share of layer ``l``'s routed assignments (rows sum
    to 1); it sets each expert's FLOPs and popularity. Default: balanced routing.
    """
    shares = uniform_shares(cfg) if shares is None else shares
    if shares.shape != (cfg.n_layers, cfg.n_experts):
        raise ValueError(f"shares has shape {shares.shape}, expected "
                         f"{(cfg.n_layers, cfg.n_experts)}")
    native = precision.native_dtype
    template = _template(cfg, native if native is not None else torch.bfloat16)
    # The causal attention core (QK^T and AV, half the square masked out): 2*S*d FLOPs per
    # token forward, twice that backward, no weights.
    attention_core = 2.0 * seq_len * cfg.d_model

    def make(t: _TemplateOp, name: str, layer: int | None) -> OperatorCost:
        if native is not None:
            compute, master_state = float(t.compute_bytes), float(t.master_state_bytes)
        else:
            compute = t.numel * precision.compute_bytes
            master_state = t.numel * precision.master_state_bytes
        gemm = 2.0 * t.numel
        activation, forward, input_grad, weight_grad = 1.0, gemm, gemm, gemm
        if t.kind == "expert":
            expert = int(name.rsplit(".", 1)[1])
            assert layer is not None
            activation = min(1.0, cfg.top_k * float(shares[layer, expert]))
            forward = input_grad = weight_grad = gemm * cfg.top_k * float(shares[layer, expert])
        elif t.kind == "embed":
            forward = input_grad = weight_grad = 0.0  # a table lookup, no GEMM
        elif t.kind == "attn":
            forward, input_grad = gemm + attention_core, gemm + 2 * attention_core
        return OperatorCost(name, t.kind, layer, t.numel, compute, master_state, forward,
                            input_grad, weight_grad, activation)

    ops: list[OperatorCost] = []
    outside = [t for t in template if not t.in_layer]
    layer_ops = [t for t in template if t.in_layer]
    ops.extend(make(t, t.suffix, None) for t in outside if t.kind == "embed")
    for layer in range(cfg.n_layers):
        ops.extend(make(t, f"layers.{layer}.{t.suffix}", layer) for t in layer_ops)
    ops.extend(make(t, t.suffix, None) for t in outside if t.kind != "embed")
    return tuple(ops)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its operators and the share each of its GPUs holds.

    Every GPU of the stage holds ``1 / (dp * ep)`` of the stage's state: experts are split
    over ``ep`` and, like the non-expert parameters, their master state is sharded over the
    data-parallel replicas (ZeRO-1, as in the paper's DeepSpeed runs).
    """

    index: int
    layers: range
    operators: tuple[OperatorCost, ...]
    ranks: int

    def flops_per_token(self, frozen: frozenset[str] = frozenset()) -> float:
        """Forward + backward FLOPs per token through the stage with ``frozen`` operators."""
        return sum(op.frozen_flops if op.name in frozen else op.active_flops
                   for op in self.operators)

    @functools.cached_property
    def expert_flops_per_token(self) -> float:
        return sum(op.active_flops for op in self.operators if op.is_expert)

    @functools.cached_property
    def master_state_per_gpu(self) -> float:
        return sum(op.master_state_bytes for op in self.operators) / self.ranks

    @functools.cached_property
    def compute_per_gpu(self) -> float:
        return sum(op.compute_bytes for op in self.operators) / self.ranks

    @functools.cached_property
    def expert_master_state(self) -> float:
        """Master state of the stage's routed experts (whole stage, not per GPU)."""
        return sum(op.master_state_bytes for op in self.operators if op.is_expert)

    @functools.cached_property
    def non_expert_master_state(self) -> float:
        return sum(op.master_state_bytes for op in self.operators if not op.is_expert)

    @functools.cached_property
    def params_per_gpu(self) -> float:
        return sum(op.numel for op in self.operators) / self.ranks

    def numel(self, expert: bool) -> int:
        return sum(op.numel for op in self.operators if op.is_expert == expert)


def _balanced_split(costs: Sequence[float], parts: int) -> list[range]:
    """Contiguous split of ``costs`` into ``parts`` non-empty ranges minimising the largest
    sum (linear partition by dynamic programming; layers are few, so O(parts * n^2))."""
    n = len(costs)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for p in range(1, parts + 1):
        for end in range(p, n - (parts - p) + 1):
            for start in range(p - 1, end):
                value = max(best[p - 1][start], prefix[end] - prefix[start])
                if value < best[p][end]:
                    best[p][end], cut[p][end] = value, start
    bounds, end = [], n
    for p in range(parts, 0, -1):
        start = cut[p][end]
        bounds.append(range(start, end))
        end = start
    return bounds[::-1]


def split_stages(operators: Sequence[OperatorCost], plan: JobPlan,
                 n_layers: int) -> tuple[Stage, ...]:
    """Assign layers to ``plan.pp`` stages (embedding on the first, head on the last) so that
    the slowest stage is as fast as possible."""
    by_layer: list[list[OperatorCost]] = [[] for _ in range(n_layers)]
    first = [op for op in operators if op.kind == "embed"]
    last = [op for op in operators if op.kind == "head"]
    for op in operators:
        if op.layer is not None:
            by_layer[op.layer].append(op)
    costs = [sum(op.active_flops for op in layer) for layer in by_layer]
    # The embedding's cost is its state and lookups, not FLOPs; the head's GEMM is heavy.
    costs[0] += sum(op.active_flops for op in first)
    costs[-1] += sum(op.active_flops for op in last)
    stages = []
    for index, layers in enumerate(_balanced_split(costs, plan.pp)):
        ops = [op for layer in layers for op in by_layer[layer]]
        if index == 0:
            ops = first + ops
        if index == plan.pp - 1:
            ops = ops + last
        stages.append(Stage(index, layers, tuple(ops), plan.stage_ranks))
    return tuple(stages)
