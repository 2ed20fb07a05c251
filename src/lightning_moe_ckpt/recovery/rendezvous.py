"""A worker's side of the supervised job: the store, generations, heartbeat, rendezvous.

Under :mod:`~lightning_moe_ckpt.recovery.supervisor` every worker reaches the
supervisor's ``TCPStore`` (``MOE_STORE``). The default process group of generation ``g``
is formed on the store prefix ``gen<g>/`` (``torch.distributed.PrefixStore``), so the keys
of a broken generation never mix with the next one's. A worker bumps its heartbeat
counter at every iteration (and, while it recovers, from a helper thread, since a
recovery may legitimately wait for a replacement to start).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from lightning_moe_ckpt.recovery.supervisor import ENV_GENERATION, ENV_REPLACES, ENV_STORE

_BUSY_BEAT_S = 0.5


def _client(address: str, timeout: timedelta) -> TCPStore:
    host, port = address.rsplit(":", 1)
    return TCPStore(host, int(port), is_master=False, timeout=timeout)


def supervised() -> bool:
    """Whether this process is a worker of a supervised job."""
    return ENV_STORE in os.environ


@dataclass
class JobStore:
    """This worker's handle on the supervised job."""

    store: TCPStore
    address: str
    rank: int
    world_size: int
    generation: int  # the generation this process's process groups belong to
    replaces: int | None  # the generation a replacement joins (None: an original worker)
    timeout: timedelta

    @classmethod
    def from_env(cls, timeout: timedelta = timedelta(seconds=300)) -> JobStore | None:
        """The job store when this process runs under the supervisor, else ``None``."""
        address = os.environ.get(ENV_STORE)
        if address is None:
            return None
        replaces = os.environ.get(ENV_REPLACES)
        return cls(_client(address, timeout), address, int(os.environ["RANK"]),
                   int(os.environ["WORLD_SIZE"]), int(os.environ.get(ENV_GENERATION, "0")),
                   None if replaces is None else int(replaces), timeout)

    def current_generation(self) -> int:
        """The newest generation the supervisor opened."""
        return int(self.store.get("generation"))

    def failed_ranks(self, generation: int) -> tuple[int, ...]:
        """The ranks whose failure opened ``generation``."""
        return tuple(json.loads(self.store.get(f"failed/{generation}")))

    def heartbeat(self) -> None:
        """Progress: this worker is about to run another iteration."""
        self.store.add(f"hb/{self.rank}", 1)

    def join(self, generation: int, backend: str) -> None:
        """Form the default process group of ``generation`` (collective over the world)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        store = PrefixStore(f"gen{generation}/", self.store)
        dist.init_process_group(backend, store=store, rank=self.rank,
                                world_size=self.world_size, timeout=self.timeout)
        self.generation = generation

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Keep the heartbeat going while this worker recovers (it may wait long)."""
        stop = threading.Event()
        store = _client(self.address, self.timeout)  # its own connection: thread-safe

        def beat() -> None:
            while not stop.wait(_BUSY_BEAT_S):
                store.add(f"hb/{self.rank}", 1)

        thread = threading.Thread(target=beat, name="recovery-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
