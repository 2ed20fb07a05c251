"""The built-in MoE forward and backward read no device value on the host.

On a GPU any such read (a split size, a count, a boolean test of a tensor) waits for the
device stream, and behind it for a snapshot's device-to-host copy. On the CPU there is no
device to wait for, so the test runs the model under a guard that raises wherever a tensor's
value would be read on the host.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from lightning_moe_ckpt.models import MoEModelConfig, MoETransformer

_HOST_READS = {
    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.nonzero,
    torch.nonzero, torch.Tensor.any, torch.Tensor.all, torch.unique, torch.Tensor.unique,
    torch.masked_select, torch.Tensor.masked_select, torch.argwhere,
}


class HostReadGuard(TorchFunctionMode):
    """Raises on every torch call that reads a tensor's value on the host."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in _HOST_READS:
            raise AssertionError(f"host read of a tensor: {getattr(func, '__name__', func)}")
        if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) and \
                (kwargs or {}).get("output_size") is None:
            raise AssertionError("repeat_interleave without output_size reads its counts")
        return func(*args, **(kwargs or {}))


def test_the_guard_catches_a_host_read() -> None:
    with HostReadGuard(), pytest.raises(AssertionError, match="tolist"):
        torch.ones(3).tolist()
    with HostReadGuard(), pytest.raises(AssertionError, match="__bool__"):
        bool(torch.ones(()) > 0)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("n_shared_experts", [0, 1])
def test_the_moe_forward_and_backward_read_nothing_on_the_host(
        capacity_factor: float | None, n_shared_experts: int) -> None:
    torch.manual_seed(0)
    config = MoEModelConfig(n_layers=2, n_experts=8, top_k=2, capacity_factor=capacity_factor,
                            n_shared_experts=n_shared_experts)
    model = MoETransformer(config)
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    with HostReadGuard():
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
