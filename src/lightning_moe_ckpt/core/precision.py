"""Precision modes and the master-weight AdamW optimizer.

Two modes (``trainer.precision``):

* ``32``: fp32 parameters; the compute weights *are* the master weights.
* ``bf16-master``: parameters (the compute weights read by forward/backward) are bf16;
  the optimizer keeps fp32 master weights and fp32 AdamW moments, steps in fp32 and
  writes the rounded bf16 values back. One parameter costs 2 bytes of compute weight
  and 12 bytes of master state (4 master + 8 moments).

Gradients reach the optimizer in two explicit steps so that every parallel layout can
apply the same reductions in the same order: :meth:`MasterWeightAdamW.collect_grads`
moves the accumulated micro-batch gradients into fp32 and divides them by the number of
micro-batches (as ``torch.distributed.pipelining`` does), then the caller syncs/clips
:meth:`MasterWeightAdamW.named_master_grads` and calls :meth:`MasterWeightAdamW.step`.
Parameters whose model gradient is ``None`` (frozen operators) get no master gradient,
so AdamW leaves their weights, moments and step counters untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import nn

from lightning_moe_ckpt.core.operators import local_tensor, shard_like
from lightning_moe_ckpt.errors import ConfigError

Precision = Literal["32", "bf16-master"]
PRECISIONS: tuple[Precision, ...] = ("32", "bf16-master")


def parse_precision(value: object) -> Precision:
    """Validate ``trainer.precision`` (Hydra may hand over the int ``32``).

    Args:
        value: The setting: ``"32"`` (or ``32``) or ``"bf16-master"``.

    Returns:
        The precision as a string.

    Raises:
        ConfigError: Any other value.
    """
    text = str(value)
    if text not in PRECISIONS:
        raise ConfigError(f"trainer.precision={value!r} is not supported; "
                          f"choose one of {', '.join(PRECISIONS)}")
    return text  # membership checked above narrows the Literal


def compute_dtype(precision: Precision) -> torch.dtype:
    """dtype of the compute weights (the model's parameters)."""
    return torch.bfloat16 if precision == "bf16-master" else torch.float32


class MasterWeightOptimizer(torch.optim.Optimizer):
    """An optimizer that steps master copies of the model's parameters.

    Declares where the master weights are, so checkpointing reads and restores them
    instead of the parameters (:class:`~lightning_moe_ckpt.core.optimizer_state.
    OptimizerStateAccess`), and that gradients must reach the masters before a step.
    """

    def masters_by_param(self) -> dict[int, torch.Tensor]:
        """Master tensor of each model parameter, keyed by ``id(param)``."""
        raise NotImplementedError

    def collect_grads(self, divisor: int = 1) -> None:
        """Move model gradients into the master gradients (divided by ``divisor``)."""
        raise NotImplementedError

    def named_master_grads(self) -> dict[str, torch.Tensor]:
        """Gradients the next step applies, by parameter FQN."""
        raise NotImplementedError


class MasterWeightAdamW(MasterWeightOptimizer):
    """AdamW over fp32 master weights, keyed by parameter FQN.

    In ``32`` mode the master weights are the model parameters themselves. In
    ``bf16-master`` mode they are fp32 copies, and fp32 gradient buffers are allocated
    once and reused every iteration.

    Args:
        named_params: The model's ``(FQN, parameter)`` pairs, e.g.
            ``model.named_parameters()``.
        precision: ``"32"`` or ``"bf16-master"``.
        lr: AdamW's learning rate.
        betas: AdamW's betas.
        eps: AdamW's epsilon.
        weight_decay: AdamW's weight decay, applied to matrices (parameters of two or more
            dimensions); vectors such as norm gains do not decay.
    """

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], precision: Precision,
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        self.precision = precision
        self.model_params: dict[str, nn.Parameter] = dict(named_params)
        if precision == "32":
            self.master: dict[str, nn.Parameter] = dict(self.model_params)
        else:
            self.master = {name: nn.Parameter(p.detach().float().clone())
                           for name, p in self.model_params.items()}
        self._grad_buffers: dict[str, torch.Tensor] = {}
        self._collected = False  # step() collects gradients itself when nobody did
        # Matrices decay; vectors (norm gains) do not, as is usual for transformers.
        decay = [m for m in self.master.values() if m.ndim >= 2]
        no_decay = [m for m in self.master.values() if m.ndim < 2]
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        self.inner = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas,
                                       eps=eps, weight_decay=weight_decay, foreach=False)
        self.name_of = {id(m): name for name, m in self.master.items()}
        super().__init__(list(self.master.values()), self.inner.defaults)
        # Share groups and state with the inner AdamW so LR schedulers and Lightning see
        # the live values.
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def masters_by_param(self) -> dict[int, torch.Tensor]:
        """Master tensor of each model parameter, keyed by ``id(param)``."""
        return {id(p): self.master[name] for name, p in self.model_params.items()}

    @torch.no_grad()
    def collect_grads(self, divisor: int = 1) -> None:
        """Move model gradients into the master gradients (fp32) and divide by ``divisor``."""
        self._collected = True
        for name, param in self.model_params.items():
            master = self.master[name]
            if param.grad is None:
                master.grad = None
                continue
            if self.precision == "32":
                grad = param.grad
            else:
                if name not in self._grad_buffers:
                    self._grad_buffers[name] = torch.empty_like(master)
                grad = self._grad_buffers[name]
                grad.copy_(param.grad)
                master.grad = grad
            if divisor != 1:
                grad.div_(divisor)

    def named_master_grads(self) -> dict[str, torch.Tensor]:
        """Gradients the next :meth:`step` applies, by FQN (active parameters only)."""
        return {name: m.grad for name, m in self.master.items() if m.grad is not None}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """AdamW step on the master weights, then write compute weights back."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._collected:  # a plain loop (Lightning's automatic optimization)
            self.collect_grads()
        self._collected = False
        self.inner.step()
        if self.precision != "32":
            stepped = [(self.model_params[n], m) for n, m in self.master.items()
                       if m.grad is not None]
            if stepped:  # a sharded parameter's shard from its master's
                torch._foreach_copy_([local_tensor(p) for p, _ in stepped],
                                     [local_tensor(m) for _, m in stepped])
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop model and master gradients (buffers are kept for reuse)."""
        for name, param in self.model_params.items():
            param.grad = None
            self.master[name].grad = None

    def master_weights(self) -> dict[str, torch.Tensor]:
        """fp32 master weights by parameter FQN."""
        return {name: m.detach() for name, m in self.master.items()}

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``) by parameter FQN."""
        return {name: dict(self.inner.state[m]) for name, m in self.master.items()
                if m in self.inner.state}

    def state_dict(self) -> dict[str, Any]:
        """FQN-keyed state: moments and step (plus fp32 master weights in bf16-master)."""
        state: dict[str, dict[str, torch.Tensor]] = self.optimizer_state()
        if self.precision != "32":
            for name, m in self.master.items():
                state.setdefault(name, {})["master"] = m.detach()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"precision": self.precision, "state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`; compute weights are refreshed from the masters."""
        if state_dict["precision"] != self.precision:
            raise ConfigError(f"checkpoint has trainer.precision={state_dict['precision']!r} "
                              f"but this run uses trainer.precision={self.precision!r}")
        unknown = sorted(set(state_dict["state"]) - set(self.master))
        if unknown:
            raise KeyError(f"optimizer state for unknown parameters: {unknown[:5]}")
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update(saved)
        self.inner.state.clear()
        for name, entries in state_dict["state"].items():
            master = self.master[name]
            # A sharded model's durable checkpoint holds each rank's local shards.
            moments = {k: shard_like(v.clone(), master) if v.dim() else v.clone()
                       for k, v in entries.items() if k != "master"}
            if moments:
                self.inner.state[master] = moments
            if "master" in entries:
                saved = local_tensor(shard_like(entries["master"], master))
                local_tensor(master).copy_(saved)
                local_tensor(self.model_params[name]).copy_(saved)
