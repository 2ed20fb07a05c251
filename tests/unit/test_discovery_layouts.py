"""Discovery does not guess: a tensor is cut into experts only when its dim 0 agrees with
the expert count the MoE module's router declares (JetMoE, DBRX), and a vector of the
hidden size under ``experts`` is never cut."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_moe_ckpt.core.optimizer_state import OptimizerStateAccess
from lightning_moe_ckpt.core.registry import OperatorRegistry

HIDDEN, EXPERTS = 32, 4


def _jetmoe() -> nn.Module:
    from transformers import JetMoeConfig, JetMoeForCausalLM

    torch.manual_seed(0)
    return JetMoeForCausalLM(JetMoeConfig(
        vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=2, num_key_value_heads=2,
        kv_channels=8, intermediate_size=32, num_local_experts=EXPERTS, num_experts_per_tok=2,
        max_position_embeddings=64))


def _dbrx() -> nn.Module:
    from transformers import DbrxConfig, DbrxForCausalLM

    torch.manual_seed(0)
    return DbrxForCausalLM(DbrxConfig(
        vocab_size=64, d_model=HIDDEN, n_heads=4, n_layers=2, max_seq_len=64,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 16, "moe_num_experts": EXPERTS, "moe_top_k": 2}))


def _experts_of(registry: OperatorRegistry, prefix: str) -> list[str]:
    return [name for name in registry.names if name.startswith(f"{prefix}.")
            and name.rpartition(".")[2].isdigit()]


def test_jetmoe_gets_one_operator_per_expert_and_its_bias_stays_whole() -> None:
    with pytest.warns(UserWarning, match=r"self_attention\.experts\.bias \(32,\): dim 0 holds "
                                         r"32, its router scores 4 experts"):
        registry = OperatorRegistry(_jetmoe())
    for layer in range(2):
        block = f"model.layers.{layer}"
        mlp = _experts_of(registry, f"{block}.mlp.experts")
        attention = _experts_of(registry, f"{block}.self_attention.experts")
        assert len(mlp) == len(attention) == EXPERTS
        expert = registry[f"{block}.mlp.experts.1"]
        assert sorted(p.key for p in expert.parts) == [
            f"{block}.mlp.input_linear.weight[1]", f"{block}.mlp.output_linear.weight[1]"]
        # The hidden-size vectors are whole, with the rest of the block.
        rest = {p.param_name for p in registry[f"{block}.attn"].parts}
        assert {f"{block}.self_attention.experts.bias", f"{block}.mlp.bias"} <= rest


def test_dbrx_experts_stacked_in_blocks_of_rows_are_one_operator_each() -> None:
    model = _dbrx()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # discovered right: nothing to warn about
        registry = OperatorRegistry(model)
    for layer in range(2):
        prefix = f"transformer.blocks.{layer}.ffn.experts"
        assert len(_experts_of(registry, prefix)) == EXPERTS
        w1 = model.get_parameter(f"{prefix}.mlp.w1")
        part = next(p for p in registry[f"{prefix}.2"].parts if p.param_name.endswith("w1"))
        assert torch.equal(part.view(w1), w1[32:48])  # rows of expert 2 of [4 x 16, 32]


def test_a_frozen_block_of_rows_keeps_weights_and_moments_through_a_step() -> None:
    model = _dbrx()
    registry = OperatorRegistry(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = OptimizerStateAccess(optimizer)
    tokens = torch.randint(0, 64, (2, 8))

    def step() -> None:
        optimizer.zero_grad()
        model(input_ids=tokens, labels=tokens).loss.backward()
        registry.frozen_slices.hold(state.step_tensors, state.state_of)
        optimizer.step()
        registry.frozen_slices.release()

    step()  # moments exist
    w1 = model.get_parameter("transformer.blocks.0.ffn.experts.mlp.w1")
    before = w1.detach().clone()
    moment = optimizer.state[w1]["exp_avg"].clone()
    registry.set_frozen(["transformer.blocks.0.ffn.experts.2"])
    step()
    assert torch.equal(w1[32:48], before[32:48])
    assert torch.equal(optimizer.state[w1]["exp_avg"][32:48], moment[32:48])
    assert not torch.equal(w1[:32], before[:32])  # the active experts moved


def test_a_hidden_size_vector_under_experts_is_not_cut() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
            self.experts = nn.Module()
            self.experts.w = nn.Parameter(torch.zeros(EXPERTS, HIDDEN, 8))
            self.experts.bias = nn.Parameter(torch.zeros(HIDDEN))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, HIDDEN)
            self.layers = nn.ModuleList([Block()])

    with pytest.warns(UserWarning, match=r"layers\.0\.experts\.bias \(32,\): dim 0 holds 32"):
        registry = OperatorRegistry(Model())
    assert len(_experts_of(registry, "layers.0.experts")) == EXPERTS
    assert [p.param_name for p in registry["layers.0.attn"].parts] == ["layers.0.experts.bias"]
