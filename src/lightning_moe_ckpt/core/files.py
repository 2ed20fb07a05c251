"""Files the library writes: committed whole, or not at all.

Every file the library writes (durable checkpoints and their manifests, CheckFreq's disk
snapshots, consolidated states) takes one path, the one databases take: the bytes go to a
temporary file in the target's own directory, are ``fsync``-ed, renamed over the target
(``os.replace``: atomic within a file system, unlike a move from ``$TMPDIR``), and the
directory is ``fsync``-ed so that the rename itself survives a power loss. A reader never
sees a partial file under the final name; a crash leaves at most a temporary file (a
hidden name, ``.<name>.tmp-<pid>``), which :func:`remove_temporaries` clears. A write that
fails (a full disk, an I/O error) removes its temporary file and raises the ``OSError``
with the target's path, so that the first failing write is named.

Each write also returns the :class:`FileRecord` (size and CRC32C) of the bytes it wrote,
computed as they are written, for the manifest that verifies them before any load.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import crc32c
import torch

__all__ = ["FileRecord", "WriteFault", "add_write_fault", "file_record", "fsync_directory",
           "make_directories", "remove_temporaries", "remove_write_fault", "save_atomically",
           "temporary_path", "write_atomically"]

TEMPORARY_MARK = ".tmp-"  # in every temporary file's name
_READ_CHUNK = 8 << 20

# Called before every chunk a write puts into a file, with the file's final path and the
# bytes written so far: where the testing aids inject a full disk or a crash mid-write.
WriteFault = Callable[[Path, int], None]
_write_faults: list[WriteFault] = []


def add_write_fault(fault: WriteFault) -> None:
    """Call ``fault(path, written)`` before every chunk written from now on (tests)."""
    _write_faults.append(fault)


def remove_write_fault(fault: WriteFault) -> None:
    """Stop calling ``fault`` (added by :func:`add_write_fault`)."""
    if fault in _write_faults:
        _write_faults.remove(fault)


@dataclass(frozen=True)
class FileRecord:
    """What a file held when it was written: its size in bytes and CRC32C."""

    size: int
    crc32c: int


def temporary_path(path: Path) -> Path:
    """Where the bytes of ``path`` are written before the rename (same directory)."""
    return path.parent / f".{path.name}{TEMPORARY_MARK}{os.getpid()}"


def fsync_directory(directory: Path) -> None:
    """Make the entries of ``directory`` (a rename, a new file, a removal) durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def make_directories(directory: Path) -> None:
    """Create ``directory`` and its missing parents, each new entry made durable."""
    missing = []
    current = directory
    while not current.exists():
        missing.append(current)
        current = current.parent
    for new in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another rank created it meanwhile
            new.mkdir()
        fsync_directory(new.parent)


class _ChecksummingWriter:
    """A binary file that keeps the CRC32C and size of what went through it."""

    def __init__(self, file: IO[bytes], target: Path) -> None:
        self.file = file
        self.target = target
        self.crc = 0
        self.size = 0
        # The first OSError a write raised: a serializer (torch.save's zip writer) may turn
        # it into an error of its own that no longer says ENOSPC.
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            for fault in _write_faults:
                fault(self.target, self.size)
            view = memoryview(data)
            written = self.file.write(view)
        except OSError as error:
            self.error = self.error or error
            raise
        self.crc = crc32c.crc32c(view, self.crc)
        self.size += view.nbytes
        return written

    def flush(self) -> None:
        self.file.flush()


def write_atomically(path: str | Path, write: Callable[[Any], None]) -> FileRecord:
    """Write ``path`` whole or not at all: ``write(file)`` fills a temporary file in the
    same directory, which is ``fsync``-ed and renamed over ``path``; the directory is
    ``fsync``-ed last. Returns the record of the bytes written.

    Raises:
        OSError: The write failed (``errno`` says why, ``filename`` is ``path``); the
            temporary file is removed and ``path`` is as it was before.
    """
    target = Path(path)
    make_directories(target.parent)
    partial = temporary_path(target)
    writer: _ChecksummingWriter | None = None
    try:
        with open(partial, "wb") as file:
            writer = _ChecksummingWriter(file, target)
            write(writer)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, target)
        fsync_directory(target.parent)
    except BaseException as error:
        with contextlib.suppress(OSError):
            partial.unlink()
        cause = writer.error if writer is not None and writer.error is not None else error
        if isinstance(cause, OSError):
            raise OSError(cause.errno, cause.strerror or str(cause), str(target)) from error
        raise
    return FileRecord(writer.size, writer.crc)


def save_atomically(obj: Any, path: str | Path) -> FileRecord:
    """``torch.save(obj)`` to ``path`` through :func:`write_atomically`."""
    return write_atomically(path, lambda file: torch.save(obj, file))


def file_record(path: str | Path) -> FileRecord:
    """The record (size, CRC32C) of the bytes ``path`` holds now (reads it once)."""
    crc, size = 0, 0
    with open(path, "rb") as file:
        while chunk := file.read(_READ_CHUNK):
            crc = crc32c.crc32c(chunk, crc)
            size += len(chunk)
    return FileRecord(size, crc)


def _temporaries(directory: Path) -> Iterator[Path]:
    for entry in directory.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            yield from _temporaries(entry)
        elif entry.name.startswith(".") and TEMPORARY_MARK in entry.name:
            yield entry


def remove_temporaries(directory: str | Path) -> list[Path]:
    """Remove the temporary files writes cut short left under ``directory`` (at any
    depth); the paths removed."""
    root = Path(directory)
    if not root.is_dir():
        return []
    removed = list(_temporaries(root))
    for path in removed:
        path.unlink(missing_ok=True)
    return removed
