"""The durable tier's writing side: a dense Lightning checkpoint every N-th window.

Sparse snapshots live in host memory and its replicas; a failure that takes every copy of
some piece (or every rank at once) needs a checkpoint that outlives host memory.
:class:`DurableCheckpoints` writes one through the Trainer's checkpoint IO
(asynchronously with ``AsyncCheckpointIO``) at the step after a window's last snapshot was
taken, every ``checkpoint.durable_every``-th window (the same steps on every rank: writing
is collective), and keeps the newest
``checkpoint.durable_keep``. Reading them back after a failure is
:mod:`~lightning_moe_ckpt.recovery.durable`.
"""

from __future__ import annotations

import lightning as L

from lightning_moe_ckpt.errors import fmt, require

__all__ = ["DurableCheckpoints"]


class DurableCheckpoints:
    """Which windows get a durable checkpoint, and the files written so far.

    Args:
        every: Write a durable checkpoint every this many windows; ``None``: no
            durable checkpoints.
        directory: Where durable checkpoints go; required when ``every`` is set.
        keep: Newest durable checkpoints kept; older ones are deleted (2 or more keeps a
            complete checkpoint while the next one is written).

    Raises:
        ConfigError: A bad value, naming its ``checkpoint.durable_*`` key.
    """

    def __init__(self, every: int | None, directory: str | None, keep: int) -> None:
        require(every is None or (isinstance(every, int) and every >= 1),
                f"{fmt('checkpoint.durable_every', every)} must be an integer >= 1 "
                "(or null: no durable checkpoints)")
        require(every is None or directory is not None,
                f"checkpoint.durable_every={every} needs checkpoint.durable_dir")
        require(isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1,
                f"{fmt('checkpoint.durable_keep', keep)} must be an integer >= 1 "
                "(2 or more keeps a complete checkpoint while the next one is written)")
        self.every = every
        self.directory = directory
        self.keep = keep
        self.saved: list[str] = []  # paths, oldest first
        self._window_seen: int | None = None
        self._window_count = 0
        self._first_step = 0  # windows starting before it are the initial-state snapshot

    def start_at(self, step: int) -> None:
        """Training (re)starts at ``step``: windows before it do not count."""
        self._first_step = step

    def due(self, window_start: int | None) -> bool:
        """Whether the window taken at ``window_start`` is newer than any seen before and
        the ``every``-th (a window taken again in a replay does not count twice)."""
        if (self.every is None or window_start is None or window_start < self._first_step
                or (self._window_seen is not None and window_start <= self._window_seen)):
            return False
        self._window_seen = window_start
        self._window_count += 1
        return self._window_count % self.every == 0

    def write(self, trainer: L.Trainer) -> None:
        """Save the live state at this step (the dense checkpoint that converting the
        persisted window and replaying up to this step would produce), then delete all but
        the newest ``keep``.

        The checkpoint IO writes in submission order (``AsyncCheckpointIO`` has one writer
        thread), so with ``keep >= 2`` the newest completed checkpoint is never the one
        deleted, whatever the newest's write is doing."""
        assert self.directory is not None  # checked at construction when every is set
        path = f"{self.directory}/step={trainer.global_step}.ckpt"
        trainer.save_checkpoint(path)
        self.saved.append(path)
        while len(self.saved) > self.keep:
            trainer.strategy.remove_checkpoint(self.saved.pop(0))
