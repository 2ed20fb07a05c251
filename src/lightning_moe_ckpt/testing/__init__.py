"""Testing aids: fault schedules (which rank fails at which step, and how) and the
:class:`FailureInjector` callback that strikes them and recovers."""

from lightning_moe_ckpt.testing.failure_injector import FailureInjector
from lightning_moe_ckpt.testing.faults import (
    PHASES,
    AtSchedule,
    FailureCounter,
    FailureEvent,
    FaultSchedule,
    LostState,
    MtbfSchedule,
    NoFaults,
    Phase,
    TraceSchedule,
    destroy_rank_state,
    parse_event,
    schedule_from_config,
)

__all__ = ["PHASES", "AtSchedule", "FailureCounter", "FailureEvent", "FailureInjector",
           "FaultSchedule", "LostState", "MtbfSchedule", "NoFaults", "Phase", "TraceSchedule",
           "destroy_rank_state", "parse_event", "schedule_from_config"]
