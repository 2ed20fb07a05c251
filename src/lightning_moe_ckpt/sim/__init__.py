"""ETTR simulator for cluster-scale MoE training (paper §2.4, §3.6, §5.4, Appendix C-D).

Given a model preset, a hardware preset, a parallel plan, a precision, an MTBF and a
checkpoint policy, the simulator estimates the iteration time (1F1B pipeline plus
alpha-beta gradient sync plus optimizer), each policy's checkpoint interval/window,
per-iteration stall and recovery time, and the resulting ETTR, analytically and by
Monte-Carlo. ``recipes/simulate.py`` drives it from ``conf/simulate.yaml`` (its studies,
tables, plots and the side by side with the paper's tables are the recipe's,
``recipes/moe_recipes/sim``); the modules are usable on their own (see :func:`build_job`,
:func:`make_policy`, :func:`analytic_ettr`); :class:`Calibration` holds the fitted
constants.
"""

from lightning_moe_ckpt.planning.intervals import ettr_formula, oracle_interval
from lightning_moe_ckpt.sim.calibration import Calibration
from lightning_moe_ckpt.sim.ettr import (
    AnalyticResult,
    MonteCarloResult,
    analytic_ettr,
    monte_carlo_ettr,
    trace_ettr,
)
from lightning_moe_ckpt.sim.inputs import PRECISIONS, ClusterSpec, JobPlan, PrecisionSpec
from lightning_moe_ckpt.sim.job import JobSpec, SimJob, build_job
from lightning_moe_ckpt.sim.policies import POLICY_NAMES, PolicySettings, make_policy
from lightning_moe_ckpt.sim.popularity import alpha_for_skew, expected_hhi, sample_shares
from lightning_moe_ckpt.sim.profile import MeasuredProfile, load_profile
from lightning_moe_ckpt.sim.regime import Policy, Regime
from lightning_moe_ckpt.sim.trace import load_failure_trace

__all__ = [
    "POLICY_NAMES",
    "PRECISIONS",
    "AnalyticResult",
    "Calibration",
    "ClusterSpec",
    "JobPlan",
    "JobSpec",
    "MeasuredProfile",
    "MonteCarloResult",
    "Policy",
    "PolicySettings",
    "PrecisionSpec",
    "Regime",
    "SimJob",
    "alpha_for_skew",
    "analytic_ettr",
    "build_job",
    "ettr_formula",
    "expected_hhi",
    "load_failure_trace",
    "load_profile",
    "make_policy",
    "monte_carlo_ettr",
    "oracle_interval",
    "sample_shares",
    "trace_ettr",
]
