"""Every configuration key and every callback argument is documented in docs/configuration.md.

How a key is spelled (the way a Hydra override spells it):

* ``conf/train.yaml`` and ``conf/simulate.yaml`` are the primary configs: their keys have no
  prefix (``api``, ``out_dir``, ``recovery.timeout_s``).
* A file of a config group, ``conf/<group>/<option>.yaml``, puts its keys under the group's
  package: the group path with dots (``checkpoint.window``, ``parallel.pp``,
  ``sim.scale.configs``). A file whose first line is ``# @package _global_`` (the
  ``experiment`` presets) puts them at the top level (``parallel.pp``).
* Nested mappings are flattened with dots (``trainer.optim.lr``,
  ``hardware.cluster.mfu``). A list is one key, whatever it holds (``faults.events``,
  ``trainer.optim.betas``, ``sim.scale.configs``). A mapping whose keys are names rather
  than settings (``sim.plans``, keyed by job name) is spelled with ``<name>`` in their
  place: ``sim.plans.<name>.pp``.
* A ``defaults`` list contributes the config groups it selects, spelled as on the command
  line: ``model``, ``sim/scale``, ``hydra/job_logging`` (``override``, a leading ``/`` and
  ``_self_`` are dropped).

What counts as documented: the first cell of a Markdown table row whose first backticked
word is the key (``| `checkpoint.window` | ...``). A row belongs to the heading above it.
A heading that names conf files in backticks (``checkpoint/moevement.yaml``, or a pattern
such as ``model/*.yaml``, relative to ``conf/``) claims them: a key of a claimed file must
be documented under one of the headings that claim it, and every key documented under such
a heading must exist in one of the files it claims (no stale entries). Keys of a file no
heading claims may be documented anywhere.

The arguments of ``SparseCheckpointing.__init__`` and ``FailureInjector.__init__`` are
documented in the table under the heading that names the class; ``**options`` may be
written with or without its stars. Both directions are checked there too.
"""

from __future__ import annotations

import fnmatch
import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lightning_moe_ckpt.callbacks import SparseCheckpointing
from lightning_moe_ckpt.testing import FailureInjector
from tests.conftest import REPO

CONF = REPO / "conf"
REFERENCE = REPO / "docs" / "configuration.md"
PRIMARY = {"train.yaml", "simulate.yaml"}
NAME_KEYED = {"sim.plans"}  # mappings keyed by names (job names), not by settings


def _flatten(prefix: str, value: Any) -> Iterator[str]:
    if isinstance(value, dict) and value:
        for name, child in value.items():
            key = f"{prefix}.{name}" if prefix else str(name)
            if prefix in NAME_KEYED:
                key = f"{prefix}.<name>"
            yield from _flatten(key, child)
    elif prefix:
        yield prefix


def _defaults_groups(entries: list[Any]) -> Iterator[str]:
    for entry in entries:
        if isinstance(entry, str):
            continue  # _self_ (or a plain config name)
        for name in entry:
            group = str(name).removeprefix("override ").strip().lstrip("/")
            yield group


def config_keys(path: Path) -> set[str]:
    """The keys of one YAML file under ``conf/``, spelled as Hydra overrides spell them."""
    text = path.read_text()
    data = yaml.safe_load(text) or {}
    relative = path.relative_to(CONF)
    if relative.as_posix() in PRIMARY or text.startswith("# @package _global_"):
        prefix = ""
    else:
        prefix = ".".join(relative.parent.parts)
    keys: set[str] = set()
    for name, value in data.items():
        if name == "defaults":
            keys.update(_defaults_groups(value))
        else:
            keys.update(_flatten(f"{prefix}.{name}" if prefix else str(name), value))
    return keys


@dataclass
class Section:
    """The table rows under one heading of the reference."""

    heading: str
    documented: set[str] = field(default_factory=set)

    @property
    def patterns(self) -> list[str]:
        return [p for p in re.findall(r"`([^`]+)`", self.heading) if p.endswith(".yaml")]

    def claims(self, relative: str) -> bool:
        return any(fnmatch.fnmatch(relative, pattern) for pattern in self.patterns)


def sections() -> list[Section]:
    """Each heading of docs/configuration.md with the keys documented in its tables."""
    found = [Section("")]
    for line in REFERENCE.read_text().splitlines():
        if line.startswith("#"):
            heading = re.sub(r"\s*\{#[^}]*\}\s*$", "", line.lstrip("#").strip())  # an id
            found.append(Section(heading))
        elif line.startswith("|") and not re.match(r"^\|[\s:|-]+\|?$", line):
            first_cell = line.strip("|").split("|")[0]
            word = re.search(r"`([^`]+)`", first_cell)
            if word:
                found[-1].documented.add(word.group(1).lstrip("*"))
    return found


def yaml_files() -> list[Path]:
    return sorted(CONF.rglob("*.yaml"))


def test_every_yaml_file_is_read() -> None:
    files = yaml_files()
    assert len(files) >= 30, files  # the test must not pass by finding nothing
    for path in files:
        assert config_keys(path), f"{path} has no keys"


def test_every_config_key_is_documented() -> None:
    all_sections = sections()
    anywhere = set().union(*(s.documented for s in all_sections))
    missing: list[str] = []
    for path in yaml_files():
        relative = path.relative_to(CONF).as_posix()
        claiming = [s for s in all_sections if s.claims(relative)]
        documented = set().union(*(s.documented for s in claiming)) if claiming else anywhere
        where = (" under " + " or ".join(repr(s.heading) for s in claiming)) if claiming else ""
        missing += [f"{key} (conf/{relative}){where}"
                    for key in sorted(config_keys(path) - documented)]
    assert not missing, ("keys of conf/ not documented in docs/configuration.md:\n  "
                         + "\n  ".join(missing))


def test_no_documented_key_is_stale() -> None:
    stale: list[str] = []
    files = {path.relative_to(CONF).as_posix(): config_keys(path) for path in yaml_files()}
    for section in sections():
        if not section.patterns:
            continue
        claimed = [keys for relative, keys in files.items() if section.claims(relative)]
        assert claimed, f"heading {section.heading!r} names conf files that do not exist"
        existing = set().union(*claimed)
        stale += [f"{key} under {section.heading!r}"
                  for key in sorted(section.documented - existing)]
    assert not stale, ("docs/configuration.md documents keys no file it names has:\n  "
                       + "\n  ".join(stale))


def _parameters(cls: type) -> set[str]:
    return {name for name in inspect.signature(cls.__init__).parameters if name != "self"}


def test_callback_arguments_are_documented() -> None:
    problems: list[str] = []
    for cls in (SparseCheckpointing, FailureInjector):
        named = [s for s in sections() if f"`{cls.__name__}`" in s.heading]
        assert len(named) == 1, f"one heading of docs/configuration.md must name `{cls.__name__}`"
        documented = named[0].documented
        params = _parameters(cls)
        problems += [f"{cls.__name__}({p}) is not documented" for p in sorted(params - documented)]
        problems += [f"{cls.__name__} has no argument {p!r}, documented"
                     for p in sorted(documented - params)]
    assert not problems, "\n".join(problems)
