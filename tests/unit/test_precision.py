"""Master-weight AdamW: fp32 stepping, bf16 write-back, FQN-keyed state round trip."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from lightning_moe_ckpt.core.precision import MasterWeightAdamW, parse_precision
from lightning_moe_ckpt.errors import ConfigError


def _named(dtype: torch.dtype) -> list[tuple[str, nn.Parameter]]:
    generator = torch.Generator().manual_seed(0)
    return [("a.weight", nn.Parameter(torch.randn(4, 3, generator=generator).to(dtype))),
            ("a.norm", nn.Parameter(torch.ones(3, dtype=dtype)))]


def _grads(params: list[tuple[str, nn.Parameter]], scale: float) -> None:
    for _, param in params:
        param.grad = torch.full_like(param, scale)


def test_bf16_master_steps_in_fp32_and_writes_back_rounded() -> None:
    params = _named(torch.bfloat16)
    reference = [(n, nn.Parameter(p.detach().float().clone())) for n, p in params]
    optimizer = MasterWeightAdamW(params, "bf16-master", lr=1e-3, weight_decay=0.1)
    plain = torch.optim.AdamW(
        [{"params": [reference[0][1]], "weight_decay": 0.1},
         {"params": [reference[1][1]], "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for step in range(3):
        _grads(params, 0.5 + step)
        _grads(reference, 0.5 + step)
        optimizer.collect_grads(divisor=2)
        for _, param in reference:
            assert param.grad is not None
            param.grad.div_(2)
        optimizer.step()
        plain.step()
        optimizer.zero_grad()
    masters = optimizer.master_weights()
    for (name, param), (_, expected) in zip(params, reference, strict=True):
        assert masters[name].dtype == torch.float32
        assert torch.equal(masters[name], expected.detach())
        assert torch.equal(param.detach(), expected.detach().to(torch.bfloat16))


def test_fp32_mode_masters_are_the_parameters() -> None:
    params = _named(torch.float32)
    optimizer = MasterWeightAdamW(params, "32")
    assert optimizer.master["a.weight"] is params[0][1]


def test_parameter_without_grad_is_untouched() -> None:
    params = _named(torch.bfloat16)
    optimizer = MasterWeightAdamW(params, "bf16-master", weight_decay=0.5)
    before = params[0][1].detach().clone()
    params[1][1].grad = torch.ones_like(params[1][1])
    optimizer.collect_grads()
    optimizer.step()
    assert torch.equal(params[0][1], before)
    assert "a.weight" not in optimizer.optimizer_state()
    assert float(optimizer.optimizer_state()["a.norm"]["step"]) == 1.0


def test_state_dict_round_trip_is_bitwise() -> None:
    params = _named(torch.bfloat16)
    optimizer = MasterWeightAdamW(params, "bf16-master")
    _grads(params, 0.3)
    optimizer.collect_grads()
    optimizer.step()
    saved = optimizer.state_dict()
    assert set(saved["state"]["a.weight"]) == {"exp_avg", "exp_avg_sq", "step", "master"}
    fresh_params = _named(torch.bfloat16)
    restored = MasterWeightAdamW(fresh_params, "bf16-master")
    restored.load_state_dict(saved)
    for name in ("a.weight", "a.norm"):
        assert torch.equal(restored.master_weights()[name], optimizer.master_weights()[name])
        for key, value in optimizer.optimizer_state()[name].items():
            assert torch.equal(restored.optimizer_state()[name][key], value)
    assert torch.equal(fresh_params[0][1], params[0][1])
    with pytest.raises(ConfigError, match=re.escape("trainer.precision='32'")):
        MasterWeightAdamW(_named(torch.float32), "32").load_state_dict(saved)


def test_parse_precision() -> None:
    assert parse_precision(32) == "32"
    assert parse_precision("bf16-master") == "bf16-master"
    with pytest.raises(ConfigError, match=re.escape("trainer.precision='bf16-mixed'")):
        parse_precision("bf16-mixed")
