"""Simulator inputs: bad configs raise ConfigError naming the key; profiles calibrate."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.models.config import MoEModelConfig
from lightning_moe_ckpt.sim import (
    ClusterSpec,
    JobPlan,
    JobSpec,
    PolicySettings,
    build_job,
    load_profile,
    make_policy,
)
from lightning_moe_ckpt.sim.inputs import precision_spec
from lightning_moe_ckpt.sim.profile import PROFILE_SCHEMA
from moe_recipes.sim.experiments import simulate

CONF = Path(__file__).resolve().parents[2] / "conf"


@functools.cache
def base_config() -> dict[str, Any]:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="simulate")
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    return resolved


def cluster(name: str = "a100") -> ClusterSpec:
    return ClusterSpec.from_mapping(OmegaConf.load(CONF / f"hardware/{name}.yaml").cluster,
                                    name=name)


def model(name: str) -> MoEModelConfig:
    return MoEModelConfig.from_mapping(
        OmegaConf.to_container(OmegaConf.load(CONF / f"model/{name}.yaml")))


def plan(**values: Any) -> JobPlan:
    merged = {"pp": 12, "dp": 1, "ep": 8, "global_batch": 512, "micro_batch": 32,
              "seq_len": 2048, **values}
    return JobPlan.from_mapping(merged, "sim.models.deepseek_moe")


def simulate_with(**sim_changes: Any) -> None:
    cfg = copy.deepcopy(base_config())
    cfg["sim"].update(sim_changes)
    simulate(cfg, CONF)


@pytest.mark.parametrize(("changes", "message"), [
    ({"policies": ["moevement", "nope"]}, "sim.policies='nope' is not a known policy"),
    ({"policies": []}, "sim.policies"),
    ({"models": ["foo"], "plans": {"foo": {"pp": 1, "dp": 1, "ep": 1}}},
     "sim.models='foo' is not a model preset"),
    ({"models": ["deepseek_moe", "bar"]}, "sim.models='bar' has no parallel plan"),
    ({"models": ["x"], "plans": {"x": {"pp": 1, "dp": 1, "ep": 1, "model": "nope"}}},
     "sim.plans.x.model='nope' is not a model preset"),
    ({"mtbf_minutes": [30, 0]}, "sim.mtbf_minutes entry 0: MTBF must be > 0"),
    ({"mtbf_minutes": [-10]}, "sim.mtbf_minutes"),
    ({"replicas": -1}, "sim.replicas=-1"),
    ({"run_hours": 0}, "sim.run_hours=0"),
    ({"precision": "fp4"}, "sim.precision='fp4'"),
    ({"policy": {"checkfreq": {"cap": 0.1}}}, "sim.policy.checkfreq.cap"),
    ({"failures": {"mode": "weibull"}}, "sim.failures.mode='weibull'"),
    ({"interval_sweep": {"model": "deepseek_moe", "policy": "moevement"}},
     "sim.interval_sweep.policy='moevement'"),
    ({"bogus": 1}, "sim.bogus"),
])
def test_bad_sim_config_names_the_key(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("'", ".")):
        simulate_with(**changes)


def test_plan_must_fit_the_gpu_count() -> None:
    with pytest.raises(ConfigError, match=r"sim\.models\.deepseek_moe\.gpus=100 .*pp\*dp\*ep"):
        plan(gpus=100)  # the scale study's plans state their GPU count
    assert plan(gpus=96).world_size == 96


@pytest.mark.parametrize(("values", "message"), [
    ({"pp": 29}, r"pp=29 exceeds model\.n_layers=28"),
    ({"ep": 3, "micro_batch": 48, "global_batch": 480}, r"ep=3 must divide model\.n_experts=64"),
    ({"seq_len": 4096}, r"seq_len=4096 exceeds model\.max_seq_len=2048"),
])
def test_plan_must_hold_the_model(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan(**values).check_model(model("deepseek_moe"), "sim.models.deepseek_moe")


@pytest.mark.parametrize(("values", "message"), [
    ({"dp": 4, "ep": 16}, r"micro_batch=32 must be divisible by dp\*ep=64"),
    ({"global_batch": 500}, r"global_batch=500 must be a multiple"),
    ({"pp": 0}, r"pp=0 must be a positive integer"),
])
def test_plan_shape_errors(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan(**values)


def test_cluster_keys_are_checked() -> None:
    values = dict(OmegaConf.to_container(OmegaConf.load(CONF / "hardware/a100.yaml").cluster))
    del values["mfu"]
    with pytest.raises(ConfigError, match=r"hardware\.cluster\.mfu is missing"):
        ClusterSpec.from_mapping(values)
    values["mfu"] = 1.5
    with pytest.raises(ConfigError, match=r"hardware\.cluster\.mfu=1\.5"):
        ClusterSpec.from_mapping(values)


def test_policy_lookup_errors() -> None:
    job = build_job(JobSpec(model("moe_llava"), plan(pp=6, dp=2), cluster(),
                            precision_spec("bf16-master", cluster())))
    with pytest.raises(ConfigError, match=r"sim\.policies='raid'"):
        make_policy("raid", job, 600.0, 3600.0)
    with pytest.raises(ConfigError, match="MTBF must be > 0"):
        make_policy("gemini", job, 0.0, 3600.0)
    with pytest.raises(ConfigError, match=r"sim\.policy\.moc\.budget"):
        PolicySettings.from_mapping({"moc": {"budget": 1}})


def test_fp8_needs_fp8_hardware_and_shrinks_state_and_iterations() -> None:
    with pytest.raises(ConfigError, match=r"hardware\.cluster\.fp8_tflops=0"):
        precision_spec("fp8-fp16-fp32", cluster("a100"))
    h100 = cluster("h100")
    jobs = {name: build_job(JobSpec(model("deepseek_moe"), plan(pp=8, dp=2, micro_batch=32),
                                    h100, precision_spec(name, h100)))
            for name in ("bf16-master", "fp8-fp8-fp8fp16")}
    bf16, fp8 = jobs["bf16-master"], jobs["fp8-fp8-fp8fp16"]
    assert fp8.iteration_s < bf16.iteration_s
    # 4 bytes of master state (FP8 master, FP8 + FP16 moments) instead of 12 (Table 7).
    assert fp8.dense_bytes_total == pytest.approx(bf16.dense_bytes_total / 3)


def write_profile(path: Path, **changes: Any) -> Path:
    data = {"schema": PROFILE_SCHEMA, "version": 1, "model": "deepseek_moe", "pp": 12,
            "microbatches": 16,
            "stages": [{"forward_s": 0.05, "backward_s": 0.10} for _ in range(12)],
            "bandwidth_gbps": {"device_to_host": 100}, **changes}
    path.write_text(json.dumps(data))
    return path


def test_profile_replaces_modelled_stage_times(tmp_path: Path) -> None:
    profile = load_profile(write_profile(tmp_path / "profile.json"))
    spec = JobSpec(model("deepseek_moe"), plan(), cluster(),
                   precision_spec("bf16-master", cluster()), profile=profile)
    calibrated = build_job(spec)
    assert calibrated.cluster.device_to_host_gbps == 100
    for stage in calibrated.time.stages:
        assert stage.compute_s == pytest.approx(0.15)
        assert stage.all_to_all_s == 0.0  # already inside the measured time
    time = calibrated.time
    assert time.pipeline_s == pytest.approx((16 + 12 - 1) * time.slot_s)
    measured = build_job(JobSpec(spec.model, spec.plan, spec.cluster, spec.precision,
                                 profile=load_profile(write_profile(tmp_path / "t.json",
                                                                    iteration_s=4.2))))
    assert measured.iteration_s == 4.2


@pytest.mark.parametrize(("changes", "message"), [
    ({"schema": "other"}, "schema 'other'"),
    ({"version": 2}, "version 2"),
    ({"stages": []}, "non-empty 'stages'"),
    ({"stages": [{"forward_s": -1, "backward_s": 0.1}]}, r"forward_s=-1 must be"),
    ({"surprise": 1}, "unknown key"),
    ({"bandwidth_gbps": {"pcie": 1}}, r"bandwidth_gbps\.pcie is unknown"),
])
def test_bad_profiles_are_rejected(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_profile(write_profile(tmp_path / "p.json", **changes))


def test_profile_must_match_the_simulated_plan(tmp_path: Path) -> None:
    two_stages = [{"forward_s": 0.1, "backward_s": 0.2}] * 2
    profile = load_profile(write_profile(tmp_path / "p.json", stages=two_stages, pp=2))
    spec = JobSpec(model("deepseek_moe"), plan(), cluster(),
                   precision_spec("bf16-master", cluster()), profile=profile)
    with pytest.raises(ConfigError, match=r"sim\.profile=.*2 stage\(s\) but the plan has pp=12"):
        build_job(spec)
    with pytest.raises(ConfigError, match="no such profile file"):
        load_profile(tmp_path / "absent.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_profile(broken)
