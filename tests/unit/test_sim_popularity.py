"""Expert-popularity skew (paper Appendix D): Dirichlet shares and the HHI expectation."""

from __future__ import annotations

import math
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
    build_job,
    make_policy,
)
from lightning_moe_ckpt.sim.inputs import precision_spec
from lightning_moe_ckpt.sim.partial_policies import MoCPolicy, unsaved_tokens
from lightning_moe_ckpt.sim.popularity import (
    alpha_for_skew,
    expected_hhi,
    hhi,
    parse_popularity,
    sample_shares,
    skewness,
)

CONF = Path(__file__).resolve().parents[2] / "conf"


def deepseek_job(alpha: float | None) -> SimJob:
    cluster = ClusterSpec.from_mapping(OmegaConf.load(CONF / "hardware/a100.yaml").cluster,
                                       name="a100")
    model = MoEModelConfig.from_mapping(
        OmegaConf.to_container(OmegaConf.load(CONF / "model/deepseek_moe.yaml")))
    plan = JobPlan(pp=12, dp=1, ep=8, global_batch=512, micro_batch=32, seq_len=2048)
    return build_job(JobSpec(model, plan, cluster, precision_spec("bf16-master", cluster),
                             popularity_alpha=alpha, popularity_seed=3))


def test_expected_hhi_limits() -> None:
    assert expected_hhi(1e9, 64) == pytest.approx(1 / 64, rel=1e-6)  # uniform shares
    assert expected_hhi(1e-12, 64) == pytest.approx(1.0, rel=1e-6)  # one expert takes all
    assert expected_hhi(1.0, 8) == pytest.approx(2 / 9)


# Tolerance: the Monte-Carlo mean of 20,000 draws must be within 4 standard errors of
# (alpha + 1) / (alpha E + 1); for these alphas that is at most 1.5% of the expectation.
@pytest.mark.parametrize(("alpha", "experts"), [(0.0469, 64), (0.0156, 64), (0.5, 64),
                                                (1.0, 8), (5.0, 16), (0.000158, 64)])
def test_dirichlet_hhi_matches_its_expectation(alpha: float, experts: int) -> None:
    shares = sample_shares(alpha, 1, experts, np.random.default_rng(42), draws=20_000)[:, 0]
    assert np.all(shares >= 0)
    np.testing.assert_allclose(shares.sum(axis=-1), 1.0, rtol=1e-12)
    values = hhi(shares)
    stderr = values.std(ddof=1) / math.sqrt(values.size)
    assert abs(values.mean() - expected_hhi(alpha, experts)) <= 4 * stderr + 1e-12
    assert abs(values.mean() / expected_hhi(alpha, experts) - 1) < 0.015


def test_alpha_for_skew_reproduces_the_papers_alphas() -> None:
    # Appendix D: S in {0.25, 0.50, 0.75, 0.99} <-> alpha ~ {0.0469, 0.0156, 0.0052, 0.000158}.
    for skew, alpha in [(0.25, 0.0469), (0.5, 0.0156), (0.75, 0.0052), (0.99, 0.000158)]:
        assert alpha_for_skew(skew, 64) == pytest.approx(alpha, rel=0.02)
        assert skewness(expected_hhi(alpha_for_skew(skew, 64), 64), 64) == pytest.approx(skew)


def test_balanced_routing_is_the_default() -> None:
    shares = sample_shares(None, 3, 8, np.random.default_rng(0))
    np.testing.assert_array_equal(shares, np.full((3, 8), 1 / 8))
    assert parse_popularity({"skew": 0.0}, 64) is None
    assert parse_popularity({"skew": 0.25}, 64) == pytest.approx(alpha_for_skew(0.25, 64))
    assert parse_popularity({"alpha": 0.3}, 64) == 0.3


@pytest.mark.parametrize(("values", "key"), [({"skew": 1.5}, "sim.popularity.skew"),
                                             ({"alpha": -1}, "sim.popularity.alpha"),
                                             ({"alpha": 1, "skew": 0.5}, "only one"),
                                             ({"beta": 2}, "sim.popularity.beta")])
def test_bad_popularity_settings_name_the_key(values: dict[str, float], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        parse_popularity(values, 64)


def test_skew_lowers_moevement_recovery() -> None:
    # Appendix D: popular experts stay frozen longest during conversion, so skew saves work.
    uniform = make_policy("moevement", deepseek_job(None), 600.0, 43200).regime(None)
    skewed = make_policy("moevement", deepseek_job(alpha_for_skew(0.75, 64)), 600.0,
                         43200).regime(None)
    assert skewed.recovery.expected_s < uniform.recovery.expected_s


def test_skew_makes_moc_token_losses_bursty() -> None:
    uniform = MoCPolicy(deepseek_job(None), 43200, 0.0375, 0.125)
    skewed = MoCPolicy(deepseek_job(alpha_for_skew(0.75, 64)), 43200, 0.0375, 0.125)
    lost_uniform, lost_skewed = uniform._lost_pool(8), skewed._lost_pool(8)
    # Round-robin ages do not depend on popularity: the same mean, but bursts under skew.
    assert lost_uniform.std() == pytest.approx(0.0, abs=1e-9)
    assert lost_skewed.std() > 0.1 * lost_skewed.mean()
    assert lost_skewed.mean() == pytest.approx(uniform.expected_lost(8), rel=0.2)


def test_moetion_selection_loses_fewer_tokens_under_skew() -> None:
    rng = np.random.default_rng(0)
    uniform = unsaved_tokens(np.full((4, 64), 1 / 64), 8)
    assert uniform == pytest.approx((64 / 8 - 1) / 2)  # round-robin: (E/S - 1) / 2
    skewed = unsaved_tokens(sample_shares(alpha_for_skew(0.75, 64), 4, 64, rng), 8)
    assert skewed < uniform
