"""Monte-Carlo ETTR against the analytic value, failure traces, and MoC's Dynamic-K."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.models.config import MoEModelConfig
from lightning_moe_ckpt.sim import (
    ClusterSpec,
    JobPlan,
    JobSpec,
    SimJob,
    analytic_ettr,
    build_job,
    load_failure_trace,
    make_policy,
    monte_carlo_ettr,
    trace_ettr,
)
from lightning_moe_ckpt.sim.calibration import Calibration
from lightning_moe_ckpt.sim.inputs import precision_spec
from lightning_moe_ckpt.sim.partial_policies import MoCPolicy, MoCState

CONF = Path(__file__).resolve().parents[2] / "conf"
RUN_S = 12 * 3600.0


@functools.cache
def job(name: str, pp: int, dp: int) -> SimJob:
    cluster = ClusterSpec.from_mapping(OmegaConf.load(CONF / "hardware/a100.yaml").cluster,
                                       name="a100")
    model = MoEModelConfig.from_mapping(
        OmegaConf.to_container(OmegaConf.load(CONF / f"model/{name}.yaml")))
    plan = JobPlan(pp=pp, dp=dp, ep=8, global_batch=512, micro_batch=32, seq_len=2048)
    # Paper-calibrated: MoC's slow snapshot path, persists and restart.
    calibration = Calibration.from_mapping(OmegaConf.load(CONF / "sim/paper.yaml").calibration)
    return build_job(JobSpec(model, plan, cluster, precision_spec("bf16-master", cluster),
                             calibration=calibration))


@pytest.mark.parametrize("policy", ["checkfreq", "gemini", "moetion", "moevement"])
@pytest.mark.parametrize("mtbf_minutes", [60, 10])
def test_monte_carlo_agrees_with_the_formula(policy: str, mtbf_minutes: int) -> None:
    simulated = job("deepseek_moe", 12, 1)
    mtbf = mtbf_minutes * 60.0
    planned = make_policy(policy, simulated, mtbf, RUN_S)
    analytic = analytic_ettr(planned, mtbf, RUN_S)
    carlo = monte_carlo_ettr(planned, mtbf, RUN_S, 300, np.random.default_rng(7))
    # Within the spread of single runs, and within 4 standard errors of the mean.
    assert abs(carlo.mean - analytic.ettr) <= carlo.std
    assert abs(carlo.mean - analytic.ettr) <= 4 * carlo.stderr + 1e-4
    assert carlo.failures.mean() == pytest.approx(analytic.failures, rel=0.05)
    assert carlo.total_recovery_s.mean() == pytest.approx(analytic.total_recovery_s, rel=0.08)


def test_analytic_run_equals_the_closed_form_for_a_static_policy() -> None:
    planned = make_policy("gemini", job("deepseek_moe", 12, 1), 1800.0, RUN_S)
    regime = planned.regime(None)
    expected = (1 / (1 + regime.overhead)) / (1 + regime.recovery.expected_s / 1800.0)
    assert analytic_ettr(planned, 1800.0, RUN_S).ettr == pytest.approx(expected, rel=1e-12)


def test_moc_monte_carlo_stays_within_its_spread_of_the_expected_trajectory() -> None:
    planned = make_policy("moc", job("qwen_moe", 6, 2), 1200.0, RUN_S)
    analytic = analytic_ettr(planned, 1200.0, RUN_S)
    carlo = monte_carlo_ettr(planned, 1200.0, RUN_S, 200, np.random.default_rng(3))
    assert abs(carlo.mean - analytic.ettr) <= carlo.std


def test_moc_doubles_k_once_the_lost_token_budget_is_spent() -> None:
    simulated = job("deepseek_moe", 12, 1)
    probe = MoCPolicy(simulated, 3600.0, lost_token_budget=0.0375, initial_fraction=0.125)
    lost = probe.expected_lost(8)  # iterations' worth per failure at K=8
    # MTBF at which one failure's loss is exactly twice the budget of the tokens trained.
    mtbf_s = lost / (2 * 0.0375) * simulated.iteration_s
    policy = MoCPolicy(simulated, mtbf_s, lost_token_budget=0.0375, initial_fraction=0.125)
    state = policy.initial_state()
    assert state.experts == 8  # 12.5% of 64 experts
    first = policy.after_failure(state, None)
    # PLT = lost / (1 failure x MTBF of iterations) = 7.5% > 3.75%: K doubles.
    assert policy.lost_token_share(MoCState(8, lost, 1)) == pytest.approx(0.075)
    assert (first.experts, first.exhausted) == (16, True)
    # The budget stays spent: every later failure doubles K, up to every expert.
    seen = [first.experts]
    for _ in range(4):
        seen.append(policy.after_failure(MoCState(seen[-1], 0.0, 9, True), None).experts)
    assert seen == [16, 32, 64, 64, 64]
    # More experts per snapshot: larger snapshots, more overhead.
    assert policy.regime(MoCState(64, 0.0)).overhead >= policy.regime(MoCState(8, 0.0)).overhead


def test_moc_keeps_k_while_the_lost_tokens_stay_within_budget() -> None:
    simulated = job("deepseek_moe", 12, 1)
    lost = MoCPolicy(simulated, 3600.0, 0.0375, 0.125).expected_lost(8)
    mtbf_s = lost / (0.5 * 0.0375) * simulated.iteration_s  # PLT = half the budget
    policy = MoCPolicy(simulated, mtbf_s, 0.0375, 0.125)
    state = policy.initial_state()
    for _ in range(10):
        state = policy.after_failure(state, None)
    assert (state.experts, state.failures, state.exhausted) == (8, 10, False)
    assert policy.lost_token_share(state) == pytest.approx(0.5 * 0.0375)


def test_trace_without_failures_costs_only_the_overhead() -> None:
    planned = make_policy("gemini", job("deepseek_moe", 12, 1), 1800.0, RUN_S)
    result = trace_ettr(planned, [], RUN_S, np.random.default_rng(0))
    assert result.mean == pytest.approx(1 / (1 + planned.regime(None).overhead))


def test_evenly_spaced_trace_matches_the_formula() -> None:
    planned = make_policy("moevement", job("deepseek_moe", 12, 1), 1800.0, RUN_S)
    times = np.arange(1800.0, RUN_S, 1800.0)
    result = trace_ettr(planned, times, RUN_S, np.random.default_rng(0), runs=50)
    analytic = analytic_ettr(planned, 1800.0, RUN_S).ettr
    assert result.mean == pytest.approx(analytic, abs=0.002)
    assert np.all(result.failures == len(times))


def test_failure_trace_files(tmp_path: Path) -> None:
    as_json = tmp_path / "trace.json"
    as_json.write_text(json.dumps({"failure_times_s": [900, 60.5, 3600]}))
    assert load_failure_trace(as_json) == (60.5, 900.0, 3600.0)
    as_text = tmp_path / "trace.txt"
    as_text.write_text("# GCP trace\n10\n\n20  # second\n")
    assert load_failure_trace(as_text) == (10.0, 20.0)
    bad = tmp_path / "bad.txt"
    bad.write_text("10\nsoon\n")
    with pytest.raises(ConfigError, match=r"sim\.failures\.trace.*line 2"):
        load_failure_trace(bad)
    with pytest.raises(ConfigError, match="no such failure trace"):
        load_failure_trace(tmp_path / "missing.json")
    negative = tmp_path / "negative.json"
    negative.write_text("[-5]")
    with pytest.raises(ConfigError, match=">= 0"):
        load_failure_trace(negative)


def test_moc_starts_at_the_papers_fraction_even_where_more_experts_would_overlap() -> None:
    # MoE-LLaVa: 12.5% of 4 experts per layer is half an expert (MoC interleaves layers);
    # its 25% snapshot would still overlap the iteration, but MoC starts where the paper
    # says it did, for every model.
    simulated = job("moe_llava", 6, 2)
    policy = MoCPolicy(simulated, 3600.0, 0.0375, 0.125)
    assert policy.initial_state().experts == 0.5
    assert policy.copy_s(1.0) < simulated.overlap_window_s
    assert policy.rounds(0.5) == 8
