"""The model terms issue #14 added, each against a hand-computed case: checkpoint traffic
interference, the NIC time training leaves to checkpoints, the global restart, the
interleaved bubble, Gemini's and CheckFreq's regimes, MoC's fixed start, its super-linear
snapshot stall and its skew-sensitive Dynamic-K, the calibration block, and one
Algorithm 1 for runtime and sim."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf

from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.models.config import MoEModelConfig
from lightning_moe_ckpt.planning.schedule import plan_window
from lightning_moe_ckpt.sim import ClusterSpec, JobPlan, JobSpec, SimJob, build_job
from lightning_moe_ckpt.sim.calibration import Calibration
from lightning_moe_ckpt.sim.dense_policies import (
    checkfreq_persist_s,
    checkfreq_regime,
    gemini_regime,
    plan_checkfreq,
)
from lightning_moe_ckpt.sim.ettr import analytic_ettr
from lightning_moe_ckpt.sim.inputs import precision_spec
from lightning_moe_ckpt.sim.moevement import plan_moevement
from lightning_moe_ckpt.sim.partial_policies import MoCPolicy, MoCState, partial_bytes
from lightning_moe_ckpt.sim.popularity import alpha_for_skew
from lightning_moe_ckpt.sim.schedule import _per_gpu_specs, find_window
from tests.conftest import CONF_DIR, REPO

CAL = Calibration(host_network_efficiency=0.5, storage_efficiency=0.2, persist_latency_s=10.0,
                  partial_snapshot_efficiency=0.01, copy_interference=0.1,
                  network_interference=0.02, global_restart_s_per_doubling=30.0)


def cluster() -> ClusterSpec:
    values = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "hardware/a100.yaml").cluster)
    assert isinstance(values, dict)
    return ClusterSpec.from_mapping({str(k): v for k, v in values.items()}, name="a100")


@functools.cache
def job(name: str = "deepseek_moe", pp: int = 12, dp: int = 1, ep: int = 8,
        alpha: float | None = None, calibration: Calibration = CAL,
        virtual_stages: int = 1) -> SimJob:
    model = MoEModelConfig.from_mapping(
        OmegaConf.to_container(OmegaConf.load(CONF_DIR / f"model/{name}.yaml")))
    plan = JobPlan(pp=pp, dp=dp, ep=ep, global_batch=512, micro_batch=32, seq_len=2048,
                        virtual_stages=virtual_stages)
    spec = JobSpec(model, plan, cluster(), precision_spec("bf16-master", cluster()),
                   popularity_alpha=alpha, popularity_seed=3, restart_s=5.0,
                   calibration=calibration)
    return build_job(spec)


def test_interference_is_each_links_busy_share_times_its_coefficient() -> None:
    simulated = job()
    t, pcie, nic = simulated.iteration_s, simulated.cluster.pcie_bytes_per_s, \
        simulated.host_copy_per_gpu
    # PCIe busy a quarter of the iteration, the NIC half of it: 0.1/4 + 0.02/2.
    assert simulated.interference(0.25 * pcie * t, 0.5 * nic * t) == pytest.approx(0.035)
    # A link cannot be busier than the whole iteration: the share saturates at 1.
    assert simulated.interference(3 * pcie * t, 0.0) == pytest.approx(0.1)
    neutral = job(calibration=Calibration())
    assert neutral.interference(pcie * t, nic * t) == 0.0


def test_checkpoint_copies_get_the_nic_time_training_leaves() -> None:
    simulated = job()
    share = simulated.timing.network_busy_s() / simulated.iteration_s
    assert 0 < simulated.training_network_share == pytest.approx(share)
    per_gpu = 80e9 / 8 / 8  # 80 Gbit/s per node over 8 GPUs, in bytes/s
    assert simulated.host_copy_per_gpu == pytest.approx(per_gpu * 0.5 * (1 - share))
    # One stage on one node, no data parallelism: no inter-node training traffic at all.
    alone = job("deepseek_moe", pp=1, dp=1)
    assert alone.training_network_share == 0.0
    assert alone.host_copy_per_gpu == pytest.approx(per_gpu * 0.5)


def test_global_restart_adds_one_step_per_doubling_of_the_nodes() -> None:
    assert job().plan.nodes(8) == 12
    assert job().global_restart_s == pytest.approx(5.0 + 30.0 * math.log2(12))
    assert job("deepseek_moe", pp=2, dp=1).global_restart_s == pytest.approx(5.0 + 30.0)
    assert job("deepseek_moe", pp=1, dp=1).global_restart_s == pytest.approx(5.0)  # one node


def test_interleaving_divides_the_pipeline_bubble() -> None:
    plain, interleaved = job(virtual_stages=1), job(virtual_stages=2)
    assert plain.time.pipeline_s == pytest.approx((16 + 11) * plain.time.slot_s)
    assert interleaved.time.pipeline_s == pytest.approx((16 + 5.5) * interleaved.time.slot_s)


def test_gemini_interference_is_one_checkpoint_spread_over_the_interval() -> None:
    simulated = job()
    dense = simulated.dense_bytes_per_gpu
    for interval in (1, 10):
        regime = gemini_regime(simulated, interval)
        expected = simulated.interference(dense / interval, 2 * dense / interval)
        assert regime.interference == pytest.approx(expected)
        assert regime.overhead == pytest.approx(
            regime.stall_s / (interval * simulated.iteration_s) + expected)
        assert regime.recovery.paths[0].fixed_s >= simulated.global_restart_s


def test_checkfreq_picks_the_shortest_interval_whose_persist_wait_fits_the_cap() -> None:
    simulated = job()
    rate = 40e9 / 8 * 0.2  # 40 Gbit/s to storage at 20%
    persist = 10.0 + simulated.dense_bytes_total / rate
    assert checkfreq_persist_s(simulated) == pytest.approx(persist)
    t = simulated.iteration_s
    # The dense snapshot fits PCIe within the iteration, so the stall is the persist wait:
    # (persist - k T) / (k T) <= 3%  <=>  k >= persist / (1.03 T).
    assert checkfreq_regime(simulated, 1).stall_s == pytest.approx(persist - t)
    chosen = plan_checkfreq(simulated, 0.03, 5000).regime(None)
    assert chosen.interval == math.ceil(persist / (1.03 * t))


def test_moc_snapshot_stalls_for_its_slow_copy_beyond_the_overlap_window() -> None:
    simulated = job()
    policy = MoCPolicy(simulated, 3600.0, 0.0375, 0.125)
    # MoC starts at 12.5% of the experts on every model (MoEvement Fig. 10c), whether or
    # not a larger K would still overlap the next forward/backward.
    assert policy.initial_state().experts == 8.0
    for experts in (8.0, 64.0):
        _, total = partial_bytes(simulated, experts)
        copy_s = total / 96 / (simulated.cluster.pcie_bytes_per_s * 0.01)
        assert policy.copy_s(experts) == pytest.approx(copy_s)
        expected = max(0.0, copy_s - simulated.overlap_window_s)
        assert policy.regime(MoCState(experts, 0.0)).stall_s == pytest.approx(expected)
    assert policy.regime(MoCState(64.0, 0.0)).stall_s > 0  # every expert does not fit


def test_moc_overhead_is_super_linear_in_k_once_the_copy_outgrows_the_window() -> None:
    # Hand-computed: MoC's stall is copy - window, so past the window the overhead grows by
    # the whole extra copy time while the snapshot grows by its bytes.
    simulated = job()
    policy = MoCPolicy(simulated, 3600.0, 0.0375, 0.125)
    window, t = simulated.overlap_window_s, simulated.iteration_s
    stalls = [policy.regime(MoCState(k, 0.0)).stall_s for k in (8.0, 16.0, 32.0, 64.0)]
    copies = [policy.copy_s(k) for k in (8.0, 16.0, 32.0, 64.0)]
    assert stalls == pytest.approx([max(0.0, c - window) for c in copies])
    overheads = [policy.regime(MoCState(k, 0.0)).stall_overhead for k in (32.0, 64.0)]
    assert overheads == pytest.approx([(copies[2] - window) / t, (copies[3] - window) / t])
    assert overheads[1] / overheads[0] > copies[3] / copies[2]  # faster than the bytes


def test_moc_escalates_under_skew_where_balanced_routing_stays_within_budget() -> None:
    balanced, skewed = job(), job(alpha=alpha_for_skew(0.9, 64))
    probe = MoCPolicy(balanced, 3600.0, 0.0375, 0.125)
    lost = probe.expected_lost(probe.initial_experts)
    # The MTBF at which a failure's mean loss is 90% of the budget: balanced routing loses
    # exactly the mean every time and never overruns it; skew's bursts do.
    mtbf_s = lost / (0.9 * 0.0375) * balanced.iteration_s
    calm = analytic_ettr(MoCPolicy(balanced, mtbf_s, 0.0375, 0.125), mtbf_s, 43200.0)
    bursty = analytic_ettr(MoCPolicy(skewed, mtbf_s, 0.0375, 0.125), mtbf_s, 43200.0)
    assert calm.final_note.startswith(f"K={probe.initial_experts:g}/64")
    assert bursty.ettr < calm.ettr


def test_moevement_interference_counts_snapshots_log_and_replicas() -> None:
    simulated = job()
    regime = plan_moevement(simulated).regime(None)
    mean = regime.snapshot_bytes_per_gpu  # upper bound on the per-iteration mean
    log = simulated.log_bytes_per_iteration
    assert 0 < regime.interference <= simulated.interference(mean + log, 2 * mean) + 1e-12
    assert regime.overhead == pytest.approx(regime.interference + regime.stall_overhead)


def test_calibration_errors_name_the_key_and_value() -> None:
    with pytest.raises(ConfigError, match=r"sim\.calibration\.warp"):
        Calibration.from_mapping({"warp": 1})
    with pytest.raises(ConfigError, match=r"sim\.calibration\.storage_efficiency=0"):
        Calibration.from_mapping({"storage_efficiency": 0})
    with pytest.raises(ConfigError, match=r"sim\.calibration\.copy_interference=-1"):
        Calibration.from_mapping({"copy_interference": -1})
    assert Calibration.from_mapping(None) == Calibration()
    assert Calibration.from_mapping({"persist_latency_s": 3}).persist_latency_s == 3.0


def test_simulated_windows_are_the_runtimes_algorithm_1() -> None:
    stage = job().stages[3]
    budget = 0.6e9
    simulated = find_window(stage.operators, stage.ranks, budget)
    runtime = plan_window(_per_gpu_specs(stage.operators, stage.ranks), 1.0, budget)
    assert [[op.name for op in turn] for turn in simulated.turns] == \
        [list(turn) for turn in runtime.turns]
    assert simulated.fits and simulated.largest_bytes <= budget


def test_the_runtime_does_not_import_the_simulator() -> None:
    code = ("import sys, lightning_moe_ckpt.policies.gemini\n"
            "print(sorted(m for m in sys.modules if m.startswith('lightning_moe_ckpt.sim')))")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def test_paper_calibration_is_a_complete_documented_block() -> None:
    block = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "sim/paper.yaml").calibration)
    assert isinstance(block, dict)
    assert set(block) == {f.name for f in dataclasses.fields(Calibration)}
    lines = (CONF_DIR / "sim/paper.yaml").read_text().splitlines()
    for name in block:  # every constant is preceded by a comment: meaning, unit, source
        index = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{name}:"))
        assert lines[index - 1].strip().startswith("#") or "#" in lines[index], name
    assert np.isfinite(list(Calibration.from_mapping(block).__dict__.values())).all()
