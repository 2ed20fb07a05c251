"""Core of sparse checkpointing on a user's own MoE model: frozen slices, discovery, state access.

Covers, on the tiny any-model layouts (``tests/anymodel/models.py``):

* frozen slices of fused expert tensors held bitwise around an optimizer step (AdamW, fused
  and per-parameter AdamW, SGD with momentum), with a control showing a zeroed gradient is
  not enough;
* whole parameters frozen by restore (the DDP mode), including parameters without state;
* operator discovery, override mapping/callable and the unclaimed-parameter error;
* :class:`OptimizerStateAccess` master-state round trips (fp32 AdamW and bf16 masters);
* Trainer configurations the callback must refuse at setup;
* router telemetry counts;
* :class:`MasterWeightAdamW` training under Lightning's automatic optimization.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import lightning as L
import pytest
import torch
from torch import Tensor, nn

from lightning_moe_ckpt.callbacks.sparse_checkpointing import SparseCheckpointing
from lightning_moe_ckpt.core.operators import expert_position, is_expert_parameter
from lightning_moe_ckpt.core.optimizer_state import OptimizerStateAccess
from lightning_moe_ckpt.core.precision import MasterWeightAdamW
from lightning_moe_ckpt.core.registry import OperatorRegistry
from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.targets.telemetry import RouterTelemetry
from tests.anymodel.models import (
    BUILDERS,
    LMModule,
    grouped_experts_moe,
    lm_loss,
    mixtral,
    modulelist_moe,
    qwen3_moe,
    random_token_loader,
)

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

QWEN_FROZEN = "model.layers.0.mlp.experts.3"
QWEN_FUSED = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj")
TITAN_FROZEN = "layers.0.moe.experts.5"
TITAN_FUSED = ("layers.0.moe.experts.w1", "layers.0.moe.experts.w2", "layers.0.moe.experts.w3")


def _ids(seed: int, batch: int = 2, seq: int = 16) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (batch, seq), generator=generator)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, first_seed: int = 0) -> None:
    for i in range(steps):
        opt.zero_grad()
        lm_loss(model, _ids(first_seed + i)).backward()
        opt.step()


def _backward(model: nn.Module, opt: torch.optim.Optimizer, seed: int = 99) -> None:
    opt.zero_grad()
    lm_loss(model, _ids(seed)).backward()


def _held_step(opt: torch.optim.Optimizer, registry: OperatorRegistry) -> None:
    """The optimizer step exactly as TrainingTarget.before_update/after_update wrap it."""
    state = OptimizerStateAccess(opt)
    registry.frozen_slices.hold(state.step_tensors, state.state_of)
    opt.step()
    registry.frozen_slices.release()


def _slice(model: nn.Module, opt: torch.optim.Optimizer, names: tuple[str, ...],
           index: int) -> dict[str, Tensor]:
    """Clones of slice ``index`` of the weights and of every parameter-shaped state tensor."""
    params = dict(model.named_parameters())
    out: dict[str, Tensor] = {}
    for name in names:
        param = params[name]
        out[name] = param.detach()[index].clone()
        for field, value in opt.state[param].items():
            if isinstance(value, Tensor) and value.shape == param.shape:
                out[f"{name}/{field}"] = value[index].clone()
    return out


def _same(a: dict[str, Tensor], b: dict[str, Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [key for key in a if not torch.equal(a[key], b[key])]


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Tensor]:
    """Clones of every parameter and every optimizer-state tensor, by name."""
    out: dict[str, Tensor] = {}
    for name, param in model.named_parameters():
        out[name] = param.detach().clone()
        for field, value in opt.state.get(param, {}).items():
            out[f"{name}/{field}"] = value.clone()
    return out


# --------------------------------------------------------------------------------------------
# 1-2. Frozen slices of fused experts
# --------------------------------------------------------------------------------------------


def test_frozen_fused_slice_is_held_bitwise_under_adamw() -> None:
    model = qwen3_moe(0)
    registry = OperatorRegistry(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, opt, steps=1)
    registry.set_frozen([QWEN_FROZEN])
    assert registry.frozen() == [QWEN_FROZEN]
    _backward(model, opt)
    frozen_before = _slice(model, opt, QWEN_FUSED, 3)
    active_before = _slice(model, opt, QWEN_FUSED, 2)
    assert len(frozen_before) == 6  # weight, exp_avg, exp_avg_sq of two fused parameters
    assert all(t.abs().sum() > 0 for t in frozen_before.values())
    _held_step(opt, registry)
    assert _same(frozen_before, _slice(model, opt, QWEN_FUSED, 3)) == []
    assert sorted(_same(active_before, _slice(model, opt, QWEN_FUSED, 2))) == sorted(
        active_before)

    # Control: the same step with the frozen slice's gradient zeroed but no hold/release.
    control = qwen3_moe(0)
    control_opt = torch.optim.AdamW(control.parameters(), lr=1e-2, weight_decay=0.1)
    _train(control, control_opt, steps=1)
    _backward(control, control_opt)
    params = dict(control.named_parameters())
    for name in QWEN_FUSED:
        params[name].grad[3].zero_()
    before = _slice(control, control_opt, QWEN_FUSED, 3)
    assert _same(before, frozen_before) == []  # same starting point as the held run
    control_opt.step()
    assert sorted(_same(before, _slice(control, control_opt, QWEN_FUSED, 3))) == sorted(before)


def test_fused_parameter_requires_grad_follows_its_slices() -> None:
    model = qwen3_moe(0)
    registry = OperatorRegistry(model)
    params = dict(model.named_parameters())
    fused = [params[name] for name in QWEN_FUSED]
    experts = [f"model.layers.0.mlp.experts.{e}" for e in range(8)]
    registry.set_frozen([QWEN_FROZEN])
    assert all(p.requires_grad for p in fused)
    registry.set_frozen(experts[:-1])
    assert all(p.requires_grad for p in fused)  # expert 7 is still active
    registry.set_frozen(experts[-1:])
    assert not any(p.requires_grad for p in fused)
    assert registry.frozen() == experts
    # The other layer's fused tensors are untouched.
    assert params["model.layers.1.mlp.experts.gate_up_proj"].requires_grad
    registry.activate_all()
    assert all(p.requires_grad for p in model.parameters())
    assert registry.frozen() == []
    assert not registry.frozen_slices


@pytest.mark.parametrize(
    ("factory", "fields"),
    [
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
         {"exp_avg", "exp_avg_sq"}),
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
         {"exp_avg", "exp_avg_sq"}),
        (lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9), {"momentum_buffer"}),
    ],
    ids=["adamw-fused", "adamw-single-tensor", "sgd-momentum"],
)
def test_frozen_grouped_expert_slice_is_held_bitwise(factory: OptimizerFactory,
                                                     fields: set[str]) -> None:
    model = grouped_experts_moe(0)
    registry = OperatorRegistry(model)
    opt = factory(list(model.parameters()))
    _train(model, opt, steps=2)
    registry.set_frozen([TITAN_FROZEN])
    params = dict(model.named_parameters())
    assert all(params[name].requires_grad for name in TITAN_FUSED)
    _backward(model, opt)
    before = _slice(model, opt, TITAN_FUSED, 5)
    assert {key.partition("/")[2] for key in before} == fields | {""}
    assert all(t.abs().sum() > 0 for t in before.values())  # state exists for the slice
    others = {e: _slice(model, opt, TITAN_FUSED, e) for e in range(8) if e != 5}
    _held_step(opt, registry)
    assert _same(before, _slice(model, opt, TITAN_FUSED, 5)) == []
    # Every other expert with routed tokens in this step moved in weight and state.
    moved = [e for e, old in others.items()
             if sorted(_same(old, _slice(model, opt, TITAN_FUSED, e))) == sorted(old)]
    assert moved

    control = grouped_experts_moe(0)
    control_opt = factory(list(control.parameters()))
    _train(control, control_opt, steps=2)
    _backward(control, control_opt)
    control_params = dict(control.named_parameters())
    for name in TITAN_FUSED:
        control_params[name].grad[5].zero_()
    control_before = _slice(control, control_opt, TITAN_FUSED, 5)
    assert _same(control_before, before) == []
    control_opt.step()
    changed = _same(control_before, _slice(control, control_opt, TITAN_FUSED, 5))
    assert set(TITAN_FUSED) <= set(changed)  # a zero gradient still moves the weights


# --------------------------------------------------------------------------------------------
# 3. Whole parameters frozen by restore
# --------------------------------------------------------------------------------------------


def test_freeze_by_restore_holds_whole_operator_and_its_state() -> None:
    model = qwen3_moe(0)
    registry = OperatorRegistry(model, freeze_by_restore=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, opt, steps=1)
    registry.set_frozen(["model.layers.0.attn"])
    assert registry.is_frozen("model.layers.0.attn")
    assert registry.frozen() == ["model.layers.0.attn"]
    assert all(p.requires_grad for p in model.parameters())
    owned = {name for name, _ in registry["model.layers.0.attn"].params}
    assert "model.layers.0.self_attn.q_proj.weight" in owned
    _backward(model, opt)
    assert all(p.grad is not None for n, p in model.named_parameters() if n in owned)
    before = _snapshot(model, opt)
    _held_step(opt, registry)
    after = _snapshot(model, opt)
    mine = [key for key in before if key.partition("/")[0] in owned]
    assert any(key.endswith("/step") for key in mine)
    assert [key for key in mine if not torch.equal(before[key], after[key])] == []
    # The step did happen for everything else.
    rest = [key for key in before if key.partition("/")[0] not in owned]
    assert rest and [key for key in rest if torch.equal(before[key], after[key])] == []
    assert float(opt.state[dict(model.named_parameters())["lm_head.weight"]]["step"]) == 2.0


def test_freeze_by_restore_parameter_without_state_keeps_none() -> None:
    model = qwen3_moe(0)
    registry = OperatorRegistry(model, freeze_by_restore=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    registry.set_frozen(["model.layers.0.attn"])
    owned = dict(registry["model.layers.0.attn"].params)
    weights = {name: p.detach().clone() for name, p in owned.items()}
    _backward(model, opt)
    _held_step(opt, registry)
    for name, param in owned.items():
        assert not opt.state.get(param), name
        assert torch.equal(param.detach(), weights[name]), name
    head = dict(model.named_parameters())["lm_head.weight"]
    assert set(opt.state[head]) == {"step", "exp_avg", "exp_avg_sq"}


# --------------------------------------------------------------------------------------------
# 4. Discovery
# --------------------------------------------------------------------------------------------


def test_modulelist_operator_names_and_kinds() -> None:
    registry = OperatorRegistry(modulelist_moe(0))
    kinds = {op.name: op.kind for op in registry}
    assert kinds["blocks.0.moe.experts.3"] == "expert"
    assert kinds["blocks.0.moe.router"] == "gate"
    assert kinds["embed"] == "embed"
    assert kinds["head"] == "head"
    assert kinds["blocks.0.attn"] == "attn"
    assert len(registry) == 1 + 2 * (1 + 1 + 8) + 1
    op = registry["blocks.0.moe.experts.3"]
    assert (op.layer, op.expert) == (0, 3)
    assert {name for name, _ in op.params} == {
        f"blocks.0.moe.experts.3.{m}.{w}" for m in ("up", "down") for w in ("weight", "bias")}


@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_every_parameter_claimed_exactly_once(builder: str) -> None:
    model = BUILDERS[builder](0)
    registry = OperatorRegistry(model)
    claims: dict[str, list[int | None]] = {}
    for op in registry:
        for piece in op.parts:
            claims.setdefault(piece.param_name, []).append(piece.index)
    params = dict(model.named_parameters())
    assert claims.keys() == params.keys()
    for name, indices in claims.items():
        if is_expert_parameter(name) and None not in indices and len(indices) > 1:
            assert sorted(indices) == list(range(params[name].shape[0])), name  # type: ignore[type-var]
        else:
            assert indices == [None], name
    fused = [n for n, idx in claims.items() if idx != [None]]
    assert bool(fused) == (builder != "modulelist_moe")


def test_mixtral_has_sixteen_expert_operators() -> None:
    registry = OperatorRegistry(mixtral(0))
    experts = [op for op in registry if op.kind == "expert"]
    assert len(experts) == 16
    assert sorted(expert_position(op.name) for op in experts) == [
        (layer, e) for layer in range(2) for e in range(8)]
    assert all(len(op.parts) == 2 and op.parts[0].index == op.expert for op in experts)


def _with_extra() -> nn.Module:
    model = modulelist_moe(0)
    model.extra = nn.Parameter(torch.zeros(3))
    return model


def test_unclaimed_parameter_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as error:
        OperatorRegistry(_with_extra())
    assert "'extra'" in str(error.value)
    assert "operators=" in str(error.value)


@pytest.mark.parametrize(
    "override",
    [{"extra": "my_extra"}, lambda name, param: "my_extra" if name == "extra" else None],
    ids=["mapping", "callable"],
)
def test_override_claims_the_extra_parameter(override: object) -> None:
    model = _with_extra()
    registry = OperatorRegistry(model, override)  # type: ignore[arg-type]
    op = registry["my_extra"]
    assert op.kind == "other"
    assert (op.layer, op.expert) == (None, None)
    assert [(p.param_name, p.index) for p in op.parts] == [("extra", None)]
    assert op.parts[0].param is model.extra
    assert "blocks.0.moe.experts.3" in registry  # the rules still apply to the rest


def test_an_override_pattern_matching_nothing_is_refused_at_fit_start() -> None:
    module = LMModule(_with_extra())
    checkpointing = SparseCheckpointing("moevement", window=3,
                                        operators={"model.extra": "my_extra", "blocks.*.mlp": "x"})
    assert OperatorRegistry(module, checkpointing.operators).unmatched_patterns == [
        "blocks.*.mlp"]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[checkpointing])
    with pytest.raises(ConfigError, match=r"operators pattern\(s\) 'blocks\.\*\.mlp' match no "
                                          r"parameter of the model \(names look like 'model\."):
        trainer.fit(module, random_token_loader(n_batches=4))
    assert module.losses == []  # refused before any training step


def test_override_to_an_expert_name_is_an_expert() -> None:
    registry = OperatorRegistry(_with_extra(), {"extra": "custom.0.experts.1"})
    op = registry["custom.0.experts.1"]
    assert op.kind == "expert"
    assert (op.layer, op.expert) == (0, 1)
    assert expert_position("custom.0.experts.1") == (0, 1)
    assert expert_position("custom.experts") is None


# --------------------------------------------------------------------------------------------
# 5. OptimizerStateAccess round trip
# --------------------------------------------------------------------------------------------


def test_master_state_round_trip_adamw() -> None:
    model = qwen3_moe(0)
    registry = OperatorRegistry(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, opt, steps=2)
    access = OptimizerStateAccess(opt)
    before = _snapshot(model, opt)
    captured = {piece.key: {k: v.clone() for k, v in access.master_sources(piece).items()}
                for op in registry for piece in op.parts}
    piece = registry[QWEN_FROZEN].parts[0]
    assert piece.index == 3
    assert f"{piece.key}/step/shared" in captured[piece.key]
    assert f"{piece.key}/exp_avg" in captured[piece.key]
    assert f"{piece.key}/step" not in captured[piece.key]

    with torch.no_grad():
        for param in model.parameters():
            param.fill_(math.nan)
    opt.state.clear()
    for op in registry:
        for p in op.parts:
            access.load_master(p, captured[p.key])
    after = _snapshot(model, opt)
    assert before.keys() == after.keys()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert all(before[k].dtype == after[k].dtype for k in before)
    head = dict(model.named_parameters())["lm_head.weight"]
    assert opt.state[head]["step"].device.type == "cpu"

    # The restored optimizer continues exactly like an uninterrupted one.
    reference = qwen3_moe(0)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    _train(reference, reference_opt, steps=3)
    _train(model, opt, steps=1, first_seed=2)
    expected, got = _snapshot(reference, reference_opt), _snapshot(model, opt)
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []


def test_master_state_round_trip_bf16_master() -> None:
    model = grouped_experts_moe(0).to(torch.bfloat16)
    registry = OperatorRegistry(model)
    opt = MasterWeightAdamW(model.named_parameters(), "bf16-master", lr=1e-2)
    _train(model, opt, steps=2)
    access = OptimizerStateAccess(opt)
    masters = {name: m.detach().clone() for name, m in opt.master.items()}
    state = {name: {k: v.clone() for k, v in fields.items()}
             for name, fields in opt.optimizer_state().items()}
    assert state and all(set(f) == {"step", "exp_avg", "exp_avg_sq"} for f in state.values())
    captured = {piece.key: {k: v.clone() for k, v in access.master_sources(piece).items()}
                for op in registry for piece in op.parts}
    assert all(t.dtype == torch.float32 for c in captured.values() for t in c.values())

    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(math.nan)
            opt.master[name].fill_(math.nan)
    opt.state.clear()
    for op in registry:
        for p in op.parts:
            access.load_master(p, captured[p.key])

    params = dict(model.named_parameters())
    assert opt.optimizer_state().keys() == state.keys()
    for name, master in opt.master.items():
        assert torch.equal(master.detach(), masters[name]), name
        assert params[name].dtype == torch.bfloat16
        assert torch.equal(params[name].detach(), masters[name].to(torch.bfloat16)), name
        restored = opt.optimizer_state()[name]
        assert restored.keys() == state[name].keys()
        for field, value in state[name].items():
            assert torch.equal(restored[field], value), (name, field)


# --------------------------------------------------------------------------------------------
# 6. Trainer configurations refused at setup
# --------------------------------------------------------------------------------------------


def _trainer(**kwargs: object) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[SparseCheckpointing("moevement", window=3)], **kwargs)  # type: ignore[arg-type]


def test_gradient_accumulation_is_refused_at_fit_start() -> None:
    module = LMModule(modulelist_moe(0))
    with pytest.raises(ConfigError, match="accumulate_grad_batches=2"):
        _trainer(accumulate_grad_batches=2).fit(module, random_token_loader(n_batches=4))
    assert module.losses == []  # refused before any training step


class _TwoOptimizers(LMModule):
    def configure_optimizers(self) -> list[torch.optim.Optimizer]:  # type: ignore[override]
        return [torch.optim.AdamW(self.model.parameters(), lr=self.lr),
                torch.optim.SGD(self.model.parameters(), lr=self.lr)]


def test_a_failure_injector_without_its_checkpointing_callback_is_refused() -> None:
    from lightning_moe_ckpt.testing import AtSchedule, FailureInjector

    module = LMModule(modulelist_moe(0))
    orphan = SparseCheckpointing("moevement", window=3)
    injector = FailureInjector(AtSchedule([{"step": 1, "rank": 0}]), orphan)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[injector])
    with pytest.raises(ConfigError, match="SparseCheckpointing is not among the Trainer's"):
        trainer.fit(module, random_token_loader(n_batches=4))
    assert module.losses == []
    with pytest.raises(TypeError, match="not 'moevement'"):
        FailureInjector(AtSchedule([]), "moevement")  # type: ignore[arg-type]


@pytest.mark.parametrize(("options", "needle"), [
    ({"replicas": "2"}, r"checkpoint\.replicas='2' must be an integer >= 0"),
    ({"warmup_iterations": 0}, r"checkpoint\.warmup_iterations=0 must be an integer >= 1"),
    ({"upstream_logging": "no"}, r"checkpoint\.upstream_logging='no' must be True or False"),
    ({"same_node_replicas": True},
     r"checkpoint\.same_node_replicas=True must be one of 'shared', 'copied'"),
    ({"top_k": None, "n_experts": 4}, r"unknown option\(s\) checkpoint\.n_experts"),
    ({"checksum_threads": True}, r"checkpoint\.checksum_threads=True must be an integer >= 1"),
    ({"helper_nice": -1}, r"checkpoint\.helper_nice=-1 must be an integer from 0"),
])
def test_bad_callback_arguments_name_the_setting(options: dict[str, object],
                                                 needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        SparseCheckpointing("moevement", **options)  # type: ignore[arg-type]


def test_an_override_callable_must_return_a_name_and_set_frozen_a_list() -> None:
    with pytest.raises(ConfigError, match=r"operators callable returned 5 for 'tok_emb\.weight'"):
        OperatorRegistry(modulelist_moe(0), override=lambda name, param: 5)  # type: ignore[arg-type,return-value]
    registry = OperatorRegistry(modulelist_moe(0))
    with pytest.raises(TypeError, match="not the one string 'embed'"):
        registry.set_frozen("embed")


def test_several_optimizers_are_refused_at_fit_start() -> None:
    module = _TwoOptimizers(modulelist_moe(0), manual=True)
    with pytest.raises(ConfigError, match="one optimizer; configure_optimizers returned 2"):
        _trainer().fit(module, random_token_loader(n_batches=4))
    assert module.losses == []


# --------------------------------------------------------------------------------------------
# 7. Router telemetry
# --------------------------------------------------------------------------------------------


def test_router_telemetry_counts_qwen3() -> None:
    model = qwen3_moe(0)
    telemetry = RouterTelemetry(model, OperatorRegistry(model), top_k=2)
    assert telemetry.active
    ids = _ids(0)
    tokens = ids.numel()
    with torch.no_grad():
        model(input_ids=ids)
    assert telemetry.observed
    hard, soft = telemetry.take()
    assert hard is not None and soft is not None
    assert hard.shape == soft.shape == (2, 8)
    assert torch.equal(hard.sum(dim=1), torch.full((2,), float(tokens * 2)))
    assert torch.equal(hard, hard.round())
    assert torch.allclose(soft.sum(dim=1), torch.full((2,), float(tokens)), atol=1e-4)
    again_hard, again_soft = telemetry.take()  # take() zeroes the counters
    assert again_hard is not None and again_soft is not None
    assert not again_hard.any() and not again_soft.any()
    telemetry.close()
    with torch.no_grad():
        model(input_ids=ids)
    assert not telemetry.take()[0].any()  # type: ignore[union-attr]


def test_router_telemetry_plain_linear_router_needs_top_k() -> None:
    model = modulelist_moe(0)
    registry = OperatorRegistry(model)
    blind = RouterTelemetry(model, registry, top_k=None)
    with torch.no_grad():
        model(_ids(0))
    assert blind.active and not blind.observed
    assert blind.take() == (None, None)
    blind.close()

    seeing = RouterTelemetry(model, registry, top_k=2)
    with torch.no_grad():
        model(_ids(0))
    assert seeing.observed
    hard, _ = seeing.take()
    assert hard is not None
    assert torch.equal(hard.sum(dim=1), torch.full((2,), float(_ids(0).numel() * 2)))
    seeing.close()


def test_router_telemetry_counts_in_float32_under_a_bf16_default_dtype() -> None:
    """bf16-true sets the default dtype to bf16: the counters stay float32 (a torchtitan
    router's top scores are scattered into them)."""
    model = grouped_experts_moe(0)
    telemetry = RouterTelemetry(model, OperatorRegistry(model), top_k=2)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.no_grad():
            model(_ids(0))
    finally:
        torch.set_default_dtype(previous)
    assert telemetry.observed
    hard, soft = telemetry.take()
    assert hard is not None and soft is not None
    assert hard.dtype == soft.dtype == torch.float32
    assert torch.equal(hard.sum(dim=1), torch.full((2,), float(_ids(0).numel() * 2)))
    telemetry.close()


# --------------------------------------------------------------------------------------------
# 8. MasterWeightAdamW under automatic optimization
# --------------------------------------------------------------------------------------------


class _MasterWeightModule(LMModule):
    def __init__(self, model: nn.Module, precision: str) -> None:
        super().__init__(model)
        self.precision_mode = precision

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return MasterWeightAdamW(self.model.named_parameters(), self.precision_mode,  # type: ignore[arg-type]
                                 lr=self.lr)


@pytest.mark.parametrize("precision", ["32", "bf16-master"])
def test_master_weight_adamw_trains_under_automatic_optimization(precision: str) -> None:
    model = grouped_experts_moe(0)
    if precision == "bf16-master":
        model = model.to(torch.bfloat16)
    module = _MasterWeightModule(model, precision)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, random_token_loader(n_batches=3))
    assert trainer.global_step == 3
    assert len(module.losses) == 3
    unchanged = [name for name, p in model.named_parameters()
                 if torch.equal(p.detach(), before[name])]
    assert unchanged == []
