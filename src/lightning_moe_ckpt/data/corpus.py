"""Byte-level text corpora: the embedded default (Python's standard library) and any UTF-8 file.

The default corpus is real text that nobody on the project wrote and that every machine
running this library has: the ``*.py`` sources of the running interpreter's standard
library (``site-packages`` excluded), read as raw bytes, vocabulary 256. Files are read in
sorted path order and assigned to validation by a CRC of their relative path, so the
train/validation split is deterministic and does not depend on directory listing order.
A short fingerprint of the bytes is recorded with every run, so results from machines
with a different Python can be told apart.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_moe_ckpt.errors import ConfigError, fmt

BYTE_VOCAB_SIZE = 256
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class TokenCorpus:
    """Train and validation token streams (uint8 byte ids) of one corpus."""

    name: str
    train: torch.Tensor
    val: torch.Tensor
    fingerprint: str
    vocab_size: int = BYTE_VOCAB_SIZE


def _fingerprint(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.hexdigest()[:16]


def _as_tokens(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _python_sources(root: Path) -> list[str]:
    """The ``*.py`` files under ``root`` outside the excluded directories, as sorted
    relative POSIX paths.

    The excluded directories are pruned from the walk rather than filtered out after it:
    an interpreter's ``site-packages`` can hold several times the standard library's files,
    and every worker process (replacements included) builds this corpus at start."""
    sources = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [name for name in subdirectories if name not in _EXCLUDED_DIRS]
        base = Path(directory).relative_to(root)
        sources += [(base / name).as_posix() for name in names if name.endswith(".py")]
    return sorted(sources)


def stdlib_corpus(val_percent: float = 5.0) -> TokenCorpus:
    """The running Python's standard-library sources, split by file."""
    if not 0 < val_percent < 100:
        raise ConfigError(f"{fmt('data.val_percent', val_percent)} must be in (0, 100)")
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = _python_sources(root)
    if not sources:
        raise ConfigError(f"data=stdlib found no *.py files under {root}")
    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    threshold = val_percent / 100 * 2**32
    for relative in sources:
        target = val_parts if zlib.crc32(relative.encode()) < threshold else train_parts
        target.append((root / relative).read_bytes() + b"\n")
    train, val = b"".join(train_parts), b"".join(val_parts)
    return TokenCorpus("stdlib", _as_tokens(train), _as_tokens(val), _fingerprint(train, val))


def textfile_corpus(path: str | None, val_fraction: float = 0.05) -> TokenCorpus:
    """A UTF-8 text file; the last ``val_fraction`` of its bytes is the validation split."""
    if path is None or str(path).strip() == "":
        raise ConfigError("data=textfile needs a file: set data.path "
                          f"(got {fmt('data.path', path)})")
    if not 0 < val_fraction < 1:
        raise ConfigError(f"{fmt('data.val_fraction', val_fraction)} must be in (0, 1)")
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{fmt('data.path', str(path))} is not an existing file")
    data = file.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{fmt('data.path', str(path))} is not valid UTF-8 "
                          f"(byte {err.start}: {err.reason})") from None
    split = int(len(data) * (1 - val_fraction))
    train, val = data[:split], data[split:]
    return TokenCorpus(f"textfile:{file.name}", _as_tokens(train), _as_tokens(val),
                       _fingerprint(train, val))
