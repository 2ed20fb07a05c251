"""Measured ETTR from run metrics, the calibrated simulator's predictions, and the profile
file recipes/bench.py writes for sim.profile."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.models.config import MoEModelConfig
from lightning_moe_ckpt.sim import ClusterSpec, JobPlan, JobSpec, SimJob, build_job
from lightning_moe_ckpt.sim.ettr import ettr_formula
from lightning_moe_ckpt.sim.inputs import precision_spec
from lightning_moe_ckpt.sim.measured import (
    CalibratedPolicy,
    MeasuredRun,
    PolicyKnobs,
    measure_ettr,
    plan_measured,
    predict,
    same_failures_ettr,
    useful_seconds,
)
from lightning_moe_ckpt.sim.profile import load_profile, profile_document, write_profile
from lightning_moe_ckpt.sim.schedule import fixed_window
from tests.conftest import CONF_DIR


@functools.cache
def tiny_job(with_profile: bool = True) -> SimJob:
    cluster = ClusterSpec.from_mapping(OmegaConf.load(CONF_DIR / "hardware/cpu.yaml").cluster,
                                       name="cpu")
    model = MoEModelConfig.from_mapping(
        OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model/tiny.yaml")))
    plan = JobPlan(pp=1, dp=1, ep=1, global_batch=16, micro_batch=8, seq_len=64)
    profile = None
    if with_profile:
        from lightning_moe_ckpt.sim.profile import parse_profile
        profile = parse_profile(profile_document([(0.01, 0.02)], model="tiny", pp=1,
                                                 microbatches=2, iteration_s=0.07,
                                                 optimizer_s=0.005, grad_sync_s=0.0))
    return build_job(JobSpec(model, plan, cluster, precision_spec("32", cluster), replicas=0,
                             profile=profile))


def metrics(loop_ms: float = 100.0, steps: int = 20, recoveries: tuple[float, ...] = (0.2, 0.3),
            failed: tuple[int, ...] = (5, 12)) -> dict[str, Any]:
    return {"steps": steps, "iteration_ms": {"mean": loop_ms}, "checkpoint_policy": "gemini",
            "failures_injected": len(failed), "tokens_per_step": 1024, "window": 1,
            "interval": 4, "loss": [1.0] * steps, "expert_load": [[300, 100], [200, 200]],
            "recoveries": [{"failed_step": s, "iterations_replayed": 2, "lost_tokens": 20,
                            "timings_s": {"total": r}}
                           for s, r in zip(failed, recoveries, strict=True)]}


def test_measured_ettr_is_useful_over_loop_time_and_factors_into_runtime_and_recovery() -> None:
    run = MeasuredRun.from_metrics(metrics(), "gemini")
    assert run.loop_s == pytest.approx(2.0) and run.work_s == pytest.approx(1.5)
    assert run.failure_steps == (5, 12) and run.replayed == (2, 2)
    assert run.lost_tokens == 40 and run.lost_token_share == pytest.approx(0.05)
    measured = measure_ettr(run, useful_s=1.2)
    assert measured.ettr == pytest.approx(0.6)
    assert measured.runtime == pytest.approx(1.2 / 1.5)
    assert measured.recovery == pytest.approx(1.5 / 2.0)
    assert measured.ettr == pytest.approx(measured.runtime * measured.recovery)
    assert measured.overhead == pytest.approx(0.25)


def test_useful_time_is_the_baseline_without_bursts_from_other_processes() -> None:
    steady = {"steps": 5, "iteration_ms": {"mean": 0.0, "per_step": [300, 100, 100, 100, 100]}}
    assert useful_seconds(steady, "none") == pytest.approx(0.7)  # its loop time
    burst = {"steps": 5, "iteration_ms": {"mean": 0.0, "per_step": [300, 100, 900, 100, 100]}}
    assert useful_seconds(burst, "none") == pytest.approx(0.7)  # the burst is not useful
    assert useful_seconds({"steps": 4, "iteration_ms": {"mean": 50.0}}, "none") == 0.2


def test_runs_without_recoveries_or_timings_are_refused_naming_the_run() -> None:
    with pytest.raises(ConfigError, match=r"moc: metrics\.json lacks 'recoveries'"):
        MeasuredRun.from_metrics({"steps": 3, "iteration_ms": {"mean": 1.0}}, "moc")
    with pytest.raises(ConfigError, match=r"none: metrics\.json lacks steps"):
        MeasuredRun.from_metrics({"recoveries": []}, "none")


def test_calibration_replaces_the_overhead_and_keeps_the_recovery_model() -> None:
    inner = plan_measured("gemini", tiny_job(), PolicyKnobs(interval=4), 1.0, 10.0)
    calibrated = CalibratedPolicy(inner, 0.25)
    regime, original = calibrated.regime(None), inner.regime(None)
    assert regime.interval == 4 and regime.overhead == pytest.approx(0.25)
    assert regime.recovery == original.recovery
    with pytest.raises(ConfigError, match="must be >= 0"):
        CalibratedPolicy(inner, -0.1)


def test_policies_are_planned_with_the_knobs_the_run_used() -> None:
    job = tiny_job()
    assert plan_measured("moevement", job, PolicyKnobs(window=3), 1.0, 10.0).regime(
        None).window == 3
    assert plan_measured("gemini", job, PolicyKnobs(interval=7), 1.0, 10.0).regime(
        None).interval == 7
    moc = plan_measured("moc", job, PolicyKnobs(experts_per_layer=2), 1.0, 10.0)
    assert "K=2/8" in moc.regime(moc.initial_state()).note
    with pytest.raises(ConfigError, match="policy 'none' has no simulator model"):
        plan_measured("none", job, PolicyKnobs(), 1.0, 10.0)


def test_fixed_window_captures_every_operator_once_in_w_snapshots() -> None:
    stage = tiny_job().stages[0]
    for window in (1, 3, len(stage.operators)):
        schedule = fixed_window(stage.operators, stage.ranks, window)
        assert schedule.window == window
        assert len(schedule.snapshot_bytes) == window
    with pytest.raises(ConfigError, match="window W=0"):
        fixed_window(stage.operators, 1, 0)


def test_same_failures_prediction_charges_each_failure_its_expected_recovery() -> None:
    policy = CalibratedPolicy(plan_measured("gemini", tiny_job(), PolicyKnobs(interval=4),
                                            1.0, 10.0), 0.1)
    expected = policy.regime(None).recovery.expected_s
    ettr, recovering = same_failures_ettr(policy, [3, 9], steps=20, iteration_s=0.07)
    assert recovering == pytest.approx(2 * expected)
    assert ettr == pytest.approx(20 * 0.07 / (20 * 0.07 * 1.1 + 2 * expected))
    assert same_failures_ettr(policy, [], 20, 0.07)[0] == pytest.approx(1 / 1.1)
    with pytest.raises(ConfigError, match="outside the run"):
        same_failures_ettr(policy, [21], 20, 0.07)


def test_prediction_uses_the_measured_overhead_and_mtbf_in_working_seconds() -> None:
    run = MeasuredRun.from_metrics(metrics(), "gemini")
    policy = plan_measured("gemini", tiny_job(), PolicyKnobs(interval=4), 1.0, run.loop_s)
    predicted = predict(policy, run, useful_s=1.2, mtbf_steps=10, mc_runs=50,
                        rng=np.random.default_rng(0))
    assert predicted.mtbf_s == pytest.approx(10 * 1.5 / 20)
    regime = policy.regime(None)
    assert predicted.analytic == pytest.approx(ettr_formula(
        0.25 * regime.iteration_s * 4, regime.iteration_s, 4, regime.recovery.expected_s,
        predicted.mtbf_s))
    assert 0 < predicted.mc_p5 <= predicted.mc_mean <= predicted.mc_p95 <= 1
    assert math.isfinite(predicted.same_failures)


def test_profile_document_round_trips_through_the_simulators_loader(tmp_path: Path) -> None:
    document = profile_document([(0.01, 0.02), (0.011, 0.021)], model="tiny", pp=2,
                                microbatches=4, iteration_s=0.2, optimizer_s=0.004,
                                bandwidth_gbps={"device_to_host": 50.0}, hardware="cpu")
    written = write_profile(tmp_path / "profile.json", document)
    loaded = load_profile(tmp_path / "profile.json")
    assert loaded.stages == written.stages and loaded.iteration_s == 0.2
    assert loaded.grad_sync_s is None and loaded.bandwidth_gbps == {"device_to_host": 50.0}
    with pytest.raises(ConfigError, match=r"stages\[0\]\.forward_s=-1"):
        profile_document([(-1, 0.02)])
