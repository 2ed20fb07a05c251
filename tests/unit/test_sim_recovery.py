"""Recovery models: MoEvement's localized replay vs dense global rollback (paper §3.6)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from lightning_moe_ckpt.models.config import MoEModelConfig
from lightning_moe_ckpt.sim import (
    ClusterSpec,
    JobPlan,
    JobSpec,
    SimJob,
    build_job,
    make_policy,
)
from lightning_moe_ckpt.sim.calibration import Calibration
from lightning_moe_ckpt.sim.inputs import precision_spec
from lightning_moe_ckpt.sim.moevement import stage_schedules
from lightning_moe_ckpt.sim.recovery import global_rollback_model, localized_replay_model

CONF = Path(__file__).resolve().parents[2] / "conf"
PLANS = {"gpt_moe": (3, 4, 8), "qwen_moe": (6, 2, 8), "deepseek_moe": (12, 1, 8),
         "moe_llava": (6, 2, 8)}


@functools.cache
def paper_job(name: str) -> SimJob:
    cluster = ClusterSpec.from_mapping(OmegaConf.load(CONF / "hardware/a100.yaml").cluster,
                                       name="a100")
    model = MoEModelConfig.from_mapping(
        OmegaConf.to_container(OmegaConf.load(CONF / f"model/{name}.yaml")))
    pp, dp, ep = PLANS[name]
    plan = JobPlan(pp=pp, dp=dp, ep=ep, global_batch=512, micro_batch=32, seq_len=2048)
    # The paper-calibrated job (conf/sim/paper.yaml): the comparison below is the paper's.
    calibration = Calibration.from_mapping(OmegaConf.load(CONF / "sim/paper.yaml").calibration)
    return build_job(JobSpec(model, plan, cluster, precision_spec("bf16-master", cluster),
                             calibration=calibration))


def test_localized_replay_bounds_and_mean_for_a_known_window() -> None:
    model = localized_replay_model([4], [40.0], [8.0], [5.0], restart_s=1.0)
    assert model.iteration_bounds == (4.0, 8.0)
    assert model.expected_iterations == pytest.approx(6.0)  # 1.5 W
    assert model.expected_s == pytest.approx(5.0 + 1.0 + 40.0 + 0.5 * 4 * 8.0)


@pytest.mark.parametrize("name", list(PLANS))
def test_moevement_rollback_is_between_zero_and_two_windows_with_mean_one_and_a_half(
        name: str) -> None:
    regime = make_policy("moevement", paper_job(name), 600.0, 12 * 3600).regime(None)
    recovery = regime.recovery
    assert recovery.scope == "stage"
    windows = [s.window for s in stage_schedules(paper_job(name))]
    assert regime.window == max(windows)
    low, high = recovery.iteration_bounds
    assert low >= 0 and high <= 2 * regime.window
    _, iterations = recovery.sample(np.random.default_rng(0), 40_000)
    assert iterations.min() >= 0 and iterations.max() <= 2 * regime.window
    # Every stage is equally likely to fail; each rolls back 1.5 of its own window on average.
    assert iterations.mean() == pytest.approx(1.5 * np.mean(windows), rel=0.02)


@pytest.mark.parametrize("policy", ["gemini", "checkfreq"])
def test_dense_rollback_is_global_and_about_half_the_interval(policy: str) -> None:
    job = paper_job("deepseek_moe")
    regime = make_policy(policy, job, 1800.0, 12 * 3600).regime(None)
    recovery = regime.recovery
    assert recovery.scope == "global"
    _, iterations = recovery.sample(np.random.default_rng(1), 40_000)
    lag = recovery.paths[0].base_iterations  # CheckFreq waits for the persist to storage
    assert iterations.min() >= lag and iterations.max() <= lag + regime.interval
    assert iterations.mean() - lag == pytest.approx(regime.interval / 2, rel=0.02)
    if policy == "gemini":
        assert lag == 0


def test_global_rollback_expected_time_is_load_plus_half_the_interval() -> None:
    model = global_rollback_model(iteration_s=3.0, interval=40, load_s=7.0, restart_s=2.0)
    assert model.expected_s == pytest.approx(7.0 + 2.0 + 0.5 * 40 * 3.0)
    assert model.iteration_bounds == (0.0, 40.0)


def test_frozen_operators_make_conversion_cheaper_than_full_replay() -> None:
    job = paper_job("deepseek_moe")
    for stage, schedule in zip(job.stages, stage_schedules(job), strict=True):
        full = job.timing.replay_iteration_s(stage)
        conversion = [job.timing.replay_iteration_s(stage, schedule.frozen_after(j))
                      for j in range(schedule.window)]
        # More operators become active at every step of the sparse-to-dense conversion.
        assert conversion == sorted(conversion)
        if schedule.window > 1:
            assert conversion[0] < full
        assert conversion[-1] == pytest.approx(full)


def test_frozen_operator_costs_two_thirds_of_an_active_one() -> None:
    stage = paper_job("deepseek_moe").stages[3]
    expert = next(op for op in stage.operators if op.is_expert)
    assert expert.frozen_flops == pytest.approx(2 / 3 * expert.active_flops)


def test_localized_replay_has_no_pipeline_bubble() -> None:
    job = paper_job("deepseek_moe")
    time = job.time
    for stage in job.stages:
        # M slots instead of the M + S - 1 slots of a pipelined iteration.
        assert job.timing.replay_iteration_s(stage) < time.iteration_s
    bubble = (time.microbatches + job.plan.pp - 1) / time.microbatches
    worst = max(job.timing.replay_iteration_s(s) for s in job.stages)
    assert time.pipeline_s / worst == pytest.approx(bubble, rel=0.05)


def test_moevement_recovers_faster_than_dense_rollback_at_every_paper_model() -> None:
    for name in PLANS:
        job = paper_job(name)
        sparse = make_policy("moevement", job, 600.0, 12 * 3600).regime(None)
        dense = make_policy("gemini", job, 600.0, 12 * 3600).regime(None)
        assert sparse.recovery.expected_s < dense.recovery.expected_s
