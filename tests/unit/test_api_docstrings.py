"""Every public class and function of the API reference's faces documents its parameters.

The reference (``docs/reference/*.md``, mkdocstrings with ``docstring_style: google``) is
generated from the faces below. Each name a face exports (its ``__all__``; a module without
one: the public names it defines itself, as the reference shows them) that is a function
must have an ``Args:`` section with one entry per parameter; a class, one entry per
parameter of its constructor (a dataclass's fields), in an ``Args:`` or ``Attributes:``
section of the class docstring. Classes whose constructor is not the library's (an
exception that takes Python's arguments, a protocol, an abstract base without one) have
nothing to document. An ``Args:`` entry that names no parameter is an error too.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest

FACES = [
    "lightning_moe_ckpt.callbacks",
    "lightning_moe_ckpt.testing",
    "lightning_moe_ckpt.strategies",
    "lightning_moe_ckpt.recovery",
    "lightning_moe_ckpt.training",
    "lightning_moe_ckpt.core",
    "lightning_moe_ckpt.core.registry",
    "lightning_moe_ckpt.errors",
    "lightning_moe_ckpt.sim",
]

_SECTION = re.compile(r"^(?P<indent> *)(?P<title>[A-Z][A-Za-z ]*):\s*$")
_ENTRY = re.compile(r"^(?P<name>\*{0,2}\w+)\s*(\([^)]*\))?:")


def sections(doc: str) -> dict[str, list[str]]:
    """The entry names of each Google-style section of ``doc`` (``Args``, ``Attributes``,
    ...): lines ``name:`` or ``name (type):`` one level under the section's title."""
    found: dict[str, list[str]] = {}
    lines = inspect.cleandoc(doc).splitlines()
    index = 0
    while index < len(lines):
        title = _SECTION.match(lines[index])
        index += 1
        if title is None:
            continue
        names = found.setdefault(title["title"], [])
        outer = len(title["indent"])
        entry_indent: int | None = None
        while index < len(lines):
            line = lines[index]
            indent = len(line) - len(line.lstrip())
            if line.strip() and indent <= outer:
                break
            if line.strip():
                entry_indent = indent if entry_indent is None else entry_indent
                match = _ENTRY.match(line.strip())
                if indent == entry_indent and match:
                    names.append(match["name"])
            index += 1
    return found


def public_names(module: Any) -> list[str]:
    """What the reference shows of ``module``: its ``__all__``, else the public names it
    defines itself."""
    exported = getattr(module, "__all__", None)
    if exported is not None:
        return list(exported)
    return [name for name, value in vars(module).items()
            if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__]


def _constructor_is_ours(cls: type) -> bool:
    """Whether ``cls`` is built through an ``__init__`` or ``__new__`` of the library (its
    own, a dataclass's, or a library base class's)."""
    if getattr(cls, "_is_protocol", False) or issubclass(cls, enum.Enum):
        return False
    owner = next(k for k in cls.__mro__ if "__init__" in vars(k) or "__new__" in vars(k))
    return owner.__module__.startswith("lightning_moe_ckpt")


def _parameter_names(target: Callable[..., Any]) -> list[str]:
    names = []
    for parameter in inspect.signature(target).parameters.values():
        if parameter.kind is parameter.VAR_POSITIONAL:
            names.append(f"*{parameter.name}")
        elif parameter.kind is parameter.VAR_KEYWORD:
            names.append(f"**{parameter.name}")
        else:
            names.append(parameter.name)
    return names


def problems_of(qualname: str, obj: Any) -> list[str]:
    """What ``obj``'s docstring lacks (or names wrongly), one line each."""
    if inspect.isclass(obj):
        if not _constructor_is_ours(obj):
            return []
        doc = vars(obj).get("__doc__") or ""
        found = sections(doc)
        documented = found.get("Args", []) + found.get("Attributes", [])
        args_only = found.get("Args", [])
    elif inspect.isfunction(obj):
        doc = obj.__doc__ or ""
        found = sections(doc)
        documented = args_only = found.get("Args", [])
    else:
        return []  # constants and type aliases
    parameters = _parameter_names(obj)
    plain = {name.lstrip("*"): name for name in parameters}
    problems = [f"{qualname}: no Args entry for {name!r}" for name in parameters
                if name not in documented and name.lstrip("*") not in documented]
    problems += [f"{qualname}: Args entry {name!r} names no parameter" for name in args_only
                 if name.lstrip("*") not in plain]
    problems += [f"{qualname}: {name!r} documented {documented.count(name)} times"
                 for name in sorted(set(documented)) if documented.count(name) > 1]
    return problems


def test_the_section_parser() -> None:
    def sample(a: int, b: int = 0, *rest: int, **options: Any) -> None:
        """Sum.

        Args:
            a: The first.
                Still the first (a continuation line).
            b (int): The second.
            *rest: More.

        Returns:
            Nothing.
        """

    assert sections(sample.__doc__ or "") == {"Args": ["a", "b", "*rest"], "Returns": []}
    assert problems_of("sample", sample) == ["sample: no Args entry for '**options'"]


@pytest.mark.parametrize("face", FACES)
def test_every_parameter_is_documented(face: str) -> None:
    module = importlib.import_module(face)
    problems = []
    for name in public_names(module):
        problems += problems_of(f"{face}.{name}", getattr(module, name))
    assert not problems, "\n".join(problems)
