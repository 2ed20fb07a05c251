"""Every error type of the library, and the helpers that phrase configuration errors.

* :class:`ConfigError`: bad input, raised before anything runs; it names the offending
  setting(s) and value(s). It subclasses :class:`ValueError`, so generic callers can
  catch it the usual way.
* :class:`CorruptCheckpointError` (and :class:`SnapshotFormatError`): a snapshot piece is
  missing, fails its checksum, or is not of this version's format; recovery then falls
  back to another window or the durable checkpoint.
* :class:`NoUsableCheckpointError`: recovery found nothing valid to restore.
* :class:`WireFormatError`: bytes that do not decode as the snapshot wire format.
* :class:`IterationAborted`, :class:`RecoveryInterrupted`: control flow of a recovery (an
  iteration abandoned for a recovery; a replay cut short by a cascading failure).
* :class:`InjectedFailure`: what a test fault of ``kind: exception`` raises.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """Bad configuration value; the message names the key and the value."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds.

    Args:
        condition: What must hold.
        message: The error's message, naming the key(s) and value(s).

    Raises:
        ConfigError: ``condition`` is false.
    """
    if not condition:
        raise ConfigError(message)


def is_number(value: Any) -> bool:
    """An int or float setting (a bool is not one, though Python says it is an int).

    Args:
        value: The setting's value.

    Returns:
        Whether ``value`` is an int or a float and not a bool.
    """
    return isinstance(value, int | float) and not isinstance(value, bool)


def fmt(key: str, value: Any) -> str:
    """Format ``key=value`` the way a Hydra override would spell it.

    Args:
        key: The setting's key, e.g. ``checkpoint.replicas``.
        value: Its value; a string is quoted.

    Returns:
        ``key=value``.
    """
    return f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"


class CorruptCheckpointError(RuntimeError):
    """A checkpoint piece is missing or fails its checksum."""


class SnapshotFormatError(CorruptCheckpointError):
    """Bytes that are not a snapshot of this version's format: refused unread."""


class NoUsableCheckpointError(RuntimeError):
    """Recovery found neither a usable checkpoint window nor a durable checkpoint."""


class WireFormatError(ValueError):
    """Bytes that are not a value of this format (truncated, damaged or foreign)."""


class IterationAborted(Exception):
    """The iteration was abandoned for a recovery: run the target's ``step`` next (its
    batch may differ from the one the loop had fetched).

    Args:
        step: The step to continue at.
    """

    def __init__(self, step: int) -> None:
        super().__init__(f"iteration aborted; continue at step {step}")
        self.step = step


class RecoveryInterrupted(Exception):
    """A cascading failure cut a replay short; ``report`` says how far it got.

    Args:
        report: The interrupted recovery's
            :class:`~lightning_moe_ckpt.recovery.RecoveryReport`.
    """

    def __init__(self, report: Any) -> None:  # a recovery.RecoveryReport
        super().__init__(f"recovery interrupted after {report.replayed} replayed iterations")
        self.report = report


class InjectedFailure(Exception):
    """``kind: exception``: the training step of the failing rank raises this."""
