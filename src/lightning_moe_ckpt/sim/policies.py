"""Policy registry: turn a policy name and its ``sim.policy.*`` settings into a plan.

The five policies of the paper's evaluation: ``moevement`` (this library), ``gemini``
(dense in-memory, oracle interval per MTBF), ``checkfreq`` (dense to storage, overhead
capped), ``moc`` (partial experts, lost-token budget) and ``moetion`` (popular experts,
capacity boost after recovery). Unknown names raise :class:`ConfigError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from lightning_moe_ckpt.errors import ConfigError, fmt, require
from lightning_moe_ckpt.sim.dense_policies import plan_checkfreq, plan_gemini
from lightning_moe_ckpt.sim.job import SimJob
from lightning_moe_ckpt.sim.moevement import plan_moevement
from lightning_moe_ckpt.sim.partial_policies import MoCPolicy, plan_moetion
from lightning_moe_ckpt.sim.regime import Policy

POLICY_NAMES: tuple[str, ...] = ("checkfreq", "gemini", "moc", "moetion", "moevement")


@dataclass(frozen=True)
class PolicySettings:
    """Policy knobs (``sim.policy``); defaults are the papers' settings.

    Args:
        checkfreq_max_overhead: CheckFreq's overhead cap (3%, MoEvement §5.2).
        max_interval: Upper end of the interval searches (Gemini's oracle sweep,
            CheckFreq's search).
        moc_lost_token_budget: MoC's lost-token budget (§3.1: accuracy holds up to 3.75%
            PLT).
        moc_initial_fraction: MoC's initial share of experts per snapshot (12.5%,
            MoEvement Fig. 10c).
        seed: Seed of MoC's per-failure token losses.
    """

    checkfreq_max_overhead: float = 0.03
    max_interval: int = 5000
    moc_lost_token_budget: float = 0.0375
    moc_initial_fraction: float = 0.125
    seed: int = 0

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None,
                     key: str = "sim.policy") -> PolicySettings:
        """Read ``{checkfreq: {max_overhead}, moc: {lost_token_budget, initial_fraction},
        max_interval, seed}``."""
        values = dict(values or {})
        flat: dict[str, Any] = {}
        for group in ("checkfreq", "moc"):
            for name, value in dict(values.pop(group, None) or {}).items():
                flat[f"{group}_{name}"] = value
        flat.update(values)
        known = {f.name for f in fields(cls)}
        for name in flat:
            if name not in known:
                dotted = name.replace("checkfreq_", "checkfreq.", 1).replace("moc_", "moc.", 1)
                raise ConfigError(f"unknown key {key}.{dotted}")
        settings = cls(**flat)
        require(isinstance(settings.max_interval, int) and settings.max_interval >= 1,
                f"{fmt(key + '.max_interval', settings.max_interval)} must be an integer >= 1")
        return settings


def check_policy_names(names: object, key: str = "sim.policies") -> tuple[str, ...]:
    """Validate a list of policy names."""
    require(isinstance(names, (list, tuple)) and len(names) > 0,
            f"{fmt(key, names)} must be a non-empty list of policy names")
    assert isinstance(names, (list, tuple))
    for name in names:
        if name not in POLICY_NAMES:
            raise ConfigError(f"{fmt(key, name)} is not a known policy; choose from "
                              f"{', '.join(POLICY_NAMES)}")
    return tuple(str(name) for name in names)


def make_policy(name: str, job: SimJob, mtbf_s: float, run_s: float,
                settings: PolicySettings = PolicySettings()) -> Policy:
    """Plan policy ``name`` for ``job``.

    Args:
        name: One of :data:`POLICY_NAMES`.
        job: The built job.
        mtbf_s: Mean time between failures, seconds (> 0); Gemini's oracle interval
            depends on it.
        run_s: The run's length, seconds; MoC's lost-token budget depends on it.
        settings: The policies' knobs; default: the papers' settings.

    Returns:
        The planned policy.

    Raises:
        ConfigError: An unknown policy name, or ``mtbf_s`` not > 0.
    """
    require(mtbf_s > 0, f"MTBF must be > 0, got {mtbf_s} s")
    if name == "moevement":
        return plan_moevement(job)
    if name == "gemini":
        return plan_gemini(job, mtbf_s, settings.max_interval)
    if name == "checkfreq":
        return plan_checkfreq(job, settings.checkfreq_max_overhead, settings.max_interval)
    if name == "moc":
        return MoCPolicy(job, mtbf_s, settings.moc_lost_token_budget,
                         settings.moc_initial_fraction, settings.seed)
    if name == "moetion":
        return plan_moetion(job)
    raise ConfigError(f"{fmt('sim.policies', name)} is not a known policy; choose from "
                      f"{', '.join(POLICY_NAMES)}")
