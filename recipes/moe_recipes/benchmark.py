"""Measured vs predicted ETTR for ``recipes/bench.py``: from runs to the simulator and back.

The recipe trains; this module bridges a run's settings and ``metrics.json`` to the ETTR
simulator: :func:`measure_profile` measures the job's compute
(:mod:`moe_recipes.stage_profile`) and writes the profile file
``sim.profile`` reads; :func:`sim_job` builds the simulator's job for the run's model,
layout, batch, hardware preset and precision, calibrated with it; :func:`ettr_row` puts one
policy's measured ETTR (definitions in :mod:`lightning_moe_ckpt.sim.measured`) next to the
simulator's predictions; :func:`ettr_markdown` and :func:`simulate_command` report them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from lightning_moe_ckpt.sim.inputs import ClusterSpec, JobPlan, precision_spec
from lightning_moe_ckpt.sim.job import JobSpec, SimJob, build_job
from lightning_moe_ckpt.sim.measured import (
    MeasuredRun,
    PolicyKnobs,
    gap_pct,
    measure_ettr,
    plan_measured,
    predict,
    useful_seconds,
)
from lightning_moe_ckpt.sim.profile import MeasuredProfile, profile_document, write_profile
from moe_recipes.comparisons import COMPARISON_POLICIES
from moe_recipes.settings import RunSettings, settings_from_config
from moe_recipes.stage_profile import measure_compute


def measure_profile(settings: RunSettings, hardware: str, useful_s: float, path: Path,
                    threads: int | None) -> MeasuredProfile:
    """Measure this job's compute (on the run's accelerator: CUDA or the CPU) and write the
    simulator's profile file to ``path``."""
    device = "cuda" if settings.hardware.accelerator in ("cuda", "gpu") else "cpu"
    compute = measure_compute(settings, device=device, threads=threads)
    plan = settings.layout
    document = profile_document(
        [(stage.forward_s, stage.backward_s) for stage in compute.stages],
        model=settings.model.name, pp=plan.pp, microbatches=plan.microbatches,
        iteration_s=useful_s / settings.max_steps, optimizer_s=compute.optimizer_s,
        grad_sync_s=0.0 if plan.world_size == 1 else None,  # nothing to reduce alone
        bandwidth_gbps={"device_to_host": compute.device_to_host_bytes_per_s * 8 / 1e9},
        hardware=hardware)
    return write_profile(path, document)


def sim_plan(settings: RunSettings) -> dict[str, int]:
    """The run's layout and batch as a simulator plan (``sim.plans.<model>``)."""
    plan = settings.layout
    return {"pp": plan.pp, "dp": plan.dp * plan.dp_shard, "ep": plan.ep,
            "global_batch": settings.global_batch,
            "micro_batch": settings.global_batch // plan.microbatches,
            "seq_len": settings.data.seq_len}


def sim_job(cfg: DictConfig, settings: RunSettings, profile: MeasuredProfile) -> SimJob:
    """The simulator's job for a run's config, calibrated with ``profile``."""
    values = OmegaConf.to_container(cfg.hardware.cluster, resolve=True)
    assert isinstance(values, dict)
    cluster = ClusterSpec.from_mapping({str(k): v for k, v in values.items()},
                                       name=str(cfg.hardware.name))
    # Replicas live on other ranks: a single process keeps none (as the real run does).
    replicas = min(settings.checkpoint.replicas, settings.layout.world_size - 1)
    plan = JobPlan.from_mapping(sim_plan(settings), "plan")
    spec = JobSpec(model=settings.model, plan=plan, cluster=cluster,
                   precision=precision_spec(settings.precision, cluster), replicas=replicas,
                   profile=profile)
    return build_job(spec)


def knobs_of(settings: RunSettings, metrics: dict[str, Any]) -> PolicyKnobs:
    """What the run's policy used: W and interval as reported, MoC's K and budget as set."""
    options = settings.checkpoint.options
    return PolicyKnobs(window=metrics.get("window"),
                       interval=metrics.get("interval", options.get("interval")),
                       experts_per_layer=options.get("experts_per_layer"),
                       lost_token_budget=options.get("lost_token_budget"))


def ettr_row(policy: str, cfg: DictConfig, metrics: dict[str, Any], baseline: dict[str, Any],
             profile: MeasuredProfile, mtbf_steps: float, mc_runs: int) -> dict[str, Any]:
    """Measured vs predicted ETTR of one policy's run with failures."""
    settings = settings_from_config(cfg)
    run = MeasuredRun.from_metrics(metrics, policy)
    useful = useful_seconds(baseline, "none")
    measured = measure_ettr(run, useful)
    job = sim_job(cfg, settings, profile)
    # A peer (a dense checkpoint to disk every k steps, restart from the newest) is what
    # the simulator models as CheckFreq's regime at that k.
    modelled = "checkfreq" if settings.checkpoint.policy in COMPARISON_POLICIES else policy
    policy_model = plan_measured(modelled, job, knobs_of(settings, metrics),
                                 mtbf_steps * run.work_s / run.steps, run.loop_s)
    predicted = predict(policy_model, run, useful, mtbf_steps, mc_runs,
                        np.random.default_rng(0))
    recoveries = len(run.recovery_s)
    return {
        "policy": policy, "failures": run.failures, "failure_steps": list(run.failure_steps),
        "iterations_replayed": sum(run.replayed), "window": run.window,
        "interval": run.interval,
        "recovery_s_measured": sum(run.recovery_s) / recoveries if recoveries else 0.0,
        "recovery_s_predicted": predicted.expected_recovery_s,
        "recovery_iterations_predicted": predicted.expected_recovery_iterations,
        "overhead_pct_measured": 100 * measured.overhead,
        "overhead_pct_modelled": 100 * predicted.modelled_overhead,
        "lost_tokens": run.lost_tokens,
        "lost_token_pct": 100 * run.lost_token_share,
        "loss_exact": list(run.losses) == list(baseline["loss"]),
        "loss_finite": run.loss_finite,
        "ettr_measured": measured.ettr, "runtime_factor": measured.runtime,
        "recovery_factor": measured.recovery,
        "ettr_same_failures": predicted.same_failures,
        "gap_same_failures_pct": gap_pct(predicted.same_failures, measured.ettr),
        "ettr_analytic": predicted.analytic,
        "gap_analytic_pct": gap_pct(predicted.analytic, measured.ettr),
        "ettr_mc_mean": predicted.mc_mean, "ettr_mc_p5": predicted.mc_p5,
        "ettr_mc_p95": predicted.mc_p95, "mtbf_s": predicted.mtbf_s, "note": predicted.note,
    }


def ettr_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The measured-vs-predicted ETTR table."""
    lines = ["| policy | k or W | failures | replayed iters | recovery s/failure (measured / sim) "
             "| overhead % (measured / sim) | ETTR measured | sim, same failures (gap) "
             "| sim, analytic (gap) | sim MC p5-p95 | loss = fault-free |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        exact = "yes" if r["loss_exact"] else ("no" if r["loss_finite"] else "no (NaN)")
        if r["lost_tokens"]:
            exact += f", {r['lost_token_pct']:.2f}% tokens lost"
        lines.append(
            f"| {r['policy']} | {r['interval'] or r['window'] or '-'} | {r['failures']} "
            f"| {r['iterations_replayed']} "
            f"| {r['recovery_s_measured']:.3f} / {r['recovery_s_predicted']:.3f} "
            f"| {r['overhead_pct_measured']:.1f} / {r['overhead_pct_modelled']:.1f} "
            f"| {r['ettr_measured']:.3f} "
            f"| {r['ettr_same_failures']:.3f} ({r['gap_same_failures_pct']:+.1f}%) "
            f"| {r['ettr_analytic']:.3f} ({r['gap_analytic_pct']:+.1f}%) "
            f"| {r['ettr_mc_p5']:.3f}-{r['ettr_mc_p95']:.3f} | {exact} |")
    return lines


def simulate_command(settings: RunSettings, hardware: str, profile: Path, mtbf_s: float,
                     run_s: float) -> str:
    """The ``recipes/simulate.py`` invocation calibrated with the written profile, at the
    measured MTBF and run length (the simulator's own policy planning, not the knobs of
    these runs). ``~sim.calibration`` drops the constants fitted to the paper's A100
    cluster: this job's measured profile calibrates the simulator instead, and the measured
    comparison assumes the neutral model (line-rate copies, no interference, no restart)."""
    name = settings.model.name
    plan = ", ".join(f"{k}: {v}" for k, v in sim_plan(settings).items())
    return (f"python recipes/simulate.py hardware={hardware} sim.precision={settings.precision} "
            f"sim.replicas={min(2, settings.layout.world_size - 1)} sim.models=[{name}] "
            f"'+sim.plans.{name}={{{plan}}}' sim.profile={profile} "
            f"sim.interval_sweep.model={name} sim.mtbf_minutes=[{mtbf_s / 60:.4g}] "
            f"sim.run_hours={run_s / 3600:.4g} '~sim/scale' '~sim.calibration'")
