"""Benchmark checkpoint policies side by side: ``python recipes/bench.py [--quick] [options]
[overrides]``.

1. **Overhead.** Runs ``recipes/train.py`` once per policy of ``--policies`` plus
   ``checkpoint=none`` (each in its own process(es), one after another, no failures) on the
   same model, layout and data, and reports per policy: median iteration time and its
   ratio to ``none``, checkpoint stall, snapshot bytes per iteration, W, and host memory
   held by snapshots and replicas.
2. **Measured ETTR.** Runs every policy of ``--ettr-policies`` again over the same steps
   with ``faults=mtbf faults.mtbf_steps=--mtbf-steps`` and one failure seed for all
   (``--fault-seed``, default ``trainer.seed``), so every policy faces the same failures,
   and reports its measured ETTR against the ``none`` run next to what the ETTR simulator
   predicts for it, and the gap (definitions: :mod:`lightning_moe_ckpt.sim.measured`).
   The simulator is calibrated with this job's profile: per-stage forward/backward and
   optimizer times and the host-copy bandwidth, measured in this process
   (:mod:`moe_recipes.stage_profile`), and the ``none`` run's useful time
   per step. The profile is written as ``profile.json`` in the format ``sim.profile``
   reads, and the ``recipes/simulate.py`` command that uses it is printed.

**Peers** (``--peers``): what users run instead, ``lightning`` (Lightning's
``AsyncCheckpointIO``) and ``dcp`` (``torch.distributed.checkpoint.async_save``), each every
``k`` steps with ``k`` chosen both ways users choose it: ``-cap``, the smallest ``k`` keeping
the measured save cost within 3% of training time, and ``-oracle``, the best-ETTR ``k`` at
``--mtbf-steps`` (:mod:`moe_recipes.comparisons`); they recover by restarting from
the newest complete checkpoint and recomputing. They appear in both tables (fault-free runs
except with ``--quick``).

**Paired blocks** (``--paired-blocks N``): each of ``--policies`` also trains
``--paired-runs`` times with ``checkpoint.paired_blocks=N``, taking its snapshots in
alternate blocks of N steps only; each cycle of a block with and a block without snapshots
gives one ratio of mean iteration times, from steps seconds apart on the same processes, where
the overhead runs' ratios pair runs minutes apart (on shared cores the machine's speed drifts
by more than a few percent within minutes). The upstream log runs in both blocks.

**Real kills** (``--kind kill``, or ``--kind simulated kill`` for both tables): the ETTR
policies run again with ``faults.kind=kill`` on the same schedule, under the supervisor:
each failing worker is SIGKILLed, replaced by a new process and recovered. Their ETTR is
the ``none`` run's useful time over the supervisor's measured training time (first
iteration of every rank to the last worker's exit: recoveries, replacement start-up and
checkpointing included), next to the same policy supervised without failures; the final
state is compared bitwise with that run. Needs a multi-process layout (``parallel.pp=2``).

Writes ``bench.md``, ``bench.json``, ``bench.png`` and ``profile.json`` to ``--out``.
Extra arguments are Hydra overrides for every run (``parallel.pp=2 model=small``); one
prefixed with a policy name and a colon goes to that policy's runs only
(``gemini:checkpoint.interval=5``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.failures.forked_workers import WorkerForker
from lightning_moe_ckpt.sim.measured import loop_seconds, useful_seconds
from lightning_moe_ckpt.testing.faults import MtbfSchedule, schedule_from_config
from moe_recipes.benchmark import (
    ettr_markdown,
    ettr_row,
    measure_profile,
    simulate_command,
)
from moe_recipes.settings import RunSettings, settings_from_config
from moe_recipes.statistics import median_interval, paired_block_ratios
from moe_recipes.supervised import RECIPE_IMPORTS

REPO = Path(__file__).resolve().parents[1]
POLICIES = ("none", "moevement", "gemini", "checkfreq", "moc", "moetion")
ETTR_POLICIES = ("moevement", "gemini", "moc")
PEER_GROUPS = ("lightning", "dcp")
PEERS = tuple(f"{group}-{rule}" for group in PEER_GROUPS for rule in ("cap", "oracle"))
KINDS = ("simulated", "kill")


def run_spec(label: str, mtbf_steps: float) -> tuple[str, list[str]]:
    """The checkpoint group and the extra overrides of a run label (a policy, or a peer
    ``<group>-<rule>``: its ``k`` rule, and the MTBF the oracle plans for)."""
    if label not in PEERS:
        return label, []
    group, rule = label.rsplit("-", 1)
    return group, [f"checkpoint.interval={rule}", f"checkpoint.mtbf_steps={mtbf_steps}"]


def split_overrides(overrides: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Overrides for every run, and ``policy:checkpoint.<key>=<value>`` ones per policy (only
    the policy's own options: anything else would make its runs a different job than the
    ``none`` baseline)."""
    common: list[str] = []
    per_policy: dict[str, list[str]] = {}
    for override in overrides:
        head, sep, rest = override.partition(":")
        if sep and "=" not in head and "." not in head and "/" not in head:
            if head not in POLICIES + PEER_GROUPS:
                raise ConfigError(f"override {override!r} names policy {head!r}; choose one "
                                  f"of {', '.join(POLICIES + PEER_GROUPS)}")
            if not rest.lstrip("+~").startswith("checkpoint."):
                raise ConfigError(f"override {override!r}: a per-policy override may only set "
                                  "checkpoint.* options; give the others to every run")
            per_policy.setdefault(head, []).append(rest)
        else:
            common.append(override)
    return common, per_policy


def run_policy(policy: str, out: Path, steps: int, overrides: list[str],
               threads: int | None = None) -> dict[str, Any]:
    """Train with ``checkpoint=policy`` (``threads`` torch threads per process, default
    torch's); returns its metrics. The run is ``python recipes/train.py`` forked from this
    bench's fork server, which imported torch, Lightning, Hydra and the library once for
    every run (a fresh interpreter spends about 12 s of CPU on them here, outside the
    timed loop either way); its output goes to ``out/train.log``."""
    command = [sys.executable, str(REPO / "recipes" / "train.py"), f"checkpoint={policy}",
               f"out_dir={out.resolve()}", f"trainer.max_steps={steps}",
               f"trainer.val_every={steps}", "trainer.progress_bar=false", "api=fabric",
               *overrides]
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "train.log"
    log.unlink(missing_ok=True)
    run = WorkerForker(command, RECIPE_IMPORTS).start(env, cwd=REPO, output=log)
    try:
        code = run.wait()
    except BaseException:  # interrupted: the run ends with the bench
        run.kill()
        raise
    if code != 0:
        tail = log.read_text()[-3000:] if log.exists() else "(no log was written)"
        raise RuntimeError(f"checkpoint={policy} failed (exit {code}), the end of {log}:\n"
                           f"{tail}")
    metrics: dict[str, Any] = json.loads((out / "metrics.json").read_text())
    return metrics


def compose_train(policy: str, steps: int, overrides: list[str]) -> DictConfig:
    """The composed ``conf/train.yaml`` of a run, in this process (nothing is launched)."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose("train", overrides=[f"checkpoint={policy}", "out_dir=outputs/bench",
                                           f"trainer.max_steps={steps}", *overrides])


def fault_overrides(mtbf_steps: float, seed: int | None) -> list[str]:
    """The failure schedule every policy's ETTR run gets."""
    extra = [] if seed is None else [f"faults.seed={seed}"]
    return ["faults=mtbf", f"faults.mtbf_steps={mtbf_steps}", *extra]


def planned_failures(settings: RunSettings) -> list[int]:
    """Steps of the run's failure schedule; refuses a run no failure reaches, and one where
    every worker of a multi-process job fails at once (nothing survives to hold the
    in-memory checkpoints, so the run would stop there with an error)."""
    world = settings.layout.world_size
    schedule = schedule_from_config(settings.faults, world_size=world,
                                    max_steps=settings.max_steps, seed=settings.seed)
    assert isinstance(schedule, MtbfSchedule)
    steps = sorted({event.step for event in schedule.events})
    if not steps:
        raise ConfigError(f"--mtbf-steps={schedule.mtbf_steps:g} puts no failure within "
                          f"--steps={settings.max_steps} for this seed: lower --mtbf-steps, "
                          "raise --steps or change --fault-seed")
    whole = [step for step in steps
             if len({event.rank for event in schedule.events_at(step)}) == world > 1]
    if whole:
        raise ConfigError(f"--mtbf-steps={schedule.mtbf_steps:g} with this seed fails all "
                          f"{world} workers at once at step(s) {whole}: no survivor would "
                          "hold the in-memory checkpoints to recover from; raise "
                          "--mtbf-steps or change --fault-seed")
    return steps


def check_moevement(metrics: dict[str, Any], key: str) -> None:
    """Refuse a moevement run that bought its speed with protection: every window must
    capture every operator exactly once, every piece must be checksummed and, with
    replica peers, every snapshot replicated (counted by the run, in ``metrics.json``)."""
    problems = []
    if metrics["windows_not_covered"] or not metrics["windows_covered"]:
        problems.append(f"{metrics['windows_not_covered']} window(s) without every operator "
                        f"captured once ({metrics['windows_covered']} covered)")
    if metrics["pieces_checksummed"] != metrics["pieces_issued"]:
        problems.append(f"{metrics['pieces_checksummed']} of {metrics['pieces_issued']} "
                        "pieces checksummed")
    if metrics["replica_peers"] and metrics["snapshots_replicated"] != metrics["snapshots_taken"]:
        problems.append(f"{metrics['snapshots_replicated']} of {metrics['snapshots_taken']} "
                        "snapshots replicated")
    if problems:
        raise RuntimeError(f"{key}: " + "; ".join(problems))


def summarise(repeats: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per fault-free policy, ratios against ``none``. With several repeats (each
    a run of every policy, in a rotated order) the row's iteration time is the median of
    the runs' medians and ``vs_none`` the median of the per-repeat ratios: pairing each
    run with the ``none`` run of its own repeat cancels the machine's slow drift, which
    on shared cores is larger than a few percent between runs minutes apart."""
    results = repeats[0]
    rows = []
    for policy, metrics in results.items():
        medians = [runs[policy]["iteration_ms"]["median"] for runs in repeats]
        ratios = [runs[policy]["iteration_ms"]["median"] / runs["none"]["iteration_ms"]["median"]
                  for runs in repeats]
        cpu, cpu_ratios = _paired_cpu(repeats, policy, "total")
        thread_cpu, thread_cpu_ratios = _paired_cpu(repeats, policy, "training_thread_total")
        rows.append({
            "policy": policy,
            "interval": metrics.get("interval"),
            "iteration_ms": float(np.median(medians)),
            "vs_none": float(np.median(ratios)),
            "vs_none_runs": ratios,
            # Where the true median ratio lies with >= 95% confidence (None: too few
            # repeats, under 6): whether a bound such as 1.03x is shown, missed or unsettled.
            "vs_none_interval": median_interval(ratios),
            # CPU time of every rank's process (all threads) per iteration: the work a
            # policy adds, steadier than wall time where ranks outnumber cores.
            "cpu_ms_per_iteration": cpu,
            "cpu_vs_none": float(np.median(cpu_ratios)) if cpu_ratios else None,
            "cpu_vs_none_runs": cpu_ratios,
            "cpu_vs_none_interval": median_interval(cpu_ratios),
            # ... and the training threads' own: whether the checkpoint threads beside them
            # slow their host work down (cores, caches), apart from their own CPU time.
            "training_thread_cpu_ms_per_iteration": thread_cpu,
            "training_thread_cpu_vs_none": (float(np.median(thread_cpu_ratios))
                                            if thread_cpu_ratios else None),
            "training_thread_cpu_vs_none_runs": thread_cpu_ratios,
            # Rank 0's snapshot copy and replication threads: their own CPU time, which
            # moves far less between runs than whole-process ratios; with the training
            # thread's in the checkpoint's step hooks, what its snapshots cost in CPU.
            "copy_thread_cpu_ms_per_iter": _thread_cpu_ms(repeats, policy, "copy"),
            "replication_thread_cpu_ms_per_iter": _thread_cpu_ms(repeats, policy,
                                                                 "replication"),
            "hooks_cpu_ms_per_iter": _thread_cpu_ms(repeats, policy, "training_hooks"),
            "stall_ms_total": metrics.get("stall_ms", 0.0),
            "overhead_pct": metrics.get("checkpoint_overhead_pct", 0.0),
            "snapshot_mb_per_iter": metrics.get("snapshot_bytes_per_iter", 0) / 2**20,
            # Rank 0's snapshot copies: bandwidth achieved behind compute, next to the
            # device-to-host bandwidth its profile measured (pinned buffers on CUDA).
            "snapshot_copy_gbps": metrics.get("snapshot_copy_gbps"),
            "copy_probe_gbps": _probe_gbps(metrics, "copy"),
            # ... and the rate its checksum threads reached: the slower one sets the budget.
            "checksum_probe_gbps": _probe_gbps(metrics, "checksum"),
            "window": metrics.get("window"),
            # Rank 0's replica peers: those on its node map its shared memory.
            "replicas_copied": (len(metrics.get("replica_peers", []))
                                - len(metrics.get("replica_peers_mapping", []))),
            "replicas_mapped": len(metrics.get("replica_peers_mapping", [])),
            # Snapshots placed in shared slots are counted once, with the slots.
            "host_mb": (metrics.get("host_snapshot_own_bytes_peak",
                                    metrics.get("host_snapshot_bytes_peak", 0))
                        + metrics.get("replica_bytes", 0)
                        + metrics.get("shared_slot_bytes_peak", 0)) / 2**20,
        })
    return rows


def _thread_cpu_ms(repeats: list[dict[str, dict[str, Any]]], policy: str,
                   thread: str) -> float | None:
    """Median over repeats of rank 0's ``thread`` CPU ms per iteration (None: the policy
    has no such thread)."""
    values = [runs[policy].get("checkpoint_thread_cpu_ms_per_iter", {}).get(thread)
              for runs in repeats]
    measured = [float(v) for v in values if v is not None]
    return float(np.median(measured)) if measured else None


def _probe_gbps(metrics: dict[str, Any], kind: str) -> float | None:
    """The ``copy`` or ``checksum`` rate a run's profile measured, GB/s (None: the policy
    profiles none)."""
    rate = (metrics.get("profile") or {}).get(f"{kind}_bytes_per_s")
    return None if rate is None else float(rate) / 1e9


def _cpu_ms(metrics: dict[str, Any], key: str) -> float | None:
    """A run's CPU milliseconds per iteration summed over its ranks: all threads
    (``total``) or the training threads (``training_thread_total``); None: not measured."""
    total = metrics.get("cpu_ms_per_iteration", {}).get(key)
    return None if total is None else float(total)


def _paired_cpu(repeats: list[dict[str, dict[str, Any]]], policy: str,
                key: str) -> tuple[float | None, list[float]]:
    """``policy``'s median CPU ms per iteration (:func:`_cpu_ms` ``key``) over the repeats,
    and its ratio to the ``none`` run of each repeat."""
    mine = [_cpu_ms(runs[policy], key) for runs in repeats]
    base = [_cpu_ms(runs["none"], key) for runs in repeats]
    ratios = [m / b for m, b in zip(mine, base, strict=True) if m and b]
    measured = [m for m in mine if m is not None]
    return (float(np.median(measured)) if measured else None), ratios


def overhead_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The fault-free overhead table."""
    lines = ["| policy | iteration ms (median) | vs none | vs none, per repeat "
             "| vs none, 95% interval | CPU ms/iter (all ranks) | CPU vs none "
             "| training thread CPU vs none "
             "| copy / replication / hooks CPU ms/iter (rank 0) "
             "| stall ms (total) | overhead % | snapshot MiB/iter | W | k | replicas "
             "| host MiB | copy GB/s (snapshot / probe) | checksum GB/s (probe) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        runs = " ".join(f"{ratio:.3f}" for ratio in row["vs_none_runs"])
        cpu, cpu_ratio = row.get("cpu_ms_per_iteration"), row.get("cpu_vs_none")
        lines.append(f"| {row['policy']} | {row['iteration_ms']:.1f} | {row['vs_none']:.3f} "
                     f"| {runs} | {_interval(row['vs_none_interval'])} "
                     f"| {'-' if cpu is None else f'{cpu:.1f}'} "
                     f"| {'-' if cpu_ratio is None else f'{cpu_ratio:.3f}'} "
                     f"| {_figure(row.get('training_thread_cpu_vs_none'), digits=3)} "
                     f"| {_thread_cpu(row)} "
                     f"| {row['stall_ms_total']:.1f} | {row['overhead_pct']:.2f} "
                     f"| {row['snapshot_mb_per_iter']:.2f} | {row['window'] or '-'} "
                     f"| {row.get('interval') or '-'} | {_replicas(row)} "
                     f"| {row['host_mb']:.1f} | {_copy_gbps(row)} "
                     f"| {_figure(row.get('checksum_probe_gbps'), digits=1)} |")
    return lines


def _interval(bounds: tuple[float, float] | None) -> str:
    """A median's confidence interval as ``low-high`` (``-``: too few repeats for one)."""
    return "-" if bounds is None else f"{bounds[0]:.3f}-{bounds[1]:.3f}"


def _copy_gbps(row: dict[str, Any]) -> str:
    """Snapshot copy bandwidth achieved and the profile's probe, as ``achieved / probe``."""
    return _joined(row.get("snapshot_copy_gbps"), row.get("copy_probe_gbps"), digits=1)


def _thread_cpu(row: dict[str, Any]) -> str:
    """Rank 0's CPU ms per iteration in its copy and replication threads and in the
    training thread's checkpoint hooks, as ``copy / replication / hooks``."""
    return _joined(row.get("copy_thread_cpu_ms_per_iter"),
                   row.get("replication_thread_cpu_ms_per_iter"),
                   row.get("hooks_cpu_ms_per_iter"), digits=2)


def _joined(*figures: float | None, digits: int) -> str:
    """Optional figures as ``first / second ...`` (``-`` for a missing one, or for all)."""
    if all(v is None for v in figures):
        return "-"
    return " / ".join(_figure(v, digits) for v in figures)


def _figure(value: float | None, digits: int) -> str:
    """An optional figure (``-`` when missing)."""
    return "-" if value is None else f"{value:.{digits}f}"


def _replicas(row: dict[str, Any]) -> str:
    """How rank 0's snapshots are replicated: copies (other nodes), mappings (this node)."""
    kinds = [f"{row[f'replicas_{kind}']} {kind}" for kind in ("copied", "mapped")
             if row[f"replicas_{kind}"]]
    return " + ".join(kinds) or "-"


def paired_section(args: argparse.Namespace, common: list[str],
                   per_policy: dict[str, list[str]]) -> tuple[list[str], list[dict[str, Any]]]:
    """The paired-block runs: per policy, the median over all cycles of the ratio of steps
    with snapshots to steps without, its 95% interval, and each run's median."""
    rows = []
    for policy in args.checkpointing:
        per_run = []
        for run in range(args.paired_runs):
            print(f"running checkpoint={policy} checkpoint.paired_blocks={args.paired_blocks} "
                  f"(paired run {run}) ...", flush=True)
            metrics = run_policy(policy, args.out / f"{policy}-paired{run}", args.steps,
                                 [*common, *per_policy.get(policy, []),
                                  f"checkpoint.paired_blocks={args.paired_blocks}"],
                                 args.threads)
            if policy == "moevement":
                check_moevement(metrics, f"moevement (paired blocks, run {run})")
            per_run.append(paired_block_ratios(metrics["iteration_ms"]["per_step"],
                                               metrics["snapshot_taken_per_step"]))
        pooled = [ratio for ratios in per_run for ratio in ratios]
        if not pooled:
            raise ConfigError(f"--steps={args.steps} holds no whole cycle of two blocks of "
                              f"--paired-blocks={args.paired_blocks} steps; raise --steps")
        rows.append({"policy": policy, "paired_blocks": args.paired_blocks,
                     "runs": args.paired_runs, "cycles": len(pooled),
                     "with_vs_without": float(np.median(pooled)),
                     "with_vs_without_interval": median_interval(pooled),
                     "with_vs_without_runs": [float(np.median(r)) if r else None
                                              for r in per_run],
                     # Kept so that later invocations can be pooled with this one.
                     "with_vs_without_cycles": [[float(v) for v in r] for r in per_run]})
    lines = ["| policy | runs | cycles | with / without snapshots | 95% interval | per run |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        interval = r["with_vs_without_interval"]
        shown = "-" if interval is None else f"{interval[0]:.3f}-{interval[1]:.3f}"
        runs = " ".join(_figure(v, 3) for v in r["with_vs_without_runs"])
        lines.append(f"| {r['policy']} | {r['runs']} | {r['cycles']} "
                     f"| {r['with_vs_without']:.3f}x | {shown} | {runs} |")
    return lines, rows


def memory_section(metrics: dict[str, Any], steps: int) -> tuple[list[str], dict[str, Any]]:
    """Host memory of a long moevement run: the samples, and growth from the first
    sample (start-up done) to the last."""
    samples = metrics.get("memory") or []
    if len(samples) < 2:
        raise ConfigError(f"--memory-steps={steps} gives fewer than two memory samples; "
                          "use at least 200")
    first, last = samples[0], samples[-1]
    mib = 2**20
    summary = {"steps": steps, "samples": samples,
               "rss_growth_mb": (last["rss_bytes"] - first["rss_bytes"]) / mib,
               "checkpoint_host_mb_max": max(s["checkpoint_host_bytes"] for s in samples) / mib,
               "checkpoint_host_growth_mb": (last["checkpoint_host_bytes"]
                                             - first["checkpoint_host_bytes"]) / mib}
    lines = [f"Host memory, moevement, {steps} steps (sampled every 100):", "",
             "| step | RSS MiB | checkpointing host MiB |", "|---|---|---|",
             *(f"| {s['step']} | {s['rss_bytes'] / mib:.1f} "
               f"| {s['checkpoint_host_bytes'] / mib:.2f} |" for s in samples),
             "", f"Growth from step {first['step']} to {last['step']}: RSS "
                 f"{summary['rss_growth_mb']:+.1f} MiB, checkpointing "
                 f"{summary['checkpoint_host_growth_mb']:+.2f} MiB."]
    return lines, summary


def plot(rows: list[dict[str, Any]], ettr_rows: list[dict[str, Any]], path: Path) -> None:
    """Iteration-time ratio per policy and, with failures, measured vs predicted ETTR."""
    # Imported here: multiprocessing imports this script in every forked training run (as
    # ``__mp_main__``), which need no plotting library.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if ettr_rows else 1, figsize=(11 if ettr_rows else 6, 4),
                             squeeze=False)
    left = axes[0][0]
    left.bar([r["policy"] for r in rows], [r["vs_none"] for r in rows], color="tab:blue")
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_ylabel("median iteration time / none (fault-free)")
    plt.setp(left.get_xticklabels(), rotation=30, ha="right")  # peer names are long
    if ettr_rows:
        right, x = axes[0][1], np.arange(len(ettr_rows))
        series = (("ettr_measured", "measured"), ("ettr_same_failures", "sim, same failures"),
                  ("ettr_analytic", "sim, analytic"))
        for offset, (key, label) in enumerate(series):
            right.bar(x + (offset - 1) * 0.27, [r[key] for r in ettr_rows], 0.27, label=label)
        right.set_xticks(x, [r["policy"] for r in ettr_rows])
        plt.setp(right.get_xticklabels(), rotation=30, ha="right")
        right.set_ylim(0, 1.05)
        right.set_ylabel("ETTR with injected failures")
        right.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def is_override(token: str) -> bool:
    """Whether a command-line token is a Hydra override (``key=value``,
    ``policy:key=value``, ``+key=value``, ``~key``) rather than an option or its value."""
    return not token.startswith("-") and ("=" in token or token.startswith("~"))


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """Options and Hydra overrides, in any order (an option taking several values, such
    as ``--peers``, stops at the first override); bad values raise naming the option."""
    tokens = sys.argv[1:] if argv is None else argv
    overrides = [token for token in tokens if is_override(token)]
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="CI-sized: 24 steps, MTBF 3 steps, fault-free run of none only, "
                             "one thread per process")
    parser.add_argument("--steps", type=int, default=None, help="steps of every run")
    parser.add_argument("--policies", nargs="*", default=None, choices=POLICIES,
                        help="fault-free overhead runs besides none (default: all; --quick: "
                             "none alone)")
    parser.add_argument("--ettr-policies", nargs="*", default=list(ETTR_POLICIES),
                        choices=POLICIES, help="runs with failures (default: all; "
                                               "'none': skip)")
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=("none", *PEERS),
                        help="user checkpointing to compare with, <lightning|dcp>-<cap|oracle> "
                             "(default: all; 'none': skip)")
    parser.add_argument("--memory-steps", type=int, default=0,
                        help="also train moevement fault-free this long (e.g. 2000) and report "
                             "host memory over the run: RSS and checkpointing's own bytes "
                             "(default 0: skip)")
    parser.add_argument("--paired-blocks", type=int, default=0,
                        help="also train each of --policies with snapshots in alternate "
                             "blocks of this many steps only, and report the ratio of steps "
                             "with to steps without them within each run (default 0: skip)")
    parser.add_argument("--paired-runs", type=int, default=3,
                        help="runs per policy with --paired-blocks (default 3)")
    parser.add_argument("--mtbf-steps", type=float, default=None,
                        help="mean steps between failures (default 10; --quick 3)")
    parser.add_argument("--fault-seed", type=int, default=None,
                        help="failure schedule seed (default: trainer.seed)")
    parser.add_argument("--kind", nargs="+", default=["simulated"], choices=KINDS,
                        help="failures of the ETTR runs: simulated (in place, every rank "
                             "knows), kill (real SIGKILL and replacement; needs several "
                             "processes), or both")
    parser.add_argument("--mc-runs", type=int, default=200, help="Monte-Carlo runs (>= 2)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="fault-free runs of every policy, in a rotated order; the "
                             "overhead is the median of the ratios to the none run of the "
                             "same repeat (default 1)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per training process and for the profile "
                             "(default: torch's; --quick: 1, robust on shared cores)")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "bench")
    args = parser.parse_args([token for token in tokens if not is_override(token)])
    for option in ("policies", "ettr_policies", "peers"):  # a bare list flag is refused
        flag = "--" + option.replace("_", "-")
        values = getattr(args, option)
        if values == []:
            raise ConfigError(f"{flag} was given without values: name them, or write "
                              f"'{flag} none' for none (leave {flag} out for its default)")
        if option != "policies" and values is not None and "none" in values:
            if values != ["none"]:
                raise ConfigError(f"{flag}={' '.join(values)}: 'none' goes alone")
            setattr(args, option, [])
    args.steps = (24 if args.quick else 200) if args.steps is None else args.steps
    if args.mtbf_steps is None:
        args.mtbf_steps = 3.0 if args.quick else 10.0
    if args.policies is None:
        args.policies = [] if args.quick else list(POLICIES)
    # The fault-free runs always include none, the baseline the others are paired with.
    args.checkpointing = [policy for policy in args.policies if policy != "none"]
    if args.threads is None and args.quick:
        args.threads = 1
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads={args.threads} must be >= 1")
    if args.steps < 1:
        raise ConfigError(f"--steps={args.steps} must be >= 1")
    if not args.mtbf_steps > 0:
        raise ConfigError(f"--mtbf-steps={args.mtbf_steps} must be > 0")
    if args.memory_steps < 0:
        raise ConfigError(f"--memory-steps={args.memory_steps} must be >= 0")
    if args.paired_blocks < 0:
        raise ConfigError(f"--paired-blocks={args.paired_blocks} must be >= 0 (0: skip)")
    if args.paired_runs < 1:
        raise ConfigError(f"--paired-runs={args.paired_runs} must be >= 1")
    if args.paired_blocks and not args.checkpointing:
        # none takes no snapshots, so there would be nothing to pair: refuse, not an empty table
        raise ConfigError(f"--paired-blocks={args.paired_blocks} needs a policy besides none "
                          f"in --policies (got --policies={' '.join(args.policies) or '(none)'}"
                          f"{', --quick' if args.quick else ''})")
    if args.repeats < 1:
        raise ConfigError(f"--repeats={args.repeats} must be >= 1")
    if args.mc_runs < 2:
        raise ConfigError(f"--mc-runs={args.mc_runs} must be >= 2")
    return args, overrides


def run_all(labels: list[str], out: Path, steps: int, common: list[str],
            per_policy: dict[str, list[str]], extra: list[str], suffix: str,
            threads: int | None, mtbf_steps: float) -> dict[str, dict[str, Any]]:
    """Train each policy or peer in turn (``extra`` overrides, ``out/<label><suffix>``)."""
    results = {}
    for label in labels:
        group, own = run_spec(label, mtbf_steps)
        print(f"running checkpoint={group} {' '.join([*own, *extra])} ...", flush=True)
        results[label] = run_policy(group, out / f"{label}{suffix}", steps,
                                    [*common, *per_policy.get(group, []), *own, *extra],
                                    threads)
    return results


def ettr_section(args: argparse.Namespace, configs: dict[str, DictConfig],
                 baseline: dict[str, Any], faulty: dict[str, dict[str, Any]],
                 common: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Profile the job, then the measured-vs-predicted rows and what the report adds."""
    none_settings = settings_from_config(compose_train("none", args.steps, common))
    hardware = str(next(iter(configs.values())).hardware.name)
    profile_path = args.out / "profile.json"
    print("profiling stages ...", flush=True)
    profile = measure_profile(none_settings, hardware, useful_seconds(baseline, "none"),
                              profile_path, args.threads)
    rows = [ettr_row(policy, cfg, faulty[policy], baseline, profile, args.mtbf_steps,
                     args.mc_runs) for policy, cfg in configs.items()]
    first = next(iter(configs))
    shown = profile_path.resolve()  # as a path from the repository root when inside it
    shown = shown.relative_to(REPO) if shown.is_relative_to(REPO) else shown
    simulate = simulate_command(none_settings, hardware, shown, rows[0]["mtbf_s"],
                                loop_seconds(faulty[first], first))
    return rows, {"mtbf_steps": args.mtbf_steps, "profile": str(profile_path),
                  "simulate_command": simulate}


def kill_section(args: argparse.Namespace, common: list[str],
                 per_policy: dict[str, list[str]], baseline: dict[str, Any],
                 faults: list[str]) -> tuple[list[str], list[dict[str, Any]]]:
    """The real-kill ETTR runs: per policy, supervised without and with SIGKILLs."""
    rows = []
    useful = useful_seconds(baseline, "none")
    for policy in args.ettr_policies:
        own = [*common, *per_policy.get(policy, [])]
        clean = run_policy(policy, args.out / f"{policy}-supervised", args.steps,
                           [*own, "recovery.supervise=true"], args.threads)
        killed = run_policy(policy, args.out / f"{policy}-kill", args.steps,
                            [*own, *faults, "faults.kind=kill",
                             f"recovery.max_restarts={args.steps}"], args.threads)
        replacements = killed["replacements"]
        rows.append({
            "policy": policy, "failures": len(replacements),
            "failed_ranks": [r["rank"] for r in replacements],
            "training_s_fault_free": clean["supervised_training_s"],
            "training_s_killed": killed["supervised_training_s"],
            "ettr_measured": useful / killed["supervised_training_s"],
            "ettr_fault_free": useful / clean["supervised_training_s"],
            "state_exact": same_state(args.out / f"{policy}-supervised",
                                      args.out / f"{policy}-kill"),
        })
    lines = ["| policy | kills (ranks) | training s, no failures | training s, killed "
             "| ETTR, no failures | ETTR, killed | final state = no-failure run |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ranks = ", ".join(map(str, r["failed_ranks"]))
        lines.append(f"| {r['policy']} | {r['failures']} ({ranks}) "
                     f"| {r['training_s_fault_free']:.2f} | {r['training_s_killed']:.2f} "
                     f"| {r['ettr_fault_free']:.3f} | {r['ettr_measured']:.3f} "
                     f"| {'yes, bitwise' if r['state_exact'] else 'NO'} |")
    return lines, rows


def same_state(a: Path, b: Path) -> bool:
    """Whether two runs' ``final_state.pt`` hold bitwise-equal tensors."""
    left, right = (torch.load(path / "final_state.pt") for path in (a, b))
    flat_left, flat_right = (dict(_tensors(state)) for state in (left, right))
    return flat_left.keys() == flat_right.keys() and all(
        torch.equal(tensor, flat_right[key]) for key, tensor in flat_left.items())


def _tensors(value: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return [(prefix, value)]
    if isinstance(value, dict):
        return [item for key, inner in value.items()
                for item in _tensors(inner, f"{prefix}/{key}")]
    return []


def main() -> None:
    """Run the fault-free and the failure sweeps, write the report."""
    args, overrides = parse_args()
    common, per_policy = split_overrides(overrides)
    faults = fault_overrides(args.mtbf_steps, args.fault_seed)
    configs = {}
    for label in [*args.ettr_policies, *(args.peers if args.ettr_policies else [])]:
        group, own = run_spec(label, args.mtbf_steps)
        configs[label] = compose_train(group, args.steps,  # first: bad overrides fail early
                                       [*common, *per_policy.get(group, []), *own, *faults])
    schedules = {p: planned_failures(settings_from_config(c)) for p, c in configs.items()}
    if "kill" in args.kind and configs:
        world = settings_from_config(next(iter(configs.values()))).layout.world_size
        if world < 2:
            raise ConfigError(f"--kind kill needs several worker processes (parallel.pp x dp "
                              f"x ep = {world}); add e.g. parallel.pp=2")
    if configs:
        print(f"failures before steps {next(iter(schedules.values()))}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    fault_free = ["none", *args.checkpointing,
                  *([] if args.quick else args.peers)]
    repeats = []
    for repeat in range(args.repeats):
        turn = repeat % len(fault_free)  # no policy always runs first, or last
        order = fault_free[turn:] + fault_free[:turn]
        runs = run_all(order, args.out, args.steps, common, per_policy, [],
                       f"-repeat{repeat}" if repeat else "", args.threads, args.mtbf_steps)
        repeats.append({label: runs[label] for label in fault_free})
        if "moevement" in runs:
            check_moevement(runs["moevement"], f"moevement (fault-free, repeat {repeat})")
    results = repeats[0]
    simulated = "simulated" in args.kind
    faulty = run_all(list(configs) if simulated else [], args.out, args.steps, common,
                     per_policy, faults, "-mtbf", args.threads, args.mtbf_steps)
    rows = summarise(repeats)
    command = " ".join(["python recipes/bench.py", *sys.argv[1:]])
    lines = [f"`{command}`", "", "Fault-free:", "", *overhead_markdown(rows)]
    report: dict[str, Any] = {"command": command, "steps": args.steps,
                              "repeats": args.repeats, "overhead": rows}
    ettr_rows: list[dict[str, Any]] = []
    if args.memory_steps:
        long = run_policy("moevement", args.out / "moevement-memory", args.memory_steps,
                          common, args.threads)
        memory_lines, report["memory"] = memory_section(long, args.memory_steps)
        lines += ["", *memory_lines]
    if args.paired_blocks:
        paired_lines, report["paired_blocks"] = paired_section(args, common, per_policy)
        lines += ["", f"Paired blocks within one run (checkpoint.paired_blocks="
                      f"{args.paired_blocks}: snapshots in alternate blocks of "
                      f"{args.paired_blocks} steps; one ratio per cycle of a block with and "
                      "one without, the steps of each switch and the first two of each block "
                      "left out; the upstream log runs in both):", "", *paired_lines]
    if configs and simulated:
        ettr_rows, extra = ettr_section(args, configs, results["none"], faulty, common)
        lines += ["", f"With failures (faults=mtbf, MTBF {args.mtbf_steps:g} steps, the same "
                      "schedule for every policy; ETTR vs the fault-free none run):", "",
                  *ettr_markdown(ettr_rows), "",
                  f"Simulator calibrated by this run: `{extra['simulate_command']}`"]
        report.update({**extra, "ettr": ettr_rows})
    if "kill" in args.kind and args.ettr_policies:
        kill_lines, report["ettr_kill"] = kill_section(args, common, per_policy,
                                                       results["none"], faults)
        lines += ["", "With real kills (faults.kind=kill on the same schedule: the worker is "
                      "SIGKILLed and replaced; ETTR = useful time of the none run over the "
                      "supervisor's training time):", "", *kill_lines]
    table = "\n".join(lines) + "\n"
    (args.out / "bench.md").write_text(table)
    (args.out / "bench.json").write_text(json.dumps(report, indent=2))
    plot(rows, ettr_rows, args.out / "bench.png")
    print(table)


if __name__ == "__main__":
    main()
