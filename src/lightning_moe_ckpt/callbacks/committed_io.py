"""The Trainer's checkpoint IO under ``SparseCheckpointing``: atomic writes, verified loads.

Lightning's ``TorchCheckpointIO`` writes to a temporary file in ``$TMPDIR`` and moves it
into place (a copy straight into the final name across file systems), fsyncs nothing, and
loads whatever bytes it finds. :class:`CommittedCheckpointIO` replaces it (and
``AsyncCheckpointIO`` around it) when ``SparseCheckpointing`` starts:

* a file the strategy saves while a durable checkpoint is being taken is handed to the
  durable tier (:class:`~lightning_moe_ckpt.callbacks.DurableCheckpoints`), which writes it
  in the background and commits the checkpoint with its manifest;
* any other save (a ``ModelCheckpoint`` of yours) is written at once through the library's
  one write path (temporary file in the same directory, fsync, rename, fsync of the
  directory);
* a load of a file of a committed durable checkpoint checks its bytes against the
  manifest before unpickling them (one line naming the file when they differ); a file of
  a durable directory that was never committed is refused.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning_moe_ckpt.core.files import save_atomically
from lightning_moe_ckpt.errors import CorruptCheckpointError
from lightning_moe_ckpt.recovery.durable import check_layout
from lightning_moe_ckpt.recovery.manifest import (
    committed_steps,
    manifest_path,
    parts_directory,
    read_manifest,
    verify_bytes,
)

__all__ = ["CommittedCheckpointIO", "PendingFile", "checkpoint_io_replaceable", "durable_file",
           "in_durable_directory"]

log = logging.getLogger("lightning_moe_ckpt")

# (where, what): a file of a durable checkpoint, its tensors cloned on the training thread
PendingFile = tuple[Path, dict[str, Any]]


def _clone(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone()  # the next optimizer step must not change what is saved


def durable_file(path: Path) -> tuple[Path, str] | None:
    """The durable checkpoint ``path`` belongs to (``step=N.ckpt`` itself, or a file in
    that directory) and its name relative to the durable directory; None otherwise."""
    for checkpoint in (path, path.parent):
        if checkpoint.name.startswith("step=") and checkpoint.name.endswith(".ckpt"):
            try:
                manifest_path(checkpoint)
            except ValueError:
                continue
            return checkpoint, str(path.relative_to(checkpoint.parent))
    return None


class CommittedCheckpointIO(CheckpointIO):
    """Checkpoint IO that writes atomically and verifies durable checkpoints on load."""

    def __init__(self) -> None:
        self.collecting: list[PendingFile] | None = None  # set while a durable save runs
        # The layout of the run that loads (a durable checkpoint of another is refused).
        self.layout: dict[str, Any] | None = None
        self._plain = TorchCheckpointIO()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("CommittedCheckpointIO.save_checkpoint takes no storage_options "
                            f"(got {storage_options!r})")
        target = Path(path)
        if self.collecting is not None:
            self.collecting.append((target, apply_to_collection(checkpoint, torch.Tensor,
                                                                _clone)))
            return
        save_atomically(checkpoint, target)

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        file = Path(path)
        found = durable_file(file)
        if found is None or not in_durable_directory(found[0]):
            return self._plain.load_checkpoint(file, map_location=map_location,
                                               weights_only=weights_only)
        checkpoint, name = found
        if not manifest_path(checkpoint).exists():
            raise CorruptCheckpointError(
                f"{checkpoint} is not a committed durable checkpoint (no "
                f"{manifest_path(checkpoint).name}: its write did not finish)")
        if self.layout is not None:
            check_layout(checkpoint, read_manifest(checkpoint), self.layout)
        data = file.read_bytes()
        verify_bytes(checkpoint, name, data)
        # Our own bytes, verified: Lightning checkpoints hold more than tensors.
        loaded: dict[str, Any] = torch.load(
            io.BytesIO(data), map_location=map_location if map_location is not None else
            (lambda storage, location: storage),
            weights_only=False if weights_only is None else weights_only)
        return loaded

    @override
    def remove_checkpoint(self, path: Any) -> None:
        target = Path(path)
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        elif target.exists():
            os.unlink(target)

    @override
    def teardown(self) -> None:
        self.collecting = None


def in_durable_directory(checkpoint: Path) -> bool:
    """Whether ``checkpoint`` lies where the durable tier writes (its directory holds
    manifests or parts): a file of yours that is merely named ``step=N.ckpt`` is not."""
    root = checkpoint.parent
    return (manifest_path(checkpoint).exists() or parts_directory(checkpoint).exists()
            or bool(committed_steps(root)))


def checkpoint_io_replaceable(plugin: CheckpointIO) -> bool:
    """Whether ``plugin`` is Lightning's default IO (``TorchCheckpointIO``, maybe inside
    ``AsyncCheckpointIO``), which :class:`CommittedCheckpointIO` replaces."""
    if isinstance(plugin, CommittedCheckpointIO) or type(plugin) is TorchCheckpointIO:
        return True
    return isinstance(plugin, AsyncCheckpointIO) and (
        plugin.checkpoint_io is None or type(plugin.checkpoint_io) is TorchCheckpointIO)
