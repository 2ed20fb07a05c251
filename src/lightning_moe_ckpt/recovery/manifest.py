"""Committed durable checkpoints: the manifest, the commit, verification, retention.

A durable checkpoint of step N in ``checkpoint.durable_dir`` is what the Trainer's
strategy writes under ``step=N.ckpt`` (one file; a directory of ``rank<NNNNN>.ckpt``
files, one per rank, under ``MoEParallelStrategy``; a DCP directory under Lightning's
``ModelParallelStrategy``), and it **exists only once its manifest** ``step=N.manifest.json``
is committed beside it. The commit protocol:

1. every rank writes its files (each through
   :func:`~lightning_moe_ckpt.core.files.write_atomically`: temporary file in the same
   directory, ``fsync``, rename, ``fsync`` of the directory) and then its *part*,
   ``step=N.ckpt.parts/rank<NNNNN>.json``: each file's size and CRC32C, or the error that
   stopped its write;
2. the rank that writes the last part commits: it writes the manifest (the step, the
   layout, every file's size and CRC32C, and a CRC32C of the manifest itself), the
   manifest last, and removes the parts. A part that names an error makes the checkpoint
   fail instead: its files are removed, the previous committed one stays.

So a crash at any moment leaves either a committed checkpoint or files without a
manifest, which are never taken for one: :func:`clean_directory` removes them when a run
starts. Every load verifies first (:func:`verify`: each file's size and CRC32C against the
manifest). Retention (:func:`retain`) removes an older checkpoint only once a newer one is
committed, its manifest first, so at every moment at least one committed checkpoint
exists once one was written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c

from lightning_moe_ckpt.core.files import (
    FileRecord,
    file_record,
    fsync_directory,
    remove_temporaries,
    write_atomically,
)
from lightning_moe_ckpt.errors import CorruptCheckpointError

__all__ = ["Manifest", "checkpoint_path", "checkpoint_step", "clean_directory",
           "committed_steps", "manifest_path", "read_manifest", "remove_checkpoint",
           "retain", "try_commit", "uncommit", "verify", "write_part"]

log = logging.getLogger("lightning_moe_ckpt")

FORMAT = 1  # the manifest's format version
SUPERSEDED = "superseded"  # where committed checkpoints of an abandoned run are set aside
_NAME = re.compile(r"step=(\d+)\.ckpt")
_MANIFEST = re.compile(r"step=(\d+)\.manifest\.json")


def checkpoint_path(directory: str | Path, step: int) -> Path:
    """The durable checkpoint of ``step`` in ``directory``: ``step=N.ckpt``."""
    return Path(directory) / f"step={step}.ckpt"


def checkpoint_step(path: str | Path) -> int:
    """The step a durable checkpoint resumes at (its ``step=N.ckpt`` name).

    Raises:
        ValueError: ``path`` is not named ``step=N.ckpt``.
    """
    match = _NAME.fullmatch(Path(path).name)
    if match is None:
        raise ValueError(f"{str(path)!r} is not a durable checkpoint name (step=N.ckpt)")
    return int(match.group(1))


def manifest_path(checkpoint: str | Path) -> Path:
    """The manifest that commits ``checkpoint``: ``step=N.manifest.json`` beside it."""
    path = Path(checkpoint)
    return path.with_name(f"step={checkpoint_step(path)}.manifest.json")


def parts_directory(checkpoint: str | Path) -> Path:
    """Where the ranks' parts of ``checkpoint`` wait for the commit."""
    path = Path(checkpoint)
    return path.with_name(path.name + ".parts")


@dataclass(frozen=True)
class Manifest:
    """What a committed durable checkpoint holds.

    Attributes:
        step: The step it resumes at.
        world_size: The ranks that wrote it.
        layout: The layout it was written in, which a resume must use too.
        files: Each file (relative to the durable directory) with its size and CRC32C.
    """

    step: int
    world_size: int
    layout: dict[str, Any]
    files: dict[str, FileRecord]

    def encode(self) -> bytes:
        """The manifest file's bytes (with a CRC32C of its content)."""
        body = {"format": FORMAT, "step": self.step, "world_size": self.world_size,
                "layout": self.layout,
                "files": {name: [r.size, r.crc32c] for name, r in sorted(self.files.items())}}
        text = json.dumps(body, sort_keys=True)
        return json.dumps({"manifest": body,
                           "crc32c": crc32c.crc32c(text.encode())}, indent=1).encode()

    @classmethod
    def decode(cls, data: bytes, where: Path) -> Manifest:
        """The manifest in ``data`` (read from ``where``).

        Raises:
            CorruptCheckpointError: It does not decode, or fails its own checksum.
        """
        try:
            outer = json.loads(data)
            body = outer["manifest"]
            text = json.dumps(body, sort_keys=True)
            if crc32c.crc32c(text.encode()) != outer["crc32c"]:
                raise ValueError("its content does not match its CRC32C")
            if body["format"] != FORMAT:
                raise ValueError(f"format {body['format']}, this version reads {FORMAT}")
            return cls(int(body["step"]), int(body["world_size"]), dict(body["layout"]),
                       {str(name): FileRecord(int(size), int(crc))
                        for name, (size, crc) in body["files"].items()})
        except (ValueError, KeyError, TypeError) as error:
            raise CorruptCheckpointError(f"manifest {where} is damaged ({error})") from None


def read_manifest(checkpoint: str | Path) -> Manifest:
    """The manifest of ``checkpoint``.

    Raises:
        CorruptCheckpointError: It is missing (not committed) or damaged.
    """
    path = manifest_path(checkpoint)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{checkpoint} is not committed (no {path.name}: its "
                                     "write did not finish)") from None
    return Manifest.decode(data, path)


def verify(checkpoint: str | Path, only: Iterable[str] | None = None) -> Manifest:
    """Check ``checkpoint`` against its manifest before any of it is loaded: every file
    (or those of ``only``, names relative to the durable directory) present with its
    size and CRC32C. Returns the manifest.

    Raises:
        CorruptCheckpointError: One line naming the file and what failed.
    """
    path = Path(checkpoint)
    manifest = read_manifest(path)
    names = sorted(manifest.files) if only is None else sorted(only)
    for name in names:
        expected = manifest.files.get(name)
        if expected is None:
            raise CorruptCheckpointError(f"{path}: {name} is not in its manifest")
        problem = _file_problem(path.parent / name, expected)
        if problem is not None:
            raise CorruptCheckpointError(f"durable checkpoint {path} is damaged: {problem}")
    return manifest


def verify_bytes(checkpoint: str | Path, name: str, data: bytes | memoryview) -> None:
    """Check bytes read from file ``name`` of ``checkpoint`` against its manifest.

    Raises:
        CorruptCheckpointError: One line naming the file and what failed.
    """
    path = Path(checkpoint)
    expected = read_manifest(path).files.get(name)
    if expected is None:
        raise CorruptCheckpointError(f"{path}: {name} is not in its manifest")
    size, crc = len(data), crc32c.crc32c(data)
    if (size, crc) != (expected.size, expected.crc32c):
        raise CorruptCheckpointError(
            f"durable checkpoint {path} is damaged: {name} " + _mismatch(
                FileRecord(size, crc), expected))


def _file_problem(file: Path, expected: FileRecord) -> str | None:
    try:
        found = file_record(file)
    except FileNotFoundError:
        return f"{file.name} is missing"
    except OSError as error:
        return f"{file.name} cannot be read ({error})"
    if found == expected:
        return None
    return f"{file.name} " + _mismatch(found, expected)


def _mismatch(found: FileRecord, expected: FileRecord) -> str:
    if found.size != expected.size:
        return f"has {found.size} bytes where its manifest says {expected.size}"
    return (f"has CRC32C {found.crc32c:#010x} where its manifest says "
            f"{expected.crc32c:#010x}")


def committed_steps(directory: str | Path) -> list[int]:
    """The steps with a manifest in ``directory``, ascending (not verified)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(int(match.group(1)) for entry in root.iterdir()
                  if (match := _MANIFEST.fullmatch(entry.name)))


def write_part(checkpoint: Path, rank: int, world_size: int, layout: Mapping[str, Any],
               files: Mapping[str, FileRecord], error: str | None = None) -> None:
    """Rank ``rank``'s part of ``checkpoint``: its files' records, or the ``error`` that
    stopped its write."""
    part = {"rank": rank, "world_size": world_size, "layout": dict(layout),
            "files": {name: [r.size, r.crc32c] for name, r in files.items()},
            "error": error}
    data = json.dumps(part).encode()
    write_atomically(parts_directory(checkpoint) / f"rank{rank:05d}.json",
                     lambda file: file.write(data))


def try_commit(checkpoint: Path, world_size: int) -> Manifest | str | None:
    """Commit ``checkpoint`` if every rank's part is there: the manifest (``None`` while
    parts are missing; the error text when a part names one: the checkpoint's files are
    then removed)."""
    parts_dir = parts_directory(checkpoint)
    parts: list[dict[str, Any]] = []
    for rank in range(world_size):
        try:
            parts.append(json.loads((parts_dir / f"rank{rank:05d}.json").read_bytes()))
        except FileNotFoundError:
            return None
    errors = [f"rank {p['rank']}: {p['error']}" for p in parts if p["error"] is not None]
    if errors:
        remove_checkpoint(checkpoint)
        return "; ".join(errors)
    files = {str(name): FileRecord(int(size), int(crc))
             for part in parts for name, (size, crc) in part["files"].items()}
    manifest = Manifest(checkpoint_step(checkpoint), world_size, dict(parts[0]["layout"]),
                        files)
    data = manifest.encode()
    write_atomically(manifest_path(checkpoint), lambda file: file.write(data))
    shutil.rmtree(parts_dir, ignore_errors=True)
    return manifest


def uncommit(checkpoint: Path) -> None:
    """Remove ``checkpoint``'s manifest (durably): from now on it is not a checkpoint."""
    path = manifest_path(checkpoint)
    if path.exists():
        path.unlink(missing_ok=True)
        fsync_directory(path.parent)


def remove_checkpoint(checkpoint: Path) -> None:
    """Remove ``checkpoint``: its manifest first, then its files and parts."""
    uncommit(checkpoint)
    if checkpoint.is_dir():
        shutil.rmtree(checkpoint, ignore_errors=True)
    else:
        checkpoint.unlink(missing_ok=True)
    shutil.rmtree(parts_directory(checkpoint), ignore_errors=True)


def _written_steps(root: Path) -> list[int]:
    """Steps with a ``step=N.ckpt`` (committed or not) in ``root``."""
    return sorted(int(match.group(1)) for entry in root.iterdir()
                  if (match := _NAME.fullmatch(entry.name)))


def retain(directory: str | Path, newest: int, keep: int) -> list[int]:
    """Once step ``newest`` is committed: remove the committed checkpoints older than the
    newest ``keep`` of those up to ``newest``, and the uncommitted ones older than
    ``newest`` (writes that failed); the steps removed."""
    root = Path(directory)
    committed = [step for step in committed_steps(root) if step <= newest]
    removed = [step for step in committed[:-keep] if step < newest]
    removed += [step for step in _written_steps(root)
                if step < newest and step not in committed]
    for step in removed:
        remove_checkpoint(checkpoint_path(root, step))
    return sorted(set(removed))


def clean_directory(directory: str | Path, start_step: int) -> None:
    """Before a run writes into ``directory``, starting at ``start_step``: remove what
    writes cut short left (temporary files, parts, checkpoints without a manifest), and
    set committed checkpoints newer than ``start_step`` (an abandoned run's) aside under
    ``superseded/``, where they are kept but never resumed from. Each is logged."""
    root = Path(directory)
    if not root.is_dir():
        return
    for path in remove_temporaries(root):
        log.warning("durable tier: removed %s (a write cut short)", path)
    committed = set(committed_steps(root))
    for entry in sorted(root.iterdir()):
        if entry.name.endswith(".ckpt.parts"):
            shutil.rmtree(entry, ignore_errors=True)
            log.warning("durable tier: removed %s (a commit that did not finish)", entry)
    for step in _written_steps(root):
        if step not in committed:
            remove_checkpoint(checkpoint_path(root, step))
            log.warning("durable tier: removed %s: not committed (no manifest; its write "
                        "did not finish)", checkpoint_path(root, step))
    for step in sorted(committed):
        if step > start_step:
            _set_aside(root, step)
    fsync_directory(root)


def _set_aside(root: Path, step: int) -> None:
    aside = root / SUPERSEDED
    aside.mkdir(exist_ok=True)
    checkpoint = checkpoint_path(root, step)
    manifest = manifest_path(checkpoint)
    with contextlib.suppress(FileNotFoundError):
        manifest.replace(aside / manifest.name)  # uncommitted here first
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(aside / checkpoint.name, ignore_errors=True)
        checkpoint.replace(aside / checkpoint.name)
    log.warning("durable tier: this run starts before step %d: the committed %s (another "
                "run's newer state) is set aside under %s and never resumed from", step,
                checkpoint, aside)
