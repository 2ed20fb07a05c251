"""Reading the ``sim`` config node (``conf/sim/*.yaml``) into validated simulator settings.

:class:`SimSettings` holds what every simulated job shares (precision, replicas, MTBFs,
run length, popularity skew, failure source, Monte-Carlo size, policy knobs, batch shape,
calibration constants);
:func:`model_config` resolves a model given by preset name (``conf/model/<name>.yaml``)
or inline mapping; :func:`make_job` combines a model, a plan and the settings into a
:class:`SimJob`. Every bad value raises :class:`ConfigError` naming its ``sim.*`` key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from lightning_moe_ckpt.errors import ConfigError, fmt, require
from lightning_moe_ckpt.models.config import MoEModelConfig
from lightning_moe_ckpt.sim.calibration import NEUTRAL, Calibration
from lightning_moe_ckpt.sim.inputs import ClusterSpec, JobPlan, precision_spec
from lightning_moe_ckpt.sim.job import JobSpec, SimJob, build_job
from lightning_moe_ckpt.sim.policies import PolicySettings, check_policy_names
from lightning_moe_ckpt.sim.popularity import parse_popularity
from lightning_moe_ckpt.sim.profile import MeasuredProfile, load_profile
from lightning_moe_ckpt.sim.trace import load_failure_trace

_KNOWN_KEYS = {"precision", "replicas", "policies", "mtbf_minutes", "run_hours", "popularity",
               "popularity_seed", "grad_sync_overlap", "restart_s", "profile", "failures",
               "monte_carlo", "policy", "batch", "models", "plans", "interval_sweep", "scale",
               "calibration"}


def parse_minutes(values: object, key: str) -> tuple[float, ...]:
    require(isinstance(values, (list, tuple)) and len(values) > 0,
            f"{fmt(key, values)} must be a non-empty list of minutes")
    assert isinstance(values, (list, tuple))
    for value in values:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
        require(ok and math.isfinite(value), f"{key} entry {value!r}: MTBF must be > 0 minutes")
    return tuple(float(v) for v in values)


def _number(values: Mapping[str, Any], name: str, default: float, key: str) -> float:
    value = values.get(name, default)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    require(ok, f"{fmt(key + '.' + name, value)} must be a number")
    return float(value)


@dataclass(frozen=True)
class SimSettings:
    """Settings shared by every job of one simulation."""

    precision: str
    replicas: int
    policies: tuple[str, ...]
    mtbf_minutes: tuple[float, ...]
    run_s: float
    popularity: Mapping[str, Any]
    popularity_seed: int
    grad_sync_overlap: float
    restart_s: float
    profile: MeasuredProfile | None
    trace: tuple[float, ...] | None
    mc_runs: int
    mc_seed: int
    policy: PolicySettings
    batch: Mapping[str, Any]
    calibration: Calibration = NEUTRAL

    @classmethod
    def from_mapping(cls, sim: Mapping[str, Any], key: str = "sim") -> SimSettings:
        unknown = sorted(set(sim) - _KNOWN_KEYS)
        require(not unknown, f"unknown key(s) {', '.join(key + '.' + k for k in unknown)}")
        run_hours = sim.get("run_hours", 12)
        require(isinstance(run_hours, (int, float)) and run_hours > 0,
                f"{fmt(key + '.run_hours', run_hours)} must be > 0")
        failures = dict(sim.get("failures") or {})
        mode = failures.get("mode", "poisson")
        require(mode in ("poisson", "trace"),
                f"{fmt(key + '.failures.mode', mode)} must be 'poisson' or 'trace'")
        trace = None
        if mode == "trace":
            path = failures.get("trace")
            require(path is not None, f"{key}.failures.mode=trace needs {key}.failures.trace")
            trace = load_failure_trace(str(path), f"{key}.failures.trace")
        carlo = dict(sim.get("monte_carlo") or {})
        runs = carlo.get("runs", 200)
        require(isinstance(runs, int) and runs >= 2,
                f"{fmt(key + '.monte_carlo.runs', runs)} must be an integer >= 2")
        seed = int(_number(carlo, "seed", 0, key + ".monte_carlo"))
        profile = sim.get("profile")
        replicas = sim.get("replicas", 2)
        require(isinstance(replicas, int) and replicas >= 0,
                f"{fmt(key + '.replicas', replicas)} must be an integer >= 0")
        return cls(
            precision=str(sim.get("precision", "bf16-master")),
            replicas=replicas,
            policies=check_policy_names(sim.get("policies"), f"{key}.policies"),
            mtbf_minutes=parse_minutes(sim.get("mtbf_minutes"), f"{key}.mtbf_minutes"),
            run_s=float(run_hours) * 3600.0,
            popularity=dict(sim.get("popularity") or {}),
            popularity_seed=int(_number(sim, "popularity_seed", 0, key)),
            grad_sync_overlap=_number(sim, "grad_sync_overlap", 0.0, key),
            restart_s=_number(sim, "restart_s", 0.0, key),
            profile=None if profile is None else load_profile(str(profile), f"{key}.profile"),
            trace=trace, mc_runs=runs, mc_seed=seed,
            policy=PolicySettings.from_mapping(sim.get("policy"), f"{key}.policy"),
            batch=dict(sim.get("batch") or {}),
            calibration=Calibration.from_mapping(sim.get("calibration"), f"{key}.calibration"))


def model_config(spec: str | Mapping[str, Any], conf_dir: Path, key: str) -> MoEModelConfig:
    """A model by preset name (``conf/model/<name>.yaml``) or as an inline mapping."""
    if isinstance(spec, Mapping):
        return MoEModelConfig.from_mapping(spec)
    path = conf_dir / "model" / f"{spec}.yaml"
    if not path.is_file():
        presets = sorted(p.stem for p in (conf_dir / "model").glob("*.yaml"))
        raise ConfigError(f"{fmt(key, spec)} is not a model preset; choose one of "
                          f"{', '.join(presets)} (conf/model/)")
    values = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert isinstance(values, dict)
    return MoEModelConfig.from_mapping({str(k): v for k, v in values.items()})


def make_job(model: MoEModelConfig, plan_values: Mapping[str, Any], settings: SimSettings,
             cluster: ClusterSpec, key: str, use_profile: bool = True) -> SimJob:
    """Build the job of ``model`` on ``cluster`` with ``plan_values`` (the batch shape
    defaults to ``sim.batch``); ``use_profile=False`` ignores ``sim.profile`` (jobs other
    than the profiled one, such as the scale study's)."""
    require(isinstance(plan_values, Mapping), f"{key} must be a mapping with pp, dp, ep")
    plan = JobPlan.from_mapping({**settings.batch, **plan_values}, key)
    precision = precision_spec(settings.precision, cluster)
    alpha = parse_popularity(settings.popularity, model.n_experts)
    spec = JobSpec(model=model, plan=plan, cluster=cluster, precision=precision,
                   replicas=settings.replicas, popularity_alpha=alpha,
                   popularity_seed=settings.popularity_seed,
                   grad_sync_overlap=settings.grad_sync_overlap, restart_s=settings.restart_s,
                   profile=settings.profile if use_profile else None,
                   calibration=settings.calibration, key=key)
    return build_job(spec)
