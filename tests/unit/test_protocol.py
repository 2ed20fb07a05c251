"""The supervised job's control plane: sealed messages, and stores that listen on the
address they are given."""

from __future__ import annotations

import socket
from datetime import timedelta
from unittest import mock

import pytest
from torch.distributed import TCPStore

from lightning_moe_ckpt.failures.protocol import ControlChannel, hosted_store


@pytest.fixture
def store() -> TCPStore:
    return hosted_store("127.0.0.1", 0, timedelta(seconds=10))


def test_a_sealed_message_is_read_and_a_forged_one_is_ignored_and_logged(
        store: TCPStore, caplog: pytest.LogCaptureFixture) -> None:
    job, stranger = ControlChannel(store, "a" * 64), ControlChannel(store, "b" * 64)
    job.set("kill/1", "1")
    assert job.read("kill/1") == "1" and job.read("kill/2") is None
    stranger.set("kill/2", "1")  # sealed, but with another secret
    store.set("kill/3", "1")  # not sealed at all
    store.set("kill/4", store.get("kill/1"))  # the job's own message, under another key
    assert [job.read(f"kill/{t}") for t in (2, 3, 4)] == [None, None, None]
    assert job.forgeries == 3 and caplog.text.count("is not sealed with the job's secret") == 3
    job.read("kill/3")
    assert job.forgeries == 3  # each forged message is logged once
    with pytest.raises(TimeoutError, match="no message 'kill/3'"):
        job.wait("kill/3", 0.2)


def test_a_record_stays_plain_json_and_is_sealed(store: TCPStore) -> None:
    import json

    job = ControlChannel(store, "a" * 64)
    job.set_record("task/0", {"pid": 7, "node": 1})
    assert json.loads(store.get("task/0"))["pid"] == 7  # a plain reader reads it
    assert job.read_record("task/0") == {"pid": 7, "node": 1}
    altered = {**json.loads(store.get("task/0")), "node": 0}
    store.set("task/0", json.dumps(altered))
    assert job.read_record("task/0") is None


def test_the_store_listens_on_its_host_alone() -> None:
    store = hosted_store("127.0.0.1", 0, timedelta(seconds=10))
    TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5)).set("a", "b")
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.2", store.port), timeout=2).close()


def test_a_host_name_that_resolves_to_loopback_alone_is_served_everywhere(
        caplog: pytest.LogCaptureFixture) -> None:
    """This machine's name mapped to 127.0.1.1 (as /etc/hosts often maps it): bound
    there, no other machine could reach the store, so it listens on every interface and
    says so."""
    loopback = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))]
    with mock.patch("socket.getaddrinfo", return_value=loopback):
        store = hosted_store(socket.gethostname(), 0, timedelta(seconds=10))
    assert "resolves to 127.0.1.1 here" in caplog.text
    socket.create_connection(("127.0.0.2", store.port), timeout=2).close()  # every interface
