"""Presenting a :class:`SimulationReport`: the Table 3 text table, three PNG plots, JSON.

The table mirrors the paper's Table 3: per model and MTBF, each policy's checkpoint
interval, per-iteration overhead, total recovery time over the run and ETTR, followed by
the Monte-Carlo ETTR (mean and standard deviation over runs). Plots use matplotlib's
non-interactive Agg backend: ETTR against the checkpoint interval (Fig. 1b), ETTR against
MTBF per policy, and ETTR against model scale (Fig. 11). ``simulate.json`` holds every
number behind them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after use("Agg"): the backend must be chosen first

from moe_recipes.sim.experiments import SimulationReport

LABELS = {"checkfreq": "CheckFreq", "gemini": "Gemini", "moc": "MoC", "moetion": "MoEtion",
          "moevement": "MoEvement"}
PLOT_FILES = ("ettr_vs_interval.png", "ettr_vs_mtbf.png", "ettr_vs_scale.png")


def _mtbf_label(minutes: float) -> str:
    if minutes >= 60 and minutes % 60 == 0:
        return f"{int(minutes // 60)}H"
    return f"{minutes:.0f}M" if minutes == int(minutes) else f"{minutes:.1f}M"


def _count(params: float) -> str:
    return f"{params / 1e9:6.2f}B" if params >= 1e8 else f"{params / 1e6:6.2f}M"


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


def _floor(values: list[float]) -> float:
    """Lower y limit: a tenth below the smallest value, so differences near 1 stay visible."""
    return max(0.0, math.floor((min(values) - 0.02) * 10) / 10)


def format_table(report: SimulationReport) -> str:
    """The Table 3 shaped text table, preceded by what each model's numbers rest on."""
    lines = [f"ETTR simulation: hardware={report.hardware} precision={report.precision} "
             f"run={report.run_hours:g} h failures={report.failures} "
             f"Monte-Carlo runs={report.mc_runs}", ""]
    for job in report.jobs:
        lines.append(f"  {job.model:<14} {_count(job.params)} params on {job.gpus} GPUs "
                     f"{job.plan}: T_iter {job.iteration_s:.3g} s = pipeline "
                     f"{job.pipeline_s:.3g} + grad sync {job.sync_s:.2g} + optimizer "
                     f"{job.update_s:.2g}; dense checkpoint {_size(job.dense_bytes_per_gpu)}/GPU")
    policies = list(report.rows[0].outcomes) if report.rows else []
    names = [LABELS.get(p, p)[:9] for p in policies]
    groups = [("Interval (iters)", 6), ("Overhead %", 6), ("Total recovery (s)", 7),
              ("ETTR", 6)]
    head1 = f"{'Model':<14}{'MTBF':>5} "
    head2 = " " * 20
    for title, width in groups:
        span = (width + 1) * len(policies)
        head1 += "| " + title.ljust(span)
        head2 += "| " + "".join(n[:width].rjust(width) + " " for n in names)
    head1 += "| Detail at end of run"
    head2 += "|"
    lines += ["", head1, head2, "-" * len(head1)]
    for row in report.rows:
        out = [row.outcomes[p] for p in policies]
        text = f"{row.model:<14}{_mtbf_label(row.mtbf_minutes):>5} "
        text += "| " + "".join(f"{o.interval:>6} " for o in out)
        text += "| " + "".join(f"{100 * o.overhead:>6.1f} " for o in out)
        text += "| " + "".join(f"{o.total_recovery_s:>7.0f} " for o in out)
        text += "| " + "".join(f"{o.ettr:>6.3f} " for o in out)
        text += "| " + ", ".join(f"{LABELS.get(o.policy, o.policy)} {o.note}"
                                 for o in out if o.note)
        lines.append(text)
    lines += ["", f"Monte-Carlo ETTR, mean ± sd over {report.mc_runs} runs of "
                  f"{report.run_hours:g} h ({report.failures} failures):",
              f"{'Model':<14}{'MTBF':>5} " + "".join(f"{n:>16}" for n in names)]
    for row in report.rows:
        cells = "".join(f"{row.outcomes[p].mc_ettr_mean:>9.3f} ±{row.outcomes[p].mc_ettr_std:.3f}"
                        for p in policies)
        lines.append(f"{row.model:<14}{_mtbf_label(row.mtbf_minutes):>5} {cells}")
    if report.scale:
        lines += ["", "Scale study (analytic ETTR):"]
        for point in report.scale:
            cells = "  ".join(f"{LABELS.get(p, p)} {v:.3f}" for p, v in point.ettr.items())
            lines.append(f"  {point.label:>5} ({_count(point.params).strip()}, {point.gpus} GPUs, "
                         f"T_iter {point.iteration_s:.2f} s) MTBF "
                         f"{_mtbf_label(point.mtbf_minutes):>4}: {cells}")
    return "\n".join(lines)


def plot_interval_sweep(report: SimulationReport, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for curve in report.sweep:
        label = (f"MTBF {_mtbf_label(curve.mtbf_minutes)} "
                 f"(best {curve.best_ettr:.3f} @ {curve.best_interval})")
        (line,) = ax.plot(curve.intervals, curve.ettr, label=label)
        ax.axhline(curve.best_ettr, color=line.get_color(), linestyle="--", linewidth=0.8)
    ax.set_xlabel("checkpoint interval (iterations)")
    ax.set_ylabel("ETTR")
    ax.set_title(f"{LABELS.get(report.sweep_policy, report.sweep_policy)} on "
                 f"{report.sweep_model} ({report.hardware})")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_ettr_vs_mtbf(report: SimulationReport, path: Path) -> None:
    models = list(dict.fromkeys(row.model for row in report.rows))
    columns = min(2, len(models))
    rows = (len(models) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4 * rows), squeeze=False)
    for ax, model in zip(axes.flat, models, strict=False):
        data = sorted((r for r in report.rows if r.model == model), key=lambda r: r.mtbf_minutes)
        minutes = [r.mtbf_minutes for r in data]
        for policy in data[0].outcomes:
            ax.errorbar(minutes, [r.outcomes[policy].mc_ettr_mean for r in data],
                        yerr=[r.outcomes[policy].mc_ettr_std for r in data], marker="o",
                        capsize=3, label=LABELS.get(policy, policy))
        ax.set_xscale("log")
        ax.set_xticks(minutes, [_mtbf_label(m) for m in minutes])
        ax.minorticks_off()
        ax.set_xlabel("MTBF")
        ax.set_ylabel("ETTR (Monte-Carlo mean ± sd)")
        ax.set_ylim(_floor([r.outcomes[p].mc_ettr_mean - r.outcomes[p].mc_ettr_std
                            for r in data for p in r.outcomes]), 1.0)
        ax.set_title(model)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_ettr_vs_scale(report: SimulationReport, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = list(dict.fromkeys(p.label for p in report.scale))
    ticks = [f"{label}\n{next(p.gpus for p in report.scale if p.label == label)} GPUs"
             for label in labels]
    minutes = sorted({p.mtbf_minutes for p in report.scale}, reverse=True)
    policies = list(report.scale[0].ettr) if report.scale else []
    styles = ["-", "--", ":", "-."]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, mtbf in enumerate(minutes):
        for j, policy in enumerate(policies):
            values = [next(p.ettr[policy] for p in report.scale
                           if p.label == label and p.mtbf_minutes == mtbf) for label in labels]
            ax.plot(range(len(labels)), values, marker="o", color=colors[i % len(colors)],
                    linestyle=styles[j % len(styles)],
                    label=f"{LABELS.get(policy, policy)}, MTBF {_mtbf_label(mtbf)}")
    ax.set_xticks(range(len(labels)), ticks)
    ax.set_ylabel("ETTR (analytic)")
    ax.set_ylim(_floor([v for p in report.scale for v in p.ettr.values()]), 1.0)
    ax.set_title(f"ETTR vs model scale ({report.hardware})")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(report: SimulationReport, out_dir: Path) -> list[Path]:
    """Write the three plots, ``simulate.json`` and ``table.txt`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / name for name in PLOT_FILES]
    plot_interval_sweep(report, paths[0])
    plot_ettr_vs_mtbf(report, paths[1])
    if report.scale:
        plot_ettr_vs_scale(report, paths[2])
    else:
        paths.pop()
    data = out_dir / "simulate.json"
    data.write_text(json.dumps(dataclasses.asdict(report), indent=1))
    table = out_dir / "table.txt"
    table.write_text(format_table(report) + "\n")
    return [*paths, data, table]
