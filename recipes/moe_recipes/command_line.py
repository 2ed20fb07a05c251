"""A bad command line in one line: ``error: <what is wrong, with key and value>``, exit 2.

Before Hydra runs the recipe, :func:`check_command_line` composes the config with the
command line's overrides, builds the run's settings and checks that ``out_dir`` can be
written, so that an unknown key, a bad value, a missing config group option or an
unwritable output directory is one line on stderr within seconds (exit 2, as command-line
tools do), not a traceback after the processes started. ``HYDRA_FULL_ERROR=1`` shows the
traceback instead. A command line with Hydra's own flags (``--help``, ``--cfg``,
``--multirun``, ...) is left to Hydra.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from lightning_moe_ckpt.errors import ConfigError

__all__ = ["EXIT_USAGE", "check_command_line", "command_line_problem", "out_dir_problem"]

EXIT_USAGE = 2  # a bad command line, as command-line tools exit
ENV_FULL_ERROR = "HYDRA_FULL_ERROR"


def command_line_problem(overrides: Sequence[str], config_dir: Path,
                         config_name: str = "train") -> str | None:
    """What is wrong with the recipe's command line ``overrides`` (None: nothing found).

    Args:
        overrides: The command line's arguments after the script (Hydra overrides).
        config_dir: The recipe's config directory.
        config_name: The primary config in it.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from moe_recipes.settings import settings_from_config

    try:
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()),
                                   version_base=None):
            cfg = compose(config_name, overrides=list(overrides))
        settings = settings_from_config(cfg)
    except (ConfigError, HydraException, OmegaConfBaseException) as error:
        if os.environ.get(ENV_FULL_ERROR) == "1":
            raise
        return _one_line(error, overrides)
    return out_dir_problem(settings.out_dir)


def out_dir_problem(out_dir: str) -> str | None:
    """Why ``out_dir`` cannot be created or written (None: it can). It is created here,
    as Hydra would a moment later, and a file is made and removed in it."""
    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        where = f" ({error.filename})" if error.filename not in (None, out_dir) else ""
        return (f"out_dir={out_dir!r} cannot be written: {reason}{where}; set out_dir to a "
                "directory this job can write")
    return None


def check_command_line(config_dir: Path, config_name: str = "train",
                       argv: Sequence[str] | None = None) -> None:
    """Exit with ``error: ...`` and code 2 when the command line ``argv`` (default: this
    process's) is bad; return when it is fine or carries Hydra's own flags.

    Args:
        config_dir: The recipe's config directory.
        config_name: The primary config in it.
        argv: The arguments after the script.
    """
    overrides = sys.argv[1:] if argv is None else list(argv)
    if any(argument.startswith("-") for argument in overrides):
        return  # --help, --cfg, --multirun, ...: Hydra's own
    problem = command_line_problem(overrides, config_dir, config_name)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USAGE)


def _one_line(error: BaseException, overrides: Sequence[str]) -> str:
    """The error and its causes in one line (each one's first line); an override Hydra
    could not apply is named as it was given (key and value)."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(error, MissingConfigException) and error.missing_cfg_file and error.options:
        group, _, option = str(error.missing_cfg_file).rpartition("/")
        return (f"{group}={option}: no such option; choose one of "
                f"{', '.join(sorted(error.options))}")
    parts: list[str] = []
    seen: BaseException | None = error
    while seen is not None:
        lines = [line.strip() for line in str(seen).splitlines() if line.strip()]
        if lines and lines[0] != "None" and lines[0].rstrip(".") not in parts:
            parts.append(lines[0].rstrip("."))
        seen = seen.__cause__ or seen.__context__
    failed = re.fullmatch(r"Could not override '(.+)'", parts[0]) if parts else None
    if failed is not None:  # an unknown key: Hydra's advice to append (+key) would not do
        given = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] == failed.group(1)]
        return (f"{given[0] if given else failed.group(1)}: no such setting (every setting "
                "is in docs/configuration.md)")
    if isinstance(error, OverrideParseException):
        return f"cannot read the command line: {'; '.join(parts)}"
    return "; ".join(parts) or repr(error)
