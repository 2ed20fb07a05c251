"""Expert-popularity skew: symmetric Dirichlet token shares and the HHI skewness metric.

Following the paper's Appendix D, each layer's token shares ``p = (p_1..p_E)`` are drawn
from a symmetric Dirichlet(alpha). Skew is measured by the Herfindahl-Hirschman index
``HHI = sum p_i^2`` normalised to ``S = (HHI - 1/E) / (1 - 1/E)`` (0 uniform, 1 one expert
takes everything); in expectation ``E[HHI] = (alpha + 1) / (alpha * E + 1)``, which
:func:`alpha_for_skew` inverts so a config can ask for a target skewness instead of an
alpha (S = 0.25 at E = 64 gives alpha = 0.0469, as in the paper). Popularity orders the
MoEvement schedule and sets how many tokens MoC and MoEtion lose on recovery.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lightning_moe_ckpt.errors import ConfigError, fmt, require


def expected_hhi(alpha: float, experts: int) -> float:
    """E[HHI] of a symmetric Dirichlet(alpha) over ``experts`` categories.

    Args:
        alpha: The Dirichlet concentration, > 0.
        experts: Experts per layer.

    Returns:
        ``(alpha + 1) / (alpha * experts + 1)``.
    """
    return (alpha + 1.0) / (alpha * experts + 1.0)


def skewness(hhi: float | np.ndarray, experts: int) -> float | np.ndarray:
    """Normalised HHI: 0 for uniform shares, 1 when one expert gets every token."""
    return (hhi - 1.0 / experts) / (1.0 - 1.0 / experts)


def alpha_for_skew(skew: float, experts: int) -> float:
    """The Dirichlet alpha whose expected normalised HHI equals ``skew`` (0 < skew < 1).

    Args:
        skew: The target normalised HHI, in (0, 1).
        experts: Experts per layer (at least 2).

    Returns:
        The alpha (S = 0.25 at 64 experts gives 0.0469).
    """
    hhi = skew * (1.0 - 1.0 / experts) + 1.0 / experts
    return (1.0 - hhi) / (hhi * experts - 1.0)


def hhi(shares: np.ndarray) -> np.ndarray:
    """HHI of each row of ``shares``."""
    return np.square(shares).sum(axis=-1)


def sample_shares(alpha: float | None, layers: int, experts: int,
                  rng: np.random.Generator, draws: int | None = None) -> np.ndarray:
    """Token shares ``[layers, experts]`` (or ``[draws, layers, experts]``).

    Args:
        alpha: The symmetric Dirichlet's concentration; ``None``: balanced routing (every
            share ``1 / experts``).
        layers: MoE layers.
        experts: Experts per layer.
        rng: The random generator.
        draws: Independent draws; ``None``: one, without the leading dimension.

    Returns:
        The shares; each layer's sum to one.
    """
    shape = (layers, experts) if draws is None else (draws, layers, experts)
    if alpha is None:
        return np.full(shape, 1.0 / experts)
    # Tiny alphas underflow every gamma draw of a row to 0; draw in log space instead
    # (Gamma(a) = Gamma(a + 1) * U^(1/a)) and normalise with a log-sum-exp.
    log_gamma = (np.log(rng.gamma(alpha + 1.0, size=shape))
                 + np.log(rng.uniform(size=shape)) / alpha)
    log_gamma -= log_gamma.max(axis=-1, keepdims=True)
    weights = np.exp(log_gamma)
    return weights / weights.sum(axis=-1, keepdims=True)


def parse_popularity(values: Mapping[str, Any] | None, experts: int,
                     key: str = "sim.popularity") -> float | None:
    """Read ``{alpha: ...}`` or ``{skew: ...}`` (at most one set); returns alpha or None."""
    values = values or {}
    unknown = sorted(set(values) - {"alpha", "skew"})
    require(not unknown, f"unknown key(s) {', '.join(key + '.' + k for k in unknown)}; "
                         f"use {key}.alpha or {key}.skew")
    alpha, skew = values.get("alpha"), values.get("skew")
    if alpha is not None and skew is not None:
        raise ConfigError(f"set only one of {key}.alpha={alpha} and {key}.skew={skew}")
    if alpha is not None:
        require(isinstance(alpha, (int, float)) and alpha > 0,
                f"{fmt(key + '.alpha', alpha)} must be > 0 (or null for balanced routing)")
        return float(alpha)
    if skew is None or skew == 0:
        return None
    require(isinstance(skew, (int, float)) and 0 < skew < 1,
            f"{fmt(key + '.skew', skew)} must be in [0, 1)")
    if experts < 2:
        return None
    return alpha_for_skew(float(skew), experts)
