"""ETTR simulator entry point: the paper's Table 3, Fig. 1b and Fig. 11 for any cluster.

    python recipes/simulate.py [hydra overrides]      (config: conf/simulate.yaml)
    python recipes/simulate.py +report=paper         (and the side-by-side with the paper)

Prints the policy table and writes ettr_vs_interval.png, ettr_vs_mtbf.png,
ettr_vs_scale.png, simulate.json and table.txt to ``out_dir``; with ``+report=paper`` it
also prints every Table 3, Table 7 and Fig. 11 value of the MoEvement paper it models next
to the simulated one and writes paper_comparison.json. All modelling lives in
:mod:`lightning_moe_ckpt.sim`; this file only wires Hydra to it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from lightning_moe_ckpt.errors import fmt, require
from moe_recipes.sim.experiments import simulate
from moe_recipes.sim.paper_report import (
    compare_with_paper,
    format_comparison,
    write_comparison,
)
from moe_recipes.sim.report import format_table, write_outputs

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


@hydra.main(config_path="../conf", config_name="simulate", version_base=None)
def main(cfg: DictConfig) -> None:
    resolved: Any = OmegaConf.to_container(cfg, resolve=True)
    report = simulate(resolved, CONF_DIR)
    print(format_table(report))
    out_dir = Path(str(cfg.out_dir))
    for path in write_outputs(report, out_dir):
        print(f"wrote {path}")
    extra = resolved.get("report")
    if extra is None:
        return
    require(extra == "paper", f"{fmt('report', extra)} is not a report; the one report is "
                              "+report=paper (the side-by-side with the MoEvement paper)")
    comparison = compare_with_paper(resolved, CONF_DIR)
    print(format_comparison(comparison))
    print(f"wrote {write_comparison(comparison, out_dir)}")


if __name__ == "__main__":
    main()
