"""Routing telemetry of a user's model, from forward hooks on its routers.

Popularity ordering (popular experts captured last) needs per-iteration token counts per
expert. The routers are the modules of the registry's ``gate`` operators; a forward hook
reads each router's output and adds, on the device and without a host sync, the hard
counts (tokens routed to each expert) and soft counts (summed gate probabilities) of its
layer. Built-in parsing covers the common router outputs:

* a tuple holding an integer tensor of selected experts ``[tokens, k]`` and either the
  logits ``[tokens, experts]`` (Hugging Face transformers 5.x MoE routers return
  ``(logits, scores, indices)``) or the selected experts' scores ``[tokens, k]``
  (torchtitan's ``(scores, indices, counts)``);
* a plain logits tensor ``[..., experts]`` (a ``nn.Linear`` router): the top ``top_k``
  experts are the selected ones.

Anything else takes a user parser ``(output) -> (indices [tokens, k], probabilities
[tokens, experts])``. Without routers or a parser the schedule keeps a static order and
``metrics.json`` says so (``routing_telemetry: "static"``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_moe_ckpt.core.operators import expert_position
from lightning_moe_ckpt.core.registry import OperatorRegistry
from lightning_moe_ckpt.errors import ConfigError

RouterParser = Callable[[Any], tuple[torch.Tensor, torch.Tensor]]


def parse_router_output(output: Any, n_experts: int, top_k: int | None
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(selected experts [tokens, k], probabilities [tokens, experts])`` of a router
    output in one of the common shapes, or ``None`` when it has none of them."""
    if isinstance(output, torch.Tensor):
        if output.shape[-1] != n_experts or top_k is None:
            return None
        probs = output.detach().flatten(0, -2).float().softmax(dim=-1)
        return probs.topk(top_k, dim=-1).indices, probs
    if not isinstance(output, tuple | list):
        return None
    indices = next((t for t in output if isinstance(t, torch.Tensor)
                    and not t.is_floating_point() and t.dim() == 2), None)
    dense = next((t for t in output if isinstance(t, torch.Tensor) and t.is_floating_point()
                  and t.dim() >= 2 and t.shape[-1] == n_experts), None)
    if indices is None:
        return None
    if dense is None:  # scores of the selected experts only: count them as probabilities
        # float32 whatever the default dtype (bf16-true sets it to bf16)
        probs = torch.zeros(indices.shape[0], n_experts, dtype=torch.float32,
                            device=indices.device)
        scores = next((t for t in output if isinstance(t, torch.Tensor)
                       and t.is_floating_point() and t.shape == indices.shape), None)
        if scores is not None:
            probs.scatter_add_(1, indices, scores.detach().float())
        return indices, probs
    # A dense [tokens, experts] output is the router's logits (HF returns them first).
    return indices, dense.detach().flatten(0, -2).float().softmax(dim=-1)


class RouterTelemetry:
    """Per-iteration ``[layers, experts]`` hard and soft counts from router hooks."""

    def __init__(self, model: nn.Module, registry: OperatorRegistry, top_k: int | None,
                 parser: RouterParser | None = None,
                 shape: tuple[int, int] | None = None) -> None:
        experts = [p for p in map(expert_position, registry.names) if p is not None]
        self.routers = {op.name: op.layer for op in registry if op.kind == "gate"}
        modules = dict(model.named_modules())
        # ``shape``: the full model's (layers, experts) when ``model`` holds only part of
        # it; its routers still select among every expert (as many as their weights have
        # rows: a rank of a sharded model holds some experts but routes to all).
        self.n_layers, self.n_experts = shape if shape is not None else (
            1 + max((layer for layer, _ in experts), default=-1),
            max([1 + max((e for _, e in experts), default=-1),
                 *(_declared_experts(modules[name]) for name in self.routers
                   if name in modules)]))
        self.top_k = top_k
        self.parser = parser
        self._handles = [modules[name].register_forward_hook(self._hook(layer))
                         for name, layer in self.routers.items()
                         if name in modules and layer is not None]
        self.hard: torch.Tensor | None = None
        self.soft: torch.Tensor | None = None
        self.observed = False  # some router output was understood

    @property
    def active(self) -> bool:
        """Whether there are routers to observe."""
        return bool(self._handles) and self.n_experts > 0

    def _hook(self, layer: int) -> Callable[[nn.Module, Any, Any], None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if not module.training:
                return  # validation and inference forwards route no training tokens
            parsed = (self.parser(output) if self.parser is not None
                      else parse_router_output(output, self.n_experts, self.top_k))
            if parsed is None:
                return
            indices, probs = parsed
            if self.hard is None or self.hard.device != indices.device:
                shape = (self.n_layers, self.n_experts)
                self.hard = torch.zeros(shape, dtype=torch.float32, device=indices.device)
                self.soft = torch.zeros(shape, dtype=torch.float32, device=indices.device)
            assert self.soft is not None
            self.hard[layer] += torch.bincount(indices.flatten(), minlength=self.n_experts)
            self.soft[layer] += probs.sum(dim=0)
            self.observed = True
        return record

    def take(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This iteration's counts (then zeroed for the next one)."""
        hard, soft = self.hard, self.soft
        if hard is None or soft is None:
            return None, None
        taken = hard.clone(), soft.clone()
        hard.zero_()
        soft.zero_()
        return taken

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _declared_experts(router: nn.Module) -> int:
    """The experts a router scores: the rows of its first 2-D weight (0: none)."""
    for name, param in router.named_parameters():
        if name.rpartition(".")[2] == "weight" and param.dim() == 2:
            return int(param.shape[0])  # a sharded weight's global shape
    return 0


def configured_top_k(model: nn.Module, top_k: int | None) -> int | None:
    """``top_k`` as given, or read from a Hugging Face-style config of ``model``."""
    if top_k is not None:
        if not isinstance(top_k, int) or top_k < 1:
            raise ConfigError(f"checkpoint.top_k={top_k!r} must be an integer >= 1")
        return top_k
    for module in model.modules():
        config = getattr(module, "config", None)
        for key in ("num_experts_per_tok", "top_k", "moe_topk"):
            value = getattr(config, key, None)
            if isinstance(value, int):
                return value
    return None
