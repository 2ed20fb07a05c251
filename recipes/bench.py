"""Benchmark checkpoint policies side by side: ``python recipes/bench.py [--quick] [overrides]``.

Runs ``recipes/train.py`` once per policy on the same model, layout and data (each run in
its own process(es), one after another), then reports per policy: median iteration time
and its ratio to ``checkpoint=none``, checkpoint stall, snapshot bytes per iteration and
host memory held by snapshots and replicas. Writes ``bench.md`` (markdown table),
``bench.png`` and ``bench.json`` to ``--out``. Extra arguments are passed to every run as
Hydra overrides, e.g. ``parallel.pp=2 parallel.ep=2 model=small``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

REPO = Path(__file__).resolve().parents[1]
POLICIES = ("none", "moevement", "gemini", "checkfreq", "moc", "moetion")


def run_policy(policy: str, out: Path, steps: int, overrides: list[str]) -> dict[str, Any]:
    """Train with ``checkpoint=policy``; returns its metrics."""
    command = [sys.executable, str(REPO / "recipes" / "train.py"), f"checkpoint={policy}",
               f"out_dir={out}", f"trainer.max_steps={steps}", f"trainer.val_every={steps}",
               "trainer.progress_bar=false", "api=fabric", *overrides]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if result.returncode != 0:
        raise RuntimeError(f"checkpoint={policy} failed:\n{result.stderr[-3000:]}")
    metrics: dict[str, Any] = json.loads((out / "metrics.json").read_text())
    return metrics


def summarise(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per policy, ratios against ``none``."""
    baseline = results["none"]["iteration_ms"]["median"]
    rows = []
    for policy, metrics in results.items():
        median = metrics["iteration_ms"]["median"]
        rows.append({
            "policy": policy,
            "iteration_ms": median,
            "vs_none": median / baseline,
            "stall_ms_total": metrics.get("stall_ms", 0.0),
            "overhead_pct": metrics.get("checkpoint_overhead_pct", 0.0),
            "snapshot_mb_per_iter": metrics.get("snapshot_bytes_per_iter", 0) / 2**20,
            "window": metrics.get("window"),
            "host_mb": (metrics.get("host_snapshot_bytes_peak", 0)
                        + metrics.get("replica_bytes", 0)) / 2**20,
        })
    return rows


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    """The table README quotes, with the command that produced it."""
    lines = [f"`{command}`", "",
             "| policy | iteration ms (median) | vs none | stall ms (total) | overhead % "
             "| snapshot MiB/iter | W | host MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['policy']} | {row['iteration_ms']:.1f} | {row['vs_none']:.3f} "
                     f"| {row['stall_ms_total']:.1f} | {row['overhead_pct']:.2f} "
                     f"| {row['snapshot_mb_per_iter']:.2f} | {row['window'] or '-'} "
                     f"| {row['host_mb']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Iteration-time ratio and snapshot bytes per policy."""
    names = [row["policy"] for row in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(names, [row["vs_none"] for row in rows], color="tab:blue")
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_ylabel("median iteration time / none")
    right.bar(names, [row["snapshot_mb_per_iter"] for row in rows], color="tab:orange")
    right.set_ylabel("snapshot MiB per iteration")
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    """Parse arguments, run every policy, write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized: few steps")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "bench")
    args, overrides = parser.parse_known_args()
    steps = args.steps or (12 if args.quick else 80)
    policies = ["none", *[p for p in args.policies if p != "none"]]
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for policy in policies:
        print(f"running checkpoint={policy} ...", flush=True)
        results[policy] = run_policy(policy, args.out / policy, steps, overrides)
    rows = summarise(results)
    command = " ".join(["python recipes/bench.py", *sys.argv[1:]])
    table = markdown(rows, command)
    (args.out / "bench.md").write_text(table)
    (args.out / "bench.json").write_text(json.dumps(rows, indent=2))
    plot(rows, args.out / "bench.png")
    print(table)


if __name__ == "__main__":
    main()
