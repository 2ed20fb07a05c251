"""The analytic ETTR formula (paper §2.4), the oracle interval sweep, and the run-average
overhead of a policy whose regime changes after failures."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from typing_extensions import override

from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.models.config import MoEModelConfig
from lightning_moe_ckpt.planning.intervals import (
    ettr_formula,
    oracle_interval,
    smallest_interval_within,
)
from lightning_moe_ckpt.sim import (
    ClusterSpec,
    JobPlan,
    JobSpec,
    SimJob,
    build_job,
    make_policy,
)
from lightning_moe_ckpt.sim.dense_policies import gemini_regime
from lightning_moe_ckpt.sim.ettr import analytic_ettr
from lightning_moe_ckpt.sim.inputs import precision_spec
from lightning_moe_ckpt.sim.recovery import RecoveryModel, RecoveryPath
from lightning_moe_ckpt.sim.regime import Policy, Regime

CONF = Path(__file__).resolve().parents[2] / "conf"


@functools.cache
def deepseek_job() -> SimJob:
    cluster = ClusterSpec.from_mapping(OmegaConf.load(CONF / "hardware/a100.yaml").cluster,
                                       name="a100")
    model = MoEModelConfig.from_mapping(
        OmegaConf.to_container(OmegaConf.load(CONF / "model/deepseek_moe.yaml")))
    plan = JobPlan(pp=12, dp=1, ep=8, global_batch=512, micro_batch=32, seq_len=2048)
    return build_job(JobSpec(model, plan, cluster, precision_spec("bf16-master", cluster)))


def test_formula_on_hand_checked_numbers() -> None:
    # T_ckpt = 1 s every 10 iterations of 2 s: overhead 1/20; E[R] = 30 s at MTBF 600 s.
    value = ettr_formula(stall_s=1.0, iteration_s=2.0, interval=10, expected_recovery_s=30.0,
                         mtbf_s=600.0)
    assert value == pytest.approx((1 / 1.05) * (1 / 1.05), rel=1e-12)
    assert value == pytest.approx(0.9070294784580499, rel=1e-12)


def test_formula_limits_and_half_interval_recovery() -> None:
    assert ettr_formula(0.0, 3.0, 1, 0.0, 600.0) == 1.0
    # Dense recovery of half an interval (§2.4): interval 100 x 3 s -> E[R] = 150 s.
    assert ettr_formula(0.0, 3.0, 100, 0.5 * 100 * 3.0, 600.0) == pytest.approx(0.8)
    # Doubling the stall per checkpoint and the interval leaves the overhead unchanged.
    doubled = ettr_formula(2.0, 3.0, 20, 0.0, 600.0)
    assert doubled == pytest.approx(ettr_formula(1.0, 3.0, 10, 0.0, 600.0))


def test_formula_accepts_arrays_of_intervals() -> None:
    intervals = np.array([1, 5, 50])
    recovery = 10.0 + intervals * 1.5
    vector = ettr_formula(0.7, 3.0, intervals, recovery, 1800.0)
    scalar = [ettr_formula(0.7, 3.0, int(n), float(r), 1800.0)
              for n, r in zip(intervals, recovery, strict=True)]
    np.testing.assert_allclose(vector, scalar, rtol=1e-12)


def test_formula_rejects_non_positive_mtbf() -> None:
    with pytest.raises(ConfigError, match="MTBF"):
        ettr_formula(0.0, 1.0, 1, 0.0, 0.0)


def test_oracle_finds_argmax_and_prefers_shorter_on_ties() -> None:
    assert oracle_interval(lambda n: -((n - 37.0) ** 2), 500) == (37, 0.0)
    assert oracle_interval(lambda n: np.minimum(n, 10.0), 100)[0] == 10
    assert oracle_interval(lambda n: np.ones(n.shape), 100) == (1, 1.0)
    with pytest.raises(ConfigError, match="max_interval"):
        oracle_interval(lambda n: n, 0)


def test_checkfreq_rule_on_hand_checked_overheads() -> None:
    # 0.15 s of stall per checkpoint on a 1 s iteration: 0.15/k <= 0.03 first at k = 5.
    assert smallest_interval_within(lambda k: 0.15 / k, 0.03) == 5
    # 1.0/k <= 0.03 first at k = 34 (1/33 = 0.0303 is over); capped at 20 it is 20.
    assert smallest_interval_within(lambda k: 1.0 / k, 0.03) == 34
    assert smallest_interval_within(lambda k: 1.0 / k, 0.03, max_interval=20) == 20
    assert smallest_interval_within(lambda k: 1.0 / k, 0.03, max_interval=34) == 34
    # A persist wait of 6 - k s (gone from k = 6 on) plus 0.01 amortised: 6 (0.01/6 < 0.03).
    assert smallest_interval_within(lambda k: max(0.0, 6.0 - k) + 0.01 / k, 0.03) == 6
    assert smallest_interval_within(lambda k: 0.0, 0.03) == 1
    with pytest.raises(ConfigError, match="max_overhead"):
        smallest_interval_within(lambda k: 1.0 / k, 0.0)
    with pytest.raises(ConfigError, match="max_interval"):
        smallest_interval_within(lambda k: 1.0 / k, 0.03, max_interval=0)


@pytest.mark.parametrize("mtbf_minutes", [120, 30, 10])
def test_gemini_oracle_interval_is_the_brute_force_argmax(mtbf_minutes: int) -> None:
    job, mtbf = deepseek_job(), mtbf_minutes * 60.0
    policy = make_policy("gemini", job, mtbf, 12 * 3600)
    chosen = policy.regime(None).interval

    def ettr_at(interval: int) -> float:
        regime = gemini_regime(job, interval)
        return ettr_formula(regime.stall_s, regime.iteration_s, interval,
                            regime.recovery.expected_s, mtbf)

    values = [ettr_at(n) for n in range(1, 1001)]
    assert chosen == 1 + int(np.argmax(values))
    assert 1 < chosen < 1000  # an interior optimum: the trade-off of §2.4
    assert analytic_ettr(policy, mtbf, 12 * 3600).ettr == pytest.approx(max(values), rel=1e-12)


def test_oracle_interval_shrinks_as_failures_become_frequent() -> None:
    job = deepseek_job()
    intervals = [make_policy("gemini", job, m * 60.0, 12 * 3600).regime(None).interval
                 for m in (120, 60, 30, 10)]
    assert intervals == sorted(intervals, reverse=True)
    assert intervals[0] > intervals[-1]


class _TwoRegimes(Policy):
    """Overhead 10% until the first failure, 100% after it; recovery costs nothing."""

    dynamic = True

    @override
    def initial_state(self) -> object:
        return 0

    @override
    def regime(self, state: object) -> Regime:
        free = RecoveryModel("global", (RecoveryPath(0.0, 0.0, 0.0, 0.0, 0.0),))
        return Regime(1, 1, 0.0, 1.0, free, 0.0, interference=0.1 if state == 0 else 1.0)

    @override
    def after_failure(self, state: object, rng: np.random.Generator | None) -> object:
        return 1


def test_mean_overhead_averages_the_regimes_over_the_useful_iterations() -> None:
    # Hand-computed: three MTBFs of 100 s, the first at 10% overhead, the others at 100%:
    # useful 100/1.1 + 50 + 50 s of 300 s working; overhead = working / useful - 1.
    result = analytic_ettr(_TwoRegimes(), 100.0, 300.0)
    useful = 100 / 1.1 + 100
    assert result.ettr == pytest.approx(useful / 300)
    assert result.mean_overhead == pytest.approx(300 / useful - 1)
    static = make_policy("gemini", deepseek_job(), 1800.0, 43200.0)
    assert analytic_ettr(static, 1800.0, 43200.0).mean_overhead == \
        pytest.approx(static.regime(None).overhead)
