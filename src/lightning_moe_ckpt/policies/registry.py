"""Every checkpoint policy by name: which planner it uses and which options it takes.

:func:`make_planner` builds a policy's planner from its name and ``checkpoint.<option>``
settings; :func:`setting_options` lists the settings a policy accepts (the options the
callback derives from the model and the world are not among them), so a bad one is
refused naming the key before anything runs.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from lightning_moe_ckpt.errors import ConfigError, fmt, require
from lightning_moe_ckpt.planning.planner import BasePlanner, NonePlanner
from lightning_moe_ckpt.planning.schedule import OperatorSpec
from lightning_moe_ckpt.policies.checkfreq import CheckFreqPlanner
from lightning_moe_ckpt.policies.gemini import GeminiPlanner
from lightning_moe_ckpt.policies.moc import MoCPlanner
from lightning_moe_ckpt.policies.moetion import MoEtionPlanner
from lightning_moe_ckpt.policies.moevement import MoEvementPlanner

__all__ = ["PLANNER_NAMES", "SUPPLIED_OPTIONS", "check_options", "make_planner",
           "planner_options", "setting_options"]


def _planner_classes() -> dict[str, Callable[..., BasePlanner]]:
    return {"moevement": MoEvementPlanner, "gemini": GeminiPlanner,
            "checkfreq": CheckFreqPlanner, "moc": MoCPlanner, "moetion": MoEtionPlanner,
            "none": NonePlanner}


PLANNER_NAMES = ("moevement", "gemini", "checkfreq", "moc", "moetion", "none")


# Keyword arguments the callback fills in from the model and the world, not settings.
SUPPLIED_OPTIONS = frozenset({"n_layers", "n_experts", "top_k", "capacity_factors",
                              "window_agreement", "interval_agreement"})


def planner_options(name: str) -> frozenset[str]:
    """Keyword options policy ``name``'s planner takes (settings and supplied ones)."""
    classes = _planner_classes()
    if name not in classes:
        raise ConfigError(f"{fmt('checkpoint', name)} is not a checkpoint policy; choose one "
                          f"of {', '.join(PLANNER_NAMES)} (or the peers lightning, dcp)")
    parameters = inspect.signature(classes[name]).parameters
    return frozenset(p for p, v in parameters.items() if v.kind is inspect.Parameter.KEYWORD_ONLY)


def setting_options(name: str) -> frozenset[str]:
    """The ``checkpoint.<option>`` settings policy ``name`` accepts (what the callback
    derives from the model and the world is not among them)."""
    return planner_options(name) - SUPPLIED_OPTIONS


def make_planner(name: str, specs: Sequence[OperatorSpec], **options: Any) -> BasePlanner:
    """The planner of policy ``name`` over ``specs`` (the operators it may capture)."""
    known = planner_options(name)
    unknown = sorted(set(options) - known)
    require(not unknown, f"unknown option(s) {', '.join('checkpoint.' + k for k in unknown)} "
                         f"for checkpoint={name}; it accepts "
                         f"{', '.join(sorted(known)) or 'no options'}")
    return _planner_classes()[name](specs, **options)


# One operator of each kind: what :func:`check_options` builds a planner over.
_STAND_IN = (OperatorSpec("layers.0.attention", 1, 1, 1.0),
             OperatorSpec("layers.0.moe.gate", 1, 1, 1.0),
             OperatorSpec("layers.0.moe.experts.0", 1, 1, 0.5))


def check_options(name: str, operators: Sequence[OperatorSpec] = _STAND_IN,
                  **options: Any) -> None:
    """Refuse a bad ``checkpoint.<option>`` of policy ``name`` now, before the model is
    built: the planner is built over stand-in ``operators`` (by default one of each kind;
    checks that need the real model, such as a window longer than its operators, come
    when it is built).

    Raises:
        ConfigError: An unknown option or a bad value, named with its key.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_planner(name, operators, **options)
