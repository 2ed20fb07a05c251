"""The supervised job's protocol, in one place: what the supervisor, the monitors and the
workers say to each other through the job's store, how they find it, and how they end.

* **Environment** (``ENV_*``): set by the supervisor (or the batch script) in every
  process of the job.
* **Store keys** (``*_KEY`` and the ``*_key`` functions): what each side writes and reads.
* **Exit codes** (``EXIT_*``): what a worker's end tells the supervisor, and the job's
  end its batch script.
* **Sealed messages** (:class:`ControlChannel`): the messages that drive the job (kill a
  task, a task gone and its exit code, a registration, the job's shape and the answer to
  it, the generation, the ranks it replaces, a spare's assignment, each generation's
  rendezvous port, the hang timeout) carry an HMAC-SHA256 tag from the job's secret
  (``MOE_JOB_SECRET``); a message without a valid tag is ignored and logged, so a client
  that can reach the store port but does not hold the secret cannot kill, re-route or
  re-shape the job. Counters (heartbeats, arrivals) and the status view are not sealed:
  a forged heartbeat can at most delay the detection of a hang.
* **The store's address** (:func:`hosted_store`): the job's stores listen on the address
  given (``--host``) alone, not on every interface.

The threat model (docs: "Running on a cluster"): torch.distributed trusts its network
(its security policy: trusted networks only) and so does the process groups' traffic
here; what this module adds is that the control plane, which can kill and re-route
ranks, obeys only the job's own processes.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import socket
import time
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore

__all__ = [
    "ENV_AGENT_STORE",
    "ENV_GENERATION",
    "ENV_REPLACES",
    "ENV_SECRET",
    "ENV_SPARE",
    "ENV_STORE",
    "EXIT_CONFIG",
    "EXIT_NO_SPARE",
    "EXIT_PREEMPTED",
    "EXIT_SUPERVISOR_LOST",
    "EXIT_UNRECOVERABLE",
    "FINISHED_KEY",
    "GENERATION_KEY",
    "LAYOUT_KEY",
    "PREEMPT_GRACE_S",
    "PREEMPT_KEY",
    "READY_KEY",
    "SIGTERMS_KEY",
    "STATUS_KEY",
    "TIMEOUT_KEY",
    "ControlChannel",
    "ForgedMessage",
    "exit_key",
    "failed_key",
    "finished_key",
    "gone_key",
    "heartbeat_key",
    "hosted_store",
    "is_replacement",
    "job_secret",
    "kill_key",
    "rendezvous_key",
    "sigterm_key",
    "spare_key",
    "task_key",
]

log = logging.getLogger("lightning_moe_ckpt")

ENV_GENERATION = "MOE_GENERATION"  # the generation a worker was started in
ENV_REPLACES = "MOE_REPLACES"  # set in a replacement: the generation it joins
ENV_STORE = "MOE_STORE"  # host:port of the supervisor's store
ENV_SPARE = "MOE_SPARE"  # set in a warm spare: its index (it waits for a rank)
# A worker's exit code for "no recovery can succeed" (nothing left to recover from): the
# supervisor stops the job instead of replacing the worker again.
EXIT_UNRECOVERABLE = 86
# A worker's exit code when its supervisor is gone: no failure could be recovered any
# more and nobody would collect its results.
EXIT_SUPERVISOR_LOST = 87
# A worker stopped on a configuration error (ConfigError): a replacement would stop on it
# too, so the job stops at once with the message instead of replacing it.
EXIT_CONFIG = 88
# Ranks failed and no replacement is left (``max_restarts`` used up): the job ends, and
# started again (SLURM ``--requeue``, a wrapper loop) it resumes from its newest durable
# checkpoint.
EXIT_NO_SPARE = 89
# Every rank stopped on a preemption (a SIGTERM to the job): each committed a durable
# checkpoint of the step it stopped at where the durable tier is on; started again, the job
# resumes from it.
EXIT_PREEMPTED = 85
# A worker the supervisor gave up on and replaced (a machine cut off, then back) learned
# it was fenced and stopped itself: its rank lives on in its replacement.
EXIT_FENCED = 84
FINISHED_KEY = "finished"  # counter: workers whose training loop ended
PREEMPT_KEY = "preempt"  # set by the supervisor: the job is preempted, every rank stops
SIGTERMS_KEY = "sigterms"  # counter: workers that received a SIGTERM
PREEMPT_GRACE_S = 20.0  # default: how long preempted workers have to save and exit
# torch.distributed's env:// rendezvous connects to MASTER_ADDR:MASTER_PORT as a client on
# every rank (none hosts the store) when this is "True".
ENV_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


TIMEOUT_KEY = "timeout_s"  # the supervisor's hang timeout, which workers must share
STATUS_KEY = "status"  # the live view (as status_path holds it), for the workers


def is_replacement() -> bool:
    """Whether this process replaces a failed worker of a running job (the supervisor
    started it with the generation it joins)."""
    return ENV_REPLACES in os.environ


def rendezvous_key(generation: int) -> str:
    """The job-store key holding the port of ``generation``'s rendezvous store."""
    return f"rendezvous/{generation}"


def heartbeat_key(rank: int, pid: int) -> str:
    """The store counter a worker process bumps (per process: a replacement starts anew)."""
    return f"hb/{rank}/{pid}"


def sigterm_key(rank: int, pid: int) -> str:
    """Set by worker process ``pid`` of ``rank`` when it received a SIGTERM."""
    return f"sigterm/{rank}/{pid}"


def finished_key(rank: int, pid: int) -> str:
    """Set by a worker process whose training loop ended: its heartbeat stops for good."""
    return f"finished/{rank}/{pid}"




LAYOUT_KEY = "job/layout"  # the job's shape, from task 0 when the supervisor was not told
READY_KEY = "job/ready"  # the supervisor's answer to the tasks: the layout, or an error
GENERATION_KEY = "generation"  # the newest generation the supervisor opened


def failed_key(generation: int) -> str:
    """The ranks whose failure opened ``generation`` (a JSON list)."""
    return f"failed/{generation}"


def fenced_key(rank: int, pid: int) -> str:
    """Set by the supervisor for a worker process it gave up on (``{"generation", "host"}``):
    that process may still run (its machine was cut off or frozen) and must take no part
    in a newer generation; it stops itself once it reads this."""
    return f"fenced/{rank}/{pid}"


def spare_key(index: int) -> str:
    """A warm spare's assignment (``{"rank", "generation", "master_port"}``, or null: the
    job ended without it)."""
    return f"spare/{index}"


def task_key(task: int) -> str:
    """Registration: ``{"pid", "node", "host"}`` of task ``task``."""
    return f"task/{task}"


def gone_key(task: int) -> str:
    """Set by a task's monitor once the task exited."""
    return f"gone/{task}"


def exit_key(task: int) -> str:
    """The exit code a task wrote before it left on its own."""
    return f"exit/{task}"


def kill_key(task: int) -> str:
    """Set by the supervisor: the task's monitor kills it."""
    return f"kill/{task}"




# The job's secret: a hex string every process of the job has in its environment (never
# on a command line or in a file others can read). The supervisor creates one for the
# processes it starts; a batch script exports one for the supervisor and srun's tasks.
ENV_SECRET = "MOE_JOB_SECRET"
_TAG_HEX = 64  # an HMAC-SHA256 tag, hex
_POLL_S = 0.05


def job_secret(create: bool = False) -> str | None:
    """The job's secret from the environment; with ``create``, a new one set there when
    none is (for the processes this one starts)."""
    secret = os.environ.get(ENV_SECRET)
    if not secret and create:
        secret = secrets.token_hex(32)
        os.environ[ENV_SECRET] = secret
    return secret or None


class ForgedMessage(RuntimeError):
    """A control message whose tag is not the job secret's (never raised to a caller that
    reads with :meth:`ControlChannel.read`; see :meth:`ControlChannel.wait`)."""


class ControlChannel:
    """Sealed control messages on a job store.

    Args:
        store: The job's store (a client or the host's own).
        secret: The job's secret (:data:`ENV_SECRET`).
    """

    def __init__(self, store: TCPStore, secret: str) -> None:
        self.store = store
        self._key = secret.encode()
        self._forged: set[tuple[str, bytes]] = set()  # logged once each
        self.forgeries = 0  # forged messages seen (each distinct one once)

    def on(self, store: TCPStore) -> ControlChannel:
        """The same job's channel over another connection (one per thread)."""
        channel = ControlChannel(store, "")
        channel._key = self._key
        return channel

    def _tag(self, key: str, value: bytes) -> bytes:
        mac = hmac.new(self._key, key.encode() + b"\0" + value, hashlib.sha256)
        return mac.hexdigest().encode()

    def set(self, key: str, value: str) -> None:
        """Write ``value`` under ``key``, sealed."""
        self.store.set(key, f"{self._tag(key, value.encode()).decode()}:{value}")

    def read(self, key: str) -> str | None:
        """The value under ``key`` when it is there and sealed by the job (non-blocking);
        None when absent, or forged (logged once per forged value)."""
        if not self.store.check([key]):
            return None
        return self._open(key, self.store.get(key))

    def wait(self, key: str, timeout_s: float) -> str:
        """The sealed value under ``key``, waiting until one is there; a forged one is
        logged and waited past (the job's own message may still come).

        Raises:
            TimeoutError: None came within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while (value := self.read(key)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no message {key!r} from the job within {timeout_s:g} s")
            time.sleep(_POLL_S)
        return value

    def set_record(self, key: str, record: dict[str, Any]) -> None:
        """Write ``record`` under ``key`` as a JSON object whose ``"seal"`` field holds the
        tag (the record stays plain JSON for a reader that does not check it)."""
        body = json.dumps(record, sort_keys=True)
        self.store.set(key, json.dumps({**record, "seal": self._tag(key, body.encode()).decode()}))

    def read_record(self, key: str) -> dict[str, Any] | None:
        """A record :meth:`set_record` wrote, when there and sealed (non-blocking)."""
        if not self.store.check([key]):
            return None
        raw = self.store.get(key)
        try:
            record = json.loads(raw)
            seal = str(record.pop("seal")).encode()
        except (ValueError, KeyError, AttributeError, TypeError):
            record, seal = None, b""
        if record is not None:
            body = json.dumps(record, sort_keys=True).encode()
            if hmac.compare_digest(seal, self._tag(key, body)):
                return dict(record)
        self._open(key, b"")  # logged as forged (once)
        return None

    def _open(self, key: str, raw: bytes) -> str | None:
        tag, sep, data = raw.partition(b":")
        if sep and len(tag) == _TAG_HEX and hmac.compare_digest(tag, self._tag(key, data)):
            return data.decode()
        if (key, raw) not in self._forged:
            self._forged.add((key, raw))
            self.forgeries += 1
            log.error("a message %r=%r on the job's store is not sealed with the job's "
                      "secret (%s): ignored; someone who can reach the store's port wrote "
                      "it", key, raw[:64], ENV_SECRET)
        return None


def hosted_store(host: str, port: int, timeout: timedelta) -> TCPStore:
    """A job store hosted by this process, listening on ``host``'s address alone (``port``
    0: a free one): torch's ``TCPStore`` would listen on every interface.

    A name that resolves to loopback addresses only although it is no loopback name (a
    host's own name mapped to 127.0.1.1 in ``/etc/hosts``, while other machines reach it
    by another address) is served on every interface, with a warning: bound to loopback,
    no other machine could reach the job."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    outside = [entry for entry in found if not ipaddress.ip_address(entry[4][0]).is_loopback]
    family, kind, proto, _, address = (outside or found)[0]
    if not outside and not _loopback_name(host):
        log.warning("the job's store host %r resolves to %s here, a loopback address no "
                    "other machine reaches: the store listens on every interface (give "
                    "--host an address the nodes reach it at to listen there alone)",
                    host, address[0])
        address = ("::" if family == socket.AF_INET6 else "0.0.0.0", *address[1:])
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(address)
    listener.listen(socket.SOMAXCONN)
    bound = listener.getsockname()[1]
    # The store serves on the descriptor from here on, for this process's life.
    return TCPStore(host, bound, is_master=True, wait_for_workers=False, timeout=timeout,
                    master_listen_fd=listener.detach())


def _loopback_name(host: str) -> bool:
    """Whether ``host`` names loopback itself (``localhost``, ``127.0.0.1``, ``::1``)."""
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
