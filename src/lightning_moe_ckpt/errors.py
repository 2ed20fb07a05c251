"""Error types of the library.

Every error raised for bad user input is a :class:`ConfigError`: it names the offending
config key(s) and value(s) so a user can fix the Hydra override without reading code.
It subclasses :class:`ValueError` so generic callers can still catch it the usual way.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """Bad configuration value; the message names the key and the value."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)


def is_number(value: Any) -> bool:
    """An int or float setting (a bool is not one, though Python says it is an int)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def fmt(key: str, value: Any) -> str:
    """Format ``key=value`` the way a Hydra override would spell it."""
    return f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"
