"""Topology arithmetic and the paper's cluster experiment presets."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from lightning_moe_ckpt.core.layout import Coordinates, ParallelPlan
from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.models import MoEModelConfig
from moe_recipes.settings import settings_from_config
from tests.conftest import CONF_DIR


def _plan(pp: int, dp: int, ep: int, microbatches: int = 4, schedule: str = "1f1b",
          layers: int = 4, experts: int = 8) -> ParallelPlan:
    model = MoEModelConfig(n_layers=layers, n_experts=experts)
    return ParallelPlan.validate(pp=pp, dp=dp, ep=ep, microbatches=microbatches,
                                 schedule=schedule, model=model)


def test_coordinates_round_trip_with_ep_fastest() -> None:
    plan = _plan(2, 2, 2)
    assert [plan.coordinates(r) for r in range(3)] == [
        Coordinates(0, 0, 0), Coordinates(0, 0, 1), Coordinates(0, 1, 0)]
    assert all(plan.rank_of(plan.coordinates(r)) == r for r in range(plan.world_size))
    assert plan.stage_group_ranks(1) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="outside world"):
        plan.coordinates(8)


def test_a_shard_group_sits_between_the_replicas_and_the_expert_ranks() -> None:
    """``dp_shard``: world = pp x dp x dp_shard x ep, ep fastest; a stage's ranks are
    contiguous and each reads its own data shard."""
    model = MoEModelConfig(n_layers=4, n_experts=8)
    plan = ParallelPlan.validate(pp=2, dp=1, ep=2, microbatches=4, schedule="1f1b",
                                 model=model, dp_shard=2)
    assert plan.world_size == 8 and plan.data_shards == 4 and plan.sharded
    assert [plan.coordinates(r) for r in range(4)] == [
        Coordinates(0, 0, 0, 0), Coordinates(0, 0, 1, 0), Coordinates(0, 0, 0, 1),
        Coordinates(0, 0, 1, 1)]
    assert all(plan.rank_of(plan.coordinates(r)) == r for r in range(plan.world_size))
    assert plan.stage_group_ranks(1) == [4, 5, 6, 7]
    assert [plan.data_shard(plan.coordinates(r)) for r in range(8)] == [0, 1, 2, 3] * 2
    with pytest.raises(ConfigError, match=r"parallel.dp_shard=0 must be an integer >= 1"):
        ParallelPlan.validate(pp=1, dp=1, ep=1, microbatches=1, schedule="1f1b",
                              model=model, dp_shard=0)
    with pytest.raises(ConfigError, match=r"parallel.pp=1 x parallel.dp=1 x "
                       r"parallel.dp_shard=2 x parallel.ep=1 = 2 processes, but the "
                       r"launcher provides world size 4"):
        ParallelPlan.validate(pp=1, dp=1, ep=1, microbatches=1, schedule="1f1b",
                              model=model, dp_shard=2, world_size=4)


def test_layers_and_experts_are_split_contiguously() -> None:
    plan = _plan(3, 1, 4, microbatches=3, layers=7, experts=8)
    assert [plan.stage_layers(s) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [list(plan.local_experts(e)) for e in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    interleaved = _plan(2, 1, 1, microbatches=4, schedule="interleaved_1f1b", layers=4)
    assert interleaved.num_stages == 4 and interleaved.stages_of(1) == [1, 3]
    assert [interleaved.stage_layers(s) for s in range(4)] == [[0], [1], [2], [3]]


def test_world_size_mismatch_is_named() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.pp=2 x parallel\.dp=1 x parallel\.ep=2 = 4 "
                                          r"processes, but the launcher provides world size 3"):
        ParallelPlan.validate(pp=2, dp=1, ep=2, microbatches=2, schedule="1f1b",
                              model=MoEModelConfig(), world_size=3)


EXPERIMENTS = {
    "gpt_moe_a100": (3, 4, 8, 12), "qwen_moe_a100": (6, 2, 8, 12),
    "deepseek_moe_a100": (12, 1, 8, 12), "moe_llava_a100": (6, 4, 4, 12),
    "gpt_moe_h100": (4, 4, 8, 16), "qwen_moe_h100": (8, 2, 8, 16),
    "deepseek_moe_h100": (8, 2, 8, 16), "moe_llava_h100": (8, 4, 4, 16),
}


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_cluster_experiments_compose_and_validate(name: str) -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("train", overrides=[f"+experiment={name}"])
    settings = settings_from_config(cfg)
    plan, hardware = settings.layout, settings.hardware
    pp, dp, ep, nodes = EXPERIMENTS[name]
    assert (plan.pp, plan.dp, plan.ep, hardware.nodes) == (pp, dp, ep, nodes)
    assert settings.model.name == name.rsplit("_", 1)[0]
    assert hardware.accelerator == "cuda" and hardware.backend == "nccl"
    assert hardware.devices_per_node == 8 and hardware.world_size == plan.world_size
    ParallelPlan.validate(pp=pp, dp=dp, ep=ep, microbatches=plan.microbatches,
                          schedule=plan.schedule, model=settings.model,
                          world_size=hardware.world_size)
    assert settings.global_batch == 512 and settings.data.seq_len == 2048
    # Global micro-batch of 32 sequences, split evenly over the stage's data shards.
    assert settings.global_batch // plan.microbatches == 32
    assert 32 % plan.data_shards == 0
    assert settings.precision == "bf16-master"
