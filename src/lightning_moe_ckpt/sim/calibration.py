"""The simulator's calibration constants: what the hardware datasheets and the papers do not say.

Every number the simulator fits rather than derives lives in :class:`Calibration`, the
same for every model, cluster and precision. The defaults are neutral (line-rate copies,
no interference, no restart cost), which is what a job built without a ``sim.calibration``
block gets (the measured-run comparison of ``recipes/bench.py`` relies on that: there the
measured overhead replaces the modelled one). ``conf/sim/paper.yaml`` sets the values
fitted to the MoEvement paper's Table 3 (A100) only, each with its unit and source; Table
7 (H100) and Fig. 11 are then predictions. The model terms they feed:

* **copy interference**: checkpoint device-to-host copies share PCIe and host-memory
  bandwidth with training's own transfers; training slows by ``copy_interference`` times
  the share of the iteration the copies keep PCIe busy.
* **network interference**: replication to peers and persisting to storage share the NIC
  with data-, pipeline- and expert-parallel traffic; training slows by
  ``network_interference`` times the share of the iteration checkpoint traffic keeps the
  NIC busy, and checkpoint traffic only gets the NIC time training leaves free, but at
  least a fair half of it (so contention grows with the training's own inter-node
  traffic).
* **copy efficiencies**: the share of line rate host-staged copies reach over the network
  (pinned peer-to-peer buffers: Gemini, MoEvement) and to durable storage (serialised
  checkpoint files: CheckFreq, MoC-System), plus a fixed latency per persisted file; and
  the share of PCIe rate MoC-System's snapshots reach (each selected expert shard is
  copied and serialised on its own, not streamed into pinned buffers).
* **global restart**: seconds every rank spends restarting (process groups re-formed,
  engines re-initialised, communicators bootstrapped) when a failure rolls the whole job
  back, ``global_restart_s_per_doubling x log2(nodes)``: collective bootstrap is a tree
  over the nodes, so each doubling of the cluster adds one more step. This is a modelling
  assumption, not a fit: Table 3 has a single cluster size (12 nodes), which fixes the
  constant but not the growth. Localized recovery restarts only the failed stage's ranks
  and pays none of it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_moe_ckpt.errors import fmt, require


@dataclass(frozen=True)
class Calibration:
    """Fitted constants; defaults are neutral.

    Args:
        host_network_efficiency: Share of NIC line rate for peer copies, in (0, 1].
        storage_efficiency: Share of storage line rate for checkpoint files, in (0, 1].
        persist_latency_s: Seconds per persisted checkpoint beyond the bytes, >= 0.
        partial_snapshot_efficiency: Share of PCIe rate MoC snapshots reach, in (0, 1].
        copy_interference: Training slowdown per unit PCIe busy share, >= 0.
        network_interference: Training slowdown per unit NIC busy share, >= 0.
        global_restart_s_per_doubling: Seconds of a global restart per doubling of the
            nodes, >= 0.
    """

    host_network_efficiency: float = 1.0
    storage_efficiency: float = 1.0
    persist_latency_s: float = 0.0
    partial_snapshot_efficiency: float = 1.0
    copy_interference: float = 0.0
    network_interference: float = 0.0
    global_restart_s_per_doubling: float = 0.0

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None,
                     key: str = "sim.calibration") -> Calibration:
        """Read ``sim.calibration`` (every key optional); bad values name their key."""
        values = dict(values or {})
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        require(not unknown, f"unknown key(s) {', '.join(key + '.' + k for k in unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        for name, value in values.items():
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            require(ok and math.isfinite(value) and value >= 0,
                    f"{fmt(key + '.' + name, value)} must be a finite number >= 0")
        for name in ("host_network_efficiency", "storage_efficiency",
                     "partial_snapshot_efficiency"):
            value = values.get(name, 1.0)
            require(0 < value <= 1, f"{fmt(key + '.' + name, value)} must be in (0, 1]")
        return cls(**{name: float(value) for name, value in values.items()})


NEUTRAL = Calibration()  # line-rate copies, no interference, no restart cost
