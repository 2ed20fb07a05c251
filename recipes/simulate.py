"""ETTR simulator entry point: the paper's Table 3, Fig. 1b and Fig. 11 for any cluster.

    python recipes/simulate.py [hydra overrides]      (config: conf/simulate.yaml)

Prints the policy table and writes ettr_vs_interval.png, ettr_vs_mtbf.png,
ettr_vs_scale.png, simulate.json and table.txt to ``out_dir``. All modelling lives in
:mod:`lightning_moe_ckpt.sim`; this file only wires Hydra to it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from lightning_moe_ckpt.sim import format_table, simulate, write_outputs

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


@hydra.main(config_path="../conf", config_name="simulate", version_base=None)
def main(cfg: DictConfig) -> None:
    resolved: Any = OmegaConf.to_container(cfg, resolve=True)
    report = simulate(resolved, CONF_DIR)
    print(format_table(report))
    for path in write_outputs(report, Path(str(cfg.out_dir))):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
