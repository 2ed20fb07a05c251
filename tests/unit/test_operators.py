"""Operator registry: naming, exact byte accounting, and frozen/active semantics."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_moe_ckpt.core.precision import PRECISIONS, Precision
from lightning_moe_ckpt.core.registry import OperatorRegistry
from lightning_moe_ckpt.models import MoEModelConfig, MoETransformer
from lightning_moe_ckpt.training.executor import LocalExecutor
from lightning_moe_ckpt.training.iteration import (
    build_model,
    build_optimizer,
    build_scheduler,
    language_model_loss,
    train_iteration,
)
from lightning_moe_ckpt.training.settings import OptimSettings

Batch = tuple[torch.Tensor, torch.Tensor]
FROZEN = ["layers.1.moe.experts.3", "layers.1.moe.experts.5", "layers.2.attn",
          "layers.0.moe.gate", "embed"]


def test_operator_names_cover_every_parameter_once(tiny_cfg: MoEModelConfig) -> None:
    model = MoETransformer(tiny_cfg)
    registry = OperatorRegistry(model)
    owned = [name for op in registry for name, _ in op.params]
    assert sorted(owned) == sorted(name for name, _ in model.named_parameters())
    assert len(registry) == 1 + tiny_cfg.n_layers * (2 + tiny_cfg.n_experts) + 1
    assert registry.names[:4] == ["embed", "layers.0.attn", "layers.0.moe.gate",
                                  "layers.0.moe.experts.0"]
    assert registry["layers.3.moe.experts.7"].expert == 7
    owner = {piece.param_name: op.name for op in registry for piece in op.parts}
    assert owner["layers.2.ffn_norm.weight"] == "layers.2.attn"
    assert owner["head.norm.weight"] == "head"
    model.mystery = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="'mystery' belongs to no operator"):
        OperatorRegistry(model)


def test_registry_of_partial_model_keeps_names(tiny_cfg: MoEModelConfig) -> None:
    model = MoETransformer(tiny_cfg)
    del model.layers["0"], model.layers["1"]
    model.embed = None
    for expert in ("0", "1", "2", "3"):
        del model.layers["2"].moe.experts[expert]
    registry = OperatorRegistry(model)
    assert "embed" not in registry and "layers.2.moe.experts.4" in registry
    assert "layers.2.moe.experts.0" not in registry and "head" in registry


def _one_step(model: MoETransformer, precision: Precision, batch: Batch):  # type: ignore[no-untyped-def]
    optim = OptimSettings(weight_decay=0.1)
    optimizer = build_optimizer(model, precision, optim)
    scheduler = build_scheduler(optimizer, optim, max_steps=10)
    inputs, targets = batch

    def run() -> None:
        train_iteration(LocalExecutor(model), optimizer, scheduler, inputs, targets,
                        lambda loss: loss.backward(), optimizer.step, max_grad_norm=1.0)

    return optimizer, run


@pytest.mark.parametrize("precision", PRECISIONS)
def test_byte_accounting_is_exact(tiny_cfg: MoEModelConfig, batch: Batch,
                                  precision: Precision) -> None:
    model = build_model(tiny_cfg, precision, seed=0)
    optimizer, run = _one_step(model, precision, batch)
    run()
    registry = OperatorRegistry(model)
    masters = optimizer.master_weights()
    state = optimizer.optimizer_state()
    compute_per_param = 2 if precision == "bf16-master" else 4
    for op in registry:
        sizes = op.nbytes
        names = [name for name, _ in op.params]
        assert sizes.compute == sum(p.nbytes for _, p in op.params)
        assert sizes.compute == compute_per_param * op.numel
        assert sizes.master == sum(masters[n].nbytes for n in names)
        assert sizes.optimizer == sum(state[n]["exp_avg"].nbytes + state[n]["exp_avg_sq"].nbytes
                                      for n in names)
        assert sizes.master_state == 12 * op.numel
    total = registry.total_bytes()
    assert total.compute == sum(p.nbytes for p in model.parameters())


def _snapshot(optimizer, names):  # type: ignore[no-untyped-def]
    masters = optimizer.master_weights()
    state = optimizer.optimizer_state()
    return {n: (masters[n].clone(), {k: v.clone() for k, v in state[n].items()}) for n in names}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_frozen_operator_state_untouched_by_step(tiny_cfg: MoEModelConfig, batch: Batch,
                                                 precision: Precision) -> None:
    model = build_model(tiny_cfg, precision, seed=0)
    optimizer, run = _one_step(model, precision, batch)
    run()
    run()  # non-trivial moments and step counters before freezing
    registry = OperatorRegistry(model)
    frozen_params = [n for op in FROZEN for n, _ in registry[op].params]
    active_params = [n for n, _ in model.named_parameters() if n not in frozen_params]
    before = _snapshot(optimizer, frozen_params + active_params)
    compute_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    registry.set_frozen(FROZEN)
    assert registry.frozen() == sorted(FROZEN, key=registry.names.index)
    run()
    after = _snapshot(optimizer, frozen_params + active_params)
    params = dict(model.named_parameters())
    for name in frozen_params:
        master, state = before[name]
        assert torch.equal(after[name][0], master), name
        assert state.keys() == after[name][1].keys()
        for key in state:
            assert torch.equal(after[name][1][key], state[key]), (name, key)
        assert float(after[name][1]["step"]) == 2.0
        assert torch.equal(params[name], compute_before[name]), name
    for name in active_params:
        assert float(after[name][1]["step"]) == 3.0
        assert not torch.equal(after[name][0], before[name][0]), name


def _capture_layer_inputs(model: MoETransformer) -> dict[str, torch.Tensor]:
    captured: dict[str, torch.Tensor] = {}
    for key, layer in model.layers.items():
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], key: str = key) -> None:
            if args[0].requires_grad:  # layer 0's input is a leaf when embed is frozen
                args[0].retain_grad()
                captured[key] = args[0]
        layer.register_forward_pre_hook(hook)
    return captured


@pytest.mark.parametrize("precision", PRECISIONS)
def test_input_gradients_through_frozen_operators_are_bitwise_equal(
        tiny_cfg: MoEModelConfig, batch: Batch, precision: Precision) -> None:
    inputs, targets = batch
    grads = {}
    layer_input_grads = {}
    for mode in ("active", "frozen"):
        model = build_model(tiny_cfg, precision, seed=0)
        registry = OperatorRegistry(model)
        if mode == "frozen":
            registry.set_frozen(FROZEN)
        captured = _capture_layer_inputs(model)
        language_model_loss(model(inputs[0]), targets[0]).backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
        layer_input_grads[mode] = {k: v.grad for k, v in captured.items()}
        if mode == "frozen":
            for op in FROZEN:
                for _, param in registry[op].params:
                    assert param.grad is None and not param.requires_grad
    for key in ("1", "2", "3"):  # gradients flowing out of layers containing frozen ops
        frozen_grad = layer_input_grads["frozen"][key]
        active_grad = layer_input_grads["active"][key]
        assert frozen_grad is not None and active_grad is not None
        assert torch.equal(frozen_grad, active_grad), key
    for name, grad in grads["frozen"].items():
        if grad is not None:
            assert torch.equal(grad, grads["active"][name]), name


def test_frozen_operator_skips_weight_gradient_flops(tiny_cfg: MoEModelConfig,
                                                     batch: Batch) -> None:
    inputs, targets = batch
    flops = {}
    for mode in ("active", "frozen"):
        model = MoETransformer(tiny_cfg, seed=0)
        if mode == "frozen":
            OperatorRegistry(model).set_frozen(["layers.2.attn"])
        loss = language_model_loss(model(inputs[0]), targets[0])
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        flops[mode] = counter.get_total_flops()
    tokens = inputs[0].numel()
    d_model = tiny_cfg.d_model
    # wq, wk, wv, wo: one skipped [tokens x d] x [tokens x d] weight-gradient GEMM each.
    assert flops["active"] - flops["frozen"] == 4 * 2 * tokens * d_model * d_model


class _Stem(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(8, 4)
        self.register_buffer("position_ids", torch.arange(4))


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(4)
        self.gate = torch.nn.Linear(4, 2)
        self.gate.register_buffer("bias_correction", torch.zeros(2))
        self.register_buffer("rope", torch.ones(2), persistent=False)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = _Stem()
        self.layers = torch.nn.ModuleList([_Block(), _Block()])
        self.head = torch.nn.Linear(4, 8)


# _Net has routers (gate) and no experts, on purpose: the warning about that is not
# what these tests check.
_NO_EXPERTS_WARNING = pytest.mark.filterwarnings("ignore:found routers but no experts")


@_NO_EXPERTS_WARNING
def test_persistent_buffers_join_an_operator_and_the_others_none() -> None:
    registry = OperatorRegistry(_Net())
    held = {buffer.name: op.name for op in registry for buffer in op.buffers}
    assert held == {
        "stem.position_ids": "embed",  # its module's parameters are the embedding's
        "layers.0.norm.running_mean": "layers.0.attn",
        "layers.0.norm.running_var": "layers.0.attn",
        "layers.0.norm.num_batches_tracked": "layers.0.attn",
        "layers.0.gate.bias_correction": "layers.0.gate",
        "layers.1.norm.running_mean": "layers.1.attn",
        "layers.1.norm.running_var": "layers.1.attn",
        "layers.1.norm.num_batches_tracked": "layers.1.attn",
        "layers.1.gate.bias_correction": "layers.1.gate",
    }  # layers.*.rope is not persistent: the model rebuilds it
    assert registry["layers.0.gate"].nbytes.compute == (4 * 2 + 2) * 4 + 2 * 4


@_NO_EXPERTS_WARNING
def test_a_buffer_no_operator_can_hold_is_an_error_naming_it() -> None:
    model = _Net()
    model.register_buffer("loose", torch.zeros(1))
    with pytest.raises(ValueError, match="buffer 'loose' belongs to no single operator"):
        OperatorRegistry(model)
    registry = OperatorRegistry(model, override={"loose": "head"})
    assert [b.name for b in registry["head"].buffers] == ["loose"]
    with pytest.raises(ValueError, match="assigns buffer 'loose' to 'nowhere'"):
        OperatorRegistry(model, override={"loose": "nowhere"})


def test_routers_without_discoverable_experts_warn() -> None:
    from tests.anymodel.models import modulelist_moe

    model = modulelist_moe(0)
    for block in model.blocks:  # type: ignore[union-attr]
        block.moe.ffns = block.moe.experts  # a container name the rules do not know
        del block.moe.experts
    with pytest.warns(UserWarning, match="found routers but no experts"):
        registry = OperatorRegistry(model)
    assert not any(op.kind == "expert" for op in registry)



class _ExpertsLast(torch.nn.Module):
    """Fused experts stored ``[dim, ff, n_experts]``: the expert dimension last."""

    def __init__(self, dim: int, ff: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(dim, ff, n_experts))
        self.w2 = torch.nn.Parameter(torch.randn(dim, ff, n_experts))  # used transposed


def test_fused_experts_off_dim_0_warn_naming_both_counts(tiny_cfg: MoEModelConfig) -> None:
    from tests.anymodel.models import grouped_experts_moe

    model = grouped_experts_moe(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # experts first, as the rules take them: no warning
        OperatorRegistry(model)
        OperatorRegistry(MoETransformer(tiny_cfg))  # experts in a container of modules
    for name, module in list(model.named_modules()):
        if name.endswith(".experts"):
            n_experts, ff, dim = module.get_parameter("w1").shape
            model.get_submodule(name.rpartition(".")[0]).experts = _ExpertsLast(dim, ff,
                                                                                 n_experts)
    with pytest.warns(UserWarning, match=f"dim 0 holds {dim}, its router scores {n_experts} "
                                         "experts"):
        OperatorRegistry(model)
