"""The simulator's studies, run from a resolved Hydra config.

:func:`simulate` produces a :class:`SimulationReport` with three studies:

* the policy table (paper Table 3 shape): for each model of ``sim.models`` and each MTBF,
  every policy's checkpoint interval, per-iteration overhead, total recovery time over the
  run and ETTR, analytic and Monte-Carlo (mean and standard deviation over runs);
* the interval sweep (Fig. 1b shape): ETTR of a dense policy against its checkpoint
  interval for several MTBFs, with the best interval of each;
* the scale study (Fig. 11 shape): analytic ETTR of DeepSeek-style models from 32B to
  671B parameters on 512 to 16,384 GPUs (``sim.scale``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightning_moe_ckpt.errors import ConfigError, fmt, require
from lightning_moe_ckpt.models.config import MoEModelConfig
from lightning_moe_ckpt.planning.intervals import ettr_formula
from lightning_moe_ckpt.sim.dense_policies import checkfreq_regime, gemini_regime
from lightning_moe_ckpt.sim.ettr import analytic_ettr, monte_carlo_ettr, trace_ettr
from lightning_moe_ckpt.sim.inputs import ClusterSpec
from lightning_moe_ckpt.sim.job import SimJob
from lightning_moe_ckpt.sim.policies import check_policy_names, make_policy
from lightning_moe_ckpt.sim.trace import trace_mtbf_s
from moe_recipes.sim.settings import SimSettings, make_job, model_config, parse_minutes


@dataclass(frozen=True)
class PolicyOutcome:
    """One policy on one job at one MTBF."""

    policy: str
    interval: int  # iterations between checkpoints
    window: int  # iterations per complete checkpoint
    note: str  # policy detail in force at the end of the run (W, K, S, ...)
    overhead: float  # runtime overhead fraction, averaged over the run (MoC's grows with K)
    overhead_s: float  # overhead seconds per iteration, averaged over the run
    recovery_s: float  # expected recovery per failure
    total_recovery_s: float  # expected over the run
    ettr: float  # analytic
    mc_ettr_mean: float
    mc_ettr_std: float
    mc_ettr_p5: float
    mc_ettr_p95: float
    mc_total_recovery_s: float


@dataclass(frozen=True)
class JobSummary:
    """What the table's numbers rest on, per model."""

    model: str
    params: int
    gpus: int
    plan: str
    iteration_s: float
    pipeline_s: float
    sync_s: float
    update_s: float
    dense_bytes_per_gpu: float


@dataclass(frozen=True)
class TableRow:
    model: str
    mtbf_minutes: float
    outcomes: dict[str, PolicyOutcome]


@dataclass(frozen=True)
class SweepCurve:
    mtbf_minutes: float
    intervals: tuple[int, ...]
    ettr: tuple[float, ...]
    best_interval: int
    best_ettr: float


@dataclass(frozen=True)
class ScalePoint:
    label: str
    gpus: int
    params: int
    iteration_s: float
    mtbf_minutes: float
    ettr: dict[str, float]


@dataclass(frozen=True)
class SimulationReport:
    hardware: str
    precision: str
    run_hours: float
    failures: str  # "poisson" or "trace"
    mc_runs: int
    jobs: tuple[JobSummary, ...]
    rows: tuple[TableRow, ...]
    sweep_model: str
    sweep_policy: str
    sweep: tuple[SweepCurve, ...]
    scale: tuple[ScalePoint, ...]


def summarize(name: str, job: SimJob) -> JobSummary:
    plan, time = job.plan, job.time
    return JobSummary(name, job.total_params, plan.world_size,
                      f"(pp,dp,ep)=({plan.pp},{plan.dp},{plan.ep}) M={plan.microbatches}",
                      time.iteration_s, time.pipeline_s, time.sync_s, time.update_s,
                      job.dense_bytes_per_gpu)


def evaluate(job: SimJob, settings: SimSettings, mtbf_s: float,
             rng: np.random.Generator) -> dict[str, PolicyOutcome]:
    """Every configured policy on ``job`` at ``mtbf_s``: analytic and Monte-Carlo."""
    outcomes = {}
    for name in settings.policies:
        policy = make_policy(name, job, mtbf_s, settings.run_s, settings.policy)
        regime = policy.regime(policy.initial_state())
        analytic = analytic_ettr(policy, mtbf_s, settings.run_s)
        if settings.trace is not None:
            carlo = trace_ettr(policy, settings.trace, settings.run_s, rng, settings.mc_runs)
        else:
            carlo = monte_carlo_ettr(policy, mtbf_s, settings.run_s, settings.mc_runs, rng)
        outcomes[name] = PolicyOutcome(
            name, regime.interval, regime.window, analytic.final_note, analytic.mean_overhead,
            analytic.mean_overhead * regime.iteration_s, regime.recovery.expected_s,
            analytic.total_recovery_s, analytic.ettr, carlo.mean, carlo.std,
            carlo.percentile(5), carlo.percentile(95), float(carlo.total_recovery_s.mean()))
    return outcomes


def interval_sweep(job: SimJob, policy: str, mtbf_minutes: tuple[float, ...],
                   max_interval: int) -> tuple[SweepCurve, ...]:
    """ETTR of a dense policy at every interval 1..``max_interval`` for each MTBF."""
    regime_of = {"gemini": gemini_regime, "checkfreq": checkfreq_regime}[policy]
    intervals = tuple(range(1, max_interval + 1))
    regimes = [regime_of(job, n) for n in intervals]
    curves = []
    for minutes in mtbf_minutes:
        values = tuple(ettr_formula(r.overhead_s_per_iteration, r.iteration_s, 1,
                                    r.recovery.expected_s, minutes * 60) for r in regimes)
        best = int(np.argmax(values))
        curves.append(SweepCurve(minutes, intervals, values, intervals[best], values[best]))
    return tuple(curves)


def _model_and_plan(name: str, entry: Any, conf_dir: Path,
                    key: str) -> tuple[MoEModelConfig, dict[str, Any]]:
    require(isinstance(entry, Mapping), f"{key} must be a mapping (pp, dp, ep, optional model)")
    plan = dict(entry)
    if "model" in plan:
        return model_config(plan.pop("model"), conf_dir, f"{key}.model"), plan
    return model_config(name, conf_dir, "sim.models"), plan


def scale_study(scale: Mapping[str, Any], settings: SimSettings, cluster: ClusterSpec,
                conf_dir: Path, key: str = "sim.scale") -> tuple[ScalePoint, ...]:
    """Analytic ETTR per configuration, MTBF and policy."""
    policies = check_policy_names(scale.get("policies"), f"{key}.policies")
    minutes = parse_minutes(scale.get("mtbf_minutes"), f"{key}.mtbf_minutes")
    configs = scale.get("configs")
    require(isinstance(configs, list) and len(configs) > 0,
            f"{key}.configs must be a non-empty list")
    assert isinstance(configs, list)
    points = []
    for index, entry in enumerate(configs):
        where = f"{key}.configs[{index}]"
        require(isinstance(entry, Mapping) and {"label", "model", "plan"} <= set(entry),
                f"{where} needs label, model and plan")
        model = model_config(entry["model"], conf_dir, f"{where}.model")
        job = make_job(model, entry["plan"], settings, cluster, f"{where}.plan", use_profile=False)
        for mtbf in minutes:
            ettr = {name: analytic_ettr(make_policy(name, job, mtbf * 60, settings.run_s,
                                                    settings.policy), mtbf * 60,
                                        settings.run_s).ettr for name in policies}
            points.append(ScalePoint(str(entry["label"]), job.plan.world_size,
                                     job.total_params, job.iteration_s, mtbf, ettr))
    return tuple(points)


def _build_jobs(sim: Mapping[str, Any], settings: SimSettings, cluster: ClusterSpec,
                conf_dir: Path) -> dict[str, SimJob]:
    """One job per name in ``sim.models``, with its plan from ``sim.plans``."""
    models, plans = sim.get("models"), sim.get("plans") or {}
    require(isinstance(models, (list, tuple)) and len(models) > 0,
            f"{fmt('sim.models', models)} must be a non-empty list of job names")
    require(isinstance(plans, Mapping), "sim.plans must map job names to parallel plans")
    assert isinstance(models, (list, tuple)) and isinstance(plans, Mapping)
    jobs: dict[str, SimJob] = {}
    for name in map(str, models):
        if name not in plans:
            raise ConfigError(f"{fmt('sim.models', name)} has no parallel plan: set "
                              f"sim.plans.{name} (known plans: {', '.join(map(str, plans))})")
        model, plan = _model_and_plan(name, plans[name], conf_dir, f"sim.plans.{name}")
        jobs[name] = make_job(model, plan, settings, cluster, f"sim.plans.{name}")
    return jobs


def _sweep_settings(sweep: Mapping[str, Any], jobs: Mapping[str, SimJob],
                    default_minutes: tuple[float, ...]) -> tuple[str, str, tuple[float, ...], int]:
    """(model, policy, MTBFs, max interval) of ``sim.interval_sweep``, validated."""
    model = str(sweep.get("model") or next(iter(jobs)))
    policy = str(sweep.get("policy") or "gemini")
    if model not in jobs:
        raise ConfigError(f"{fmt('sim.interval_sweep.model', model)} is not one of "
                          f"sim.models ({', '.join(jobs)}); set it to one of them")
    require(policy in ("gemini", "checkfreq"),
            f"{fmt('sim.interval_sweep.policy', policy)} must be a dense policy "
            f"(gemini or checkfreq): only they have a free checkpoint interval")
    max_interval = sweep.get("max_interval", 300)
    require(isinstance(max_interval, int) and max_interval >= 1,
            f"{fmt('sim.interval_sweep.max_interval', max_interval)} must be an integer >= 1")
    minutes = parse_minutes(sweep.get("mtbf_minutes") or list(default_minutes),
                            "sim.interval_sweep.mtbf_minutes")
    return model, policy, minutes, max_interval


def simulate(cfg: Mapping[str, Any], conf_dir: Path) -> SimulationReport:
    """Run every study of a resolved config (``{hardware: ..., sim: ...}``); model presets
    are read from ``conf_dir / "model"``."""
    hardware = cfg.get("hardware")
    require(isinstance(hardware, Mapping) and isinstance(hardware.get("cluster"), Mapping),
            "hardware.cluster is missing: pick a preset with a cluster block (hardware=a100)")
    assert isinstance(hardware, Mapping)
    cluster = ClusterSpec.from_mapping(hardware["cluster"], name=str(hardware.get("name", "")))
    sim = cfg.get("sim")
    require(isinstance(sim, Mapping), "the config has no sim node (conf/sim/*.yaml)")
    assert isinstance(sim, Mapping)
    settings = SimSettings.from_mapping(sim)
    jobs = _build_jobs(sim, settings, cluster, conf_dir)
    sweep_model, sweep_policy, sweep_minutes, max_interval = _sweep_settings(
        dict(sim.get("interval_sweep") or {}), jobs, settings.mtbf_minutes)
    mtbfs = settings.mtbf_minutes
    if settings.trace is not None:  # one row per job, at the trace's mean MTBF
        mtbfs = (trace_mtbf_s(settings.trace, settings.run_s) / 60,)
        require(np.isfinite(mtbfs[0]), "sim.failures.trace has no failure within sim.run_hours")
    rng = np.random.default_rng(settings.mc_seed)
    rows = tuple(TableRow(name, minutes, evaluate(job, settings, minutes * 60, rng))
                 for name, job in jobs.items() for minutes in mtbfs)
    sweep = interval_sweep(jobs[sweep_model], sweep_policy, sweep_minutes, max_interval)
    scale = scale_study(sim["scale"], settings, cluster, conf_dir) if sim.get("scale") else ()
    return SimulationReport(
        hardware=cluster.name, precision=settings.precision, run_hours=settings.run_s / 3600,
        failures="trace" if settings.trace is not None else "poisson",
        mc_runs=settings.mc_runs, jobs=tuple(summarize(n, j) for n, j in jobs.items()),
        rows=rows, sweep_model=sweep_model, sweep_policy=sweep_policy, sweep=sweep,
        scale=scale)
