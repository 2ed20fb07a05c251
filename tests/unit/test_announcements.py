"""Announcement pages: how a source tells its same-node peers of a snapshot, with no message.

A record reads back as written; one not (wholly) written yet, torn, or of an earlier lap
of the ring reads as absent; the peers' cells and both sides' states are their own words;
a partner's death is seen through its pidfd; and a source reuses a slot only once its
slowest peer filed two windows past it.
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys

from lightning_moe_ckpt.replication.announcements import (
    RECORDS,
    Announcement,
    AnnouncementPage,
    Liveness,
    PartnerState,
    page_bytes,
)
from lightning_moe_ckpt.replication.shared_slots import SlotHandle, SlotRing

BOUNDED_S = 60.0


def _page(world_size: int = 4) -> AnnouncementPage:
    return AnnouncementPage(mmap.mmap(-1, page_bytes(world_size)), world_size)


def _announcement(seq: int, step: int = 7) -> Announcement:
    return Announcement(seq, SlotHandle(1000 + seq, 4242, 17, seq, 65536, 99, 3),
                        window_start=6, step=step, epoch=2)


def test_an_announcement_reads_back_as_written() -> None:
    page = _page()
    assert page.read(1) is None  # nothing announced yet
    page.announce(_announcement(1))
    assert page.read(1) == _announcement(1)
    assert page.read(2) is None


def test_a_torn_record_reads_as_not_written_yet() -> None:
    page = _page()
    page.announce(_announcement(1))
    offset = page_bytes(4) - RECORDS * 96 + 96 + 8 * 9  # record 1's step (its tenth word)
    page.memory[offset:offset + 8] = (8).to_bytes(8, "little")  # as if half-rewritten
    assert page.read(1) is None


def test_a_later_lap_of_the_ring_hides_the_earlier_record() -> None:
    page = _page()
    page.announce(_announcement(1))
    page.announce(_announcement(1 + RECORDS, step=9))
    assert page.read(1) is None
    assert page.read(1 + RECORDS) == _announcement(1 + RECORDS, step=9)


def test_cells_and_states_are_each_their_writers_own() -> None:
    page = _page()
    assert page.filed(2) == (0, 0) and page.peer_state(2) is PartnerState.RUNNING
    page.file(2, seq=5, epoch=3)
    page.set_peer_state(3, PartnerState.FAILED)
    assert page.filed(2) == (5, 3) and page.filed(3) == (0, 0) and page.filed(1) == (0, 0)
    assert page.peer_state(2) is PartnerState.RUNNING
    assert page.peer_state(3) is PartnerState.FAILED
    assert page.source_state() is PartnerState.RUNNING
    page.set_state(PartnerState.CLOSED)
    assert page.source_state() is PartnerState.CLOSED
    page.announce(_announcement(1))  # records do not overlap the cells
    assert page.filed(3) == (0, 0) and page.read(1) == _announcement(1)


def test_a_partner_that_died_is_seen_dead() -> None:
    partner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        liveness = Liveness(partner.pid)
        assert liveness.alive()
        os.kill(partner.pid, signal.SIGKILL)
        assert partner.wait(timeout=BOUNDED_S) == -signal.SIGKILL
        assert not liveness.alive()
        liveness.close()
        assert Liveness(partner.pid).alive() is False  # reaped: the pid names no process
        assert Liveness(os.getpid()).alive()
    finally:
        if partner.poll() is None:
            partner.kill()
            partner.wait(timeout=BOUNDED_S)


def test_a_slot_is_reused_only_once_the_slowest_peer_filed_two_windows_past_it() -> None:
    filed_epoch = [0]
    ring = SlotRing(lambda: filed_epoch[0])

    def sent(window_start: int) -> int:
        ring.advance(window_start)
        slot = ring.acquire(1000)
        ring.sent(slot)
        return slot.serial

    first = sent(0)  # epoch 1
    assert [sent(start) for start in (1, 2, 3, 4)] == [2, 3, 4, 5]  # four windows on
    filed_epoch[0] = 2  # the slowest peer filed into epoch 2: it holds epoch 1 still
    assert sent(5) == 6
    filed_epoch[0] = 3  # epoch 1's window dropped: its slot is free
    assert sent(6) == first
