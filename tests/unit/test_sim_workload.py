"""Workload model: operator counts from the real model, stage split, Algorithm 1 windows."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from lightning_moe_ckpt.core.registry import OperatorRegistry
from lightning_moe_ckpt.models.config import MoEModelConfig
from lightning_moe_ckpt.models.transformer import MoETransformer
from lightning_moe_ckpt.sim import ClusterSpec, JobPlan, JobSpec, build_job, comm
from lightning_moe_ckpt.sim.inputs import PRECISIONS, precision_spec
from lightning_moe_ckpt.sim.schedule import find_window, ordered_costs
from lightning_moe_ckpt.sim.workload import build_operators, split_stages

CONF = Path(__file__).resolve().parents[2] / "conf"


def model(name: str) -> MoEModelConfig:
    return MoEModelConfig.from_mapping(
        OmegaConf.to_container(OmegaConf.load(CONF / f"model/{name}.yaml")))


def a100() -> ClusterSpec:
    return ClusterSpec.from_mapping(OmegaConf.load(CONF / "hardware/a100.yaml").cluster,
                                    name="a100")


@pytest.mark.parametrize("precision", ["bf16-master", "32"])
def test_one_layer_template_reproduces_the_full_registry(precision: str) -> None:
    cfg = dataclasses.replace(model("small"), n_shared_experts=1)
    spec = PRECISIONS[precision]
    with torch.device("meta"):
        full = MoETransformer(cfg)
    assert spec.native_dtype is not None
    full.to(spec.native_dtype)
    registry = OperatorRegistry(full)
    ops = build_operators(cfg, spec, seq_len=64)
    assert [op.name for op in ops] == registry.names
    for op in ops:
        real = registry[op.name]
        assert (op.kind, op.layer, op.numel) == (real.kind, real.layer, real.numel)
        assert op.compute_bytes == real.nbytes.compute
        assert op.master_state_bytes == real.nbytes.master_state


@pytest.mark.parametrize(("name", "billions"), [("gpt_moe", 7.30), ("qwen_moe", 14.32),
                                                ("deepseek_moe", 16.43), ("moe_llava", 2.91)])
def test_paper_models_have_their_table_2_sizes(name: str, billions: float) -> None:
    ops = build_operators(model(name), PRECISIONS["bf16-master"], 2048)
    assert sum(op.numel for op in ops) / 1e9 == pytest.approx(billions, abs=0.01)


def test_scale_configs_have_their_labelled_sizes() -> None:
    scale = OmegaConf.to_container(OmegaConf.load(CONF / "sim/scale/deepseek.yaml"))
    assert isinstance(scale, dict)
    for entry in scale["configs"]:
        cfg = MoEModelConfig.from_mapping(entry["model"])
        total = sum(op.numel for op in build_operators(cfg, PRECISIONS["bf16-master"], 2048))
        assert total / 1e9 == pytest.approx(float(entry["label"].rstrip("B")), rel=0.01)
        plan = JobPlan.from_mapping(entry["plan"], "sim.scale")
        plan.check_model(cfg, "sim.scale")


def test_bytes_per_element_tables() -> None:
    cfg = model("tiny")
    numel = sum(op.numel for op in build_operators(cfg, PRECISIONS["32"], 64))
    for name, compute, state in [("bf16-master", 2, 12), ("32", 4, 12),
                                 ("fp8-fp16-fp32", 1, 10), ("fp8-fp8-fp8fp16", 1, 4)]:
        ops = build_operators(cfg, PRECISIONS[name], 64)
        assert sum(op.compute_bytes for op in ops) == compute * numel
        assert sum(op.master_state_bytes for op in ops) == state * numel


def test_flops_follow_parameter_counts_and_routing() -> None:
    cfg = model("deepseek_moe")
    ops = {op.name: op for op in build_operators(cfg, PRECISIONS["bf16-master"], 2048)}
    expert = ops["layers.0.moe.experts.0"]
    assert expert.forward_flops == pytest.approx(2 * expert.numel * cfg.top_k / cfg.n_experts)
    assert expert.activation == pytest.approx(cfg.top_k / cfg.n_experts)
    attn = ops["layers.0.attn"]
    assert attn.forward_flops == pytest.approx(2 * attn.numel + 2 * 2048 * cfg.d_model)
    assert ops["embed"].active_flops == 0
    assert ops["layers.0.moe.shared_experts"].activation == 1.0


def test_stage_split_is_contiguous_and_optimal() -> None:
    cfg = model("small")
    ops = build_operators(cfg, PRECISIONS["bf16-master"], 128)
    plan = JobPlan(pp=3, dp=1, ep=2, global_batch=8, micro_batch=2, seq_len=128)
    stages = split_stages(ops, plan, cfg.n_layers)
    assert [layer for s in stages for layer in s.layers] == list(range(cfg.n_layers))
    assert stages[0].operators[0].kind == "embed" and stages[-1].operators[-1].kind == "head"
    worst = max(s.flops_per_token() for s in stages)
    layer_cost = [sum(op.active_flops for op in ops if op.layer == i) for i in range(8)]
    layer_cost[-1] += sum(op.active_flops for op in ops if op.kind == "head")
    best = min(max(sum(layer_cost[a:b]) for a, b in zip((0, *cuts), (*cuts, 8), strict=True))
               for cuts in itertools.combinations(range(1, 8), 2))
    assert worst == pytest.approx(best)


def test_algorithm_1_window_size() -> None:
    ops = build_operators(model("small"), PRECISIONS["bf16-master"], 128)
    ranks = 2
    dense = sum(op.master_state_bytes for op in ops) / ranks
    floor = max(op.master_state_bytes for op in ops) / ranks
    assert find_window(ops, ranks, budget_bytes=dense).window == 1
    windows = [find_window(ops, ranks, dense * f).window for f in (1.0, 0.6, 0.4, 0.3, 0.25)]
    assert windows == sorted(windows) and windows[-1] > 1
    schedule = find_window(ops, ranks, dense * 0.4)
    assert max(schedule.snapshot_bytes) <= dense * 0.4
    assert len(schedule.snapshot_bytes) == schedule.window
    # Full coverage: every operator's master state is captured exactly once per window.
    order = schedule.order
    assert sorted(op.name for op in order) == sorted(op.name for op in ops)
    assert order == ordered_costs(ops)
    first = len(schedule.turns[0])
    expected_first = (sum(op.master_state_bytes for op in order[:first])
                      + sum(op.compute_bytes for op in order[first:])) / ranks
    assert schedule.snapshot_bytes[0] == pytest.approx(expected_first)
    assert schedule.frozen_after(schedule.window - 1) == frozenset()
    # Nothing fits: one operator per snapshot (the caller charges the stall).
    tight = find_window(ops, ranks, budget_bytes=floor / 10)
    assert not tight.fits and all(len(turn) == 1 for turn in tight.turns)


def test_popular_operators_are_checkpointed_last() -> None:
    ops = build_operators(model("small"), PRECISIONS["bf16-master"], 128,
                          shares=np.tile(np.linspace(1, 16, 16) / 136, (8, 1)))
    order = ordered_costs(ops)
    activations = [op.activation for op in order]
    assert activations == sorted(activations)
    assert all(op.kind != "expert" for op in order[-5:])  # non-experts see every token


def test_iteration_time_is_the_1f1b_formula() -> None:
    cluster = a100()
    plan = JobPlan(pp=6, dp=2, ep=8, global_batch=512, micro_batch=32, seq_len=2048)
    job = build_job(JobSpec(model("qwen_moe"), plan, cluster,
                            precision_spec("bf16-master", cluster)))
    time = job.time
    assert time.pipeline_s == pytest.approx((16 + 6 - 1) * time.slot_s)
    assert time.iteration_s == pytest.approx(time.pipeline_s + time.sync_s + time.update_s)
    assert time.slot_s == max(s.slot_s for s in time.stages)


def test_alpha_beta_collectives() -> None:
    cluster = a100()
    in_node, across = comm.Group(8, 8), comm.Group(32, 8)
    assert comm.all_reduce_s(1e9, comm.Group(1, 1), cluster) == 0.0
    assert comm.all_reduce_s(1e9, across, cluster) > comm.all_reduce_s(1e9, in_node, cluster)
    # The beta term is linear in the message size; the alpha term is what remains at 0 bytes.
    small, large = (comm.all_reduce_s(m, across, cluster) for m in (1e6, 2e6))
    alpha = comm.all_reduce_s(1e-9, across, cluster)
    assert large - alpha == pytest.approx(2 * (small - alpha), rel=1e-6)
    plan = JobPlan(pp=4, dp=1, ep=4, global_batch=8, micro_batch=4, seq_len=16)
    assert [comm.boundary_crosses_node(s, plan, cluster) for s in range(3)] == [False, True, False]
