"""MoE transformer: routing, load-balancing loss, capacity, shared experts, presets."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from lightning_moe_ckpt.core.registry import OperatorRegistry
from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.models import MoELayer, MoEModelConfig, MoETransformer
from tests.conftest import CONF_DIR


def test_forward_shapes_and_router_counters(tiny_cfg: MoEModelConfig) -> None:
    model = MoETransformer(tiny_cfg, seed=0)
    tokens = torch.randint(0, 256, (3, 16))
    logits = model(tokens)
    assert logits.shape == (3, 16, 256)
    load = model.expert_load()
    assert load.shape == (tiny_cfg.n_layers, tiny_cfg.n_experts)
    # Every token is routed to top_k experts in every layer.
    assert torch.equal(load.sum(dim=1), torch.full((tiny_cfg.n_layers,), 3.0 * 16 * 2))
    soft = model.layers["0"].moe.gate.soft_counts
    assert torch.allclose(soft.sum(), torch.tensor(3.0 * 16))
    model.reset_stats()
    assert model.expert_load().sum() == 0


def test_layer_equals_dense_reference() -> None:
    """Sort-based dispatch computes sum_k w_k * expert_k(x) for every token."""
    torch.manual_seed(0)
    layer = MoELayer(d_model=8, n_experts=4, top_k=2, expert_hidden=16)
    x = torch.randn(2, 5, 8)
    out = layer(x)
    route = layer.gate(x)
    expected = torch.zeros_like(x)
    for b in range(2):
        for s in range(5):
            for j in range(2):
                expert = layer.experts[str(int(route.indices[b, s, j]))]
                expected[b, s] += route.weights[b, s, j] * expert(x[b, s])
    torch.testing.assert_close(out, expected)


def test_aux_loss_is_mean_of_per_sequence_terms() -> None:
    """The sequence-wise balance loss decomposes exactly over batch splits."""
    torch.manual_seed(1)
    layer = MoELayer(d_model=8, n_experts=4, top_k=2, expert_hidden=16, aux_loss_coef=0.1)
    x = torch.randn(4, 6, 8)
    whole = layer.gate(x).aux_loss
    halves = (layer.gate(x[:2]).aux_loss + layer.gate(x[2:]).aux_loss) / 2
    torch.testing.assert_close(whole, halves)
    assert whole > 0


def test_aux_loss_gradient_reaches_gate() -> None:
    torch.manual_seed(2)
    with_aux = MoELayer(d_model=8, n_experts=4, top_k=2, expert_hidden=16, aux_loss_coef=1.0)
    without = MoELayer(d_model=8, n_experts=4, top_k=2, expert_hidden=16, aux_loss_coef=0.0)
    without.load_state_dict(with_aux.state_dict())
    x = torch.randn(2, 6, 8)
    with_aux(x).sum().backward()
    without(x).sum().backward()
    gate_with = with_aux.gate.proj.weight.grad
    gate_without = without.gate.proj.weight.grad
    assert gate_with is not None and gate_without is not None
    assert not torch.equal(gate_with, gate_without)


def test_capacity_drops_tokens_per_sequence() -> None:
    torch.manual_seed(3)
    layer = MoELayer(d_model=8, n_experts=4, top_k=1, expert_hidden=16, capacity_factor=0.5)
    with torch.no_grad():  # route every token to expert 0
        layer.gate.proj.weight.zero_()
        layer.gate.proj.weight[0] = 1.0
    x = torch.rand(2, 8, 8) + 0.1
    out = layer(x)
    capacity = layer.capacity(8)
    assert capacity == math.ceil(0.5 * 8 * 1 / 4) == 1
    # Only the first token of each sequence fits; the rest pass through (zero output).
    assert torch.count_nonzero(out.abs().sum(-1)) == 2
    assert out[:, 0].abs().sum() > 0
    assert int(layer.dropped_assignments) == 2 * (8 - capacity)


def test_shared_experts_are_an_operator() -> None:
    cfg = MoEModelConfig(n_shared_experts=2, max_seq_len=16)
    model = MoETransformer(cfg)
    registry = OperatorRegistry(model)
    shared = registry["layers.0.moe.shared_experts"]
    assert shared.kind == "shared_experts"
    assert shared.numel == 3 * cfg.d_model * cfg.expert_hidden * 2


def test_initialisation_is_per_parameter_and_layout_independent(tiny_cfg: MoEModelConfig) -> None:
    full = MoETransformer(tiny_cfg, seed=5)
    partial = MoETransformer(tiny_cfg, seed=5)
    del partial.layers["0"]
    partial.embed = None
    full_params = dict(full.named_parameters())
    for name, param in partial.named_parameters():
        assert torch.equal(param, full_params[name]), name
    other_seed = MoETransformer(tiny_cfg, seed=6)
    assert not torch.equal(other_seed.layers["1"].attn.wq.weight, full.layers["1"].attn.wq.weight)


def test_initialisation_ignores_the_default_device(tiny_cfg: MoEModelConfig) -> None:
    """The Trainer builds the model under ``init_module()``, whose default device is the
    GPU: the draws still come from the CPU generator (on a CPU-only build a GPU draw
    fails too), so the weights equal a model built without that context."""
    expected = MoETransformer(tiny_cfg, seed=5)
    model = MoETransformer(tiny_cfg, seed=0)
    with torch.device("cuda"):
        model.init_weights(5)
    for (name, param), reference in zip(model.named_parameters(), expected.parameters(),
                                        strict=True):
        assert torch.equal(param, reference), name


PAPER_TOTALS = {"gpt_moe": 7.3e9, "qwen_moe": 14.3e9, "deepseek_moe": 16.4e9, "moe_llava": 2.9e9}


@pytest.mark.parametrize("preset", sorted(PAPER_TOTALS))
def test_paper_presets_match_table_2(preset: str) -> None:
    values = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{preset}.yaml"))
    assert isinstance(values, dict)
    cfg = MoEModelConfig.from_mapping({str(k): v for k, v in values.items()})
    with torch.device("meta"):
        model = MoETransformer(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert abs(total - PAPER_TOTALS[preset]) / PAPER_TOTALS[preset] < 0.02, total
    registry = OperatorRegistry(model)
    experts = [op for op in registry if op.kind == "expert"]
    assert len(experts) == cfg.n_layers * cfg.n_experts


@pytest.mark.parametrize(("override", "needle"), [
    ({"top_k": 9}, "model.top_k=9 must be <= model.n_experts=8"),
    ({"capacity_factor": 0.0}, "model.capacity_factor=0.0 must be > 0"),
    ({"capacity_factor": -1.5}, "model.capacity_factor=-1.5"),
    ({"n_heads": 5}, "model.d_model=64 must be divisible by model.n_heads=5"),
    ({"n_experts": 0}, "model.n_experts=0"),
])
def test_bad_model_config_names_key_and_value(override: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        MoEModelConfig(**override)  # type: ignore[arg-type]


def test_unknown_model_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"model\.n_expertz"):
        MoEModelConfig.from_mapping({"n_expertz": 4})
