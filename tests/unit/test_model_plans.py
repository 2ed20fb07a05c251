"""Plans for users' models: what is recognised, and what is rejected before launch."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch import nn

from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.parallel.hf_plan import hf_decoder_shape
from lightning_moe_ckpt.parallel.model_plans import ModelShape, stage_layer_ids
from lightning_moe_ckpt.parallel.plan_selection import check_user_model
from lightning_moe_ckpt.strategies import TrainerMoEParallelStrategy
from tests.anymodel.models import N_EXPERTS, N_LAYERS, grouped_experts_moe, mixtral, qwen3_moe
from tests.distributed.trainer_user_parallel import UserModule

pytest.importorskip("transformers")


@pytest.mark.parametrize("builder", [qwen3_moe, mixtral], ids=["qwen3_moe", "mixtral"])
def test_hf_decoder_moe_models_get_the_built_in_plan(builder: object) -> None:
    model = builder()  # type: ignore[operator]
    assert hf_decoder_shape(model) == ModelShape(N_LAYERS, N_EXPERTS)
    check_user_model(model, None, pp=2, ep=4)


def test_layouts_the_model_cannot_take_are_rejected_naming_the_setting() -> None:
    model = qwen3_moe()
    with pytest.raises(ConfigError, match=r"Qwen3MoeForCausalLM has 8 experts .* "
                                          r"parallel\.ep=3"):
        check_user_model(model, None, pp=1, ep=3)
    with pytest.raises(ConfigError, match=r"2 decoder layers, fewer than the 4 pipeline "
                                          r"stages of parallel\.pp=4"):
        check_user_model(model, None, pp=4, ep=1)


def test_a_model_without_a_plan_needs_a_parallelize_fn() -> None:
    with pytest.raises(ConfigError, match=r"no parallel plan for GroupedExpertsLM.*"
                                          r"parallelize_fn"):
        check_user_model(grouped_experts_moe(), None, pp=2, ep=1)
    check_user_model(grouped_experts_moe(), lambda model, mesh: None,  # type: ignore[arg-type,return-value]
                     pp=2, ep=1)
    assert hf_decoder_shape(nn.Linear(2, 2)) is None


def test_layers_split_into_contiguous_balanced_blocks() -> None:
    assert [stage_layer_ids(5, 2, s) for s in range(2)] == [[0, 1, 2], [3, 4]]
    assert [stage_layer_ids(4, 4, s) for s in range(4)] == [[0], [1], [2], [3]]


def test_the_trainer_rejects_a_layout_the_model_cannot_take_before_starting_processes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[int] = []
    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts",
                        lambda launcher: started.append(1))
    trainer = L.Trainer(strategy=TrainerMoEParallelStrategy(pp=1, ep=3), accelerator="cpu",
                        devices=3, logger=False, enable_checkpointing=False)
    with pytest.raises(ConfigError, match=r"8 experts .* parallel\.ep=3"):
        trainer.fit(UserModule(qwen3_moe()))
    assert started == []  # no other process was started
    trainer = L.Trainer(strategy=TrainerMoEParallelStrategy(pp=2), accelerator="cpu",
                        devices=2, logger=False, enable_checkpointing=False)
    with pytest.raises(ConfigError, match=r"no parallel plan for GroupedExpertsLM"):
        trainer.fit(UserModule(grouped_experts_moe()))
    assert started == []
