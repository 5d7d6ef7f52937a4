"""A parameter server's pair through the host's shared memory (``shoal.core.mailbox``),
between real processes: every dtype shoal sends arrives bit for bit, messages larger than
the ring stream through it, each tag's messages keep their order while another tag's wait,
one that fits is read and answered where it lies (the ring's start after padding),
a peer killed or closed is seen within a second, a silent one at the deadline; a pair whose
ends are not on one host (or ``--intra-host gloo``, or no room in ``/dev/shm``) goes through
Gloo, and no segment is left in ``/dev/shm``. The same pairs under the server's rules:
test_ps_transport.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from shoal.core import linkoffer
from shoal.core.header import TAG_BYTES, TAG_DATA, TAG_HEAD
from shoal.core.mailbox import PeerGone, SharedLink, segment_bytes
from shoal.core.pairs import PairChannel
from shoal.core.segment import SHM_DIR, create_segment, open_segment, segment_name, unlink_segment

from ps_doubles import Children, send_to_parent, served_store, store_client

pytestmark = pytest.mark.timeout(60)

RING = 4096  # bytes each way: the messages below are larger, and stream through it
#: What the pairs carry: headers (float64), vectors (float32), pickled bytes (uint8); and
#: the dtypes a vector may have.
DTYPES = [torch.float64, torch.float32, torch.uint8, torch.int64, torch.bfloat16,
          torch.float16, torch.int32]


def messages() -> list[tuple[torch.Tensor, int]]:
    """Every dtype, odd sizes (larger than the ring too), on the three tags."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i, dtype in enumerate(DTYPES):
        n = [1, 7, 1001, 3 * RING + 5][i % 4]
        if dtype.is_floating_point:
            t = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
        else:
            t = torch.randint(0, 200, (n,), generator=g).to(dtype)
        out.append((t, (TAG_HEAD, TAG_DATA, TAG_BYTES)[i % 3]))
    return out


def echo(name: str, parent: int, how: str, conn) -> None:
    """The far end: map the segment, then receive every message of :func:`messages` (one
    tag after the other, the last sent first: the others' are kept aside meanwhile) and
    send each back; or (``how``) wait to be killed, or close its end."""
    link = SharedLink(open_segment(name, segment_bytes(RING)), False, parent, "server", RING)
    send_to_parent(conn, "mapped")
    if how == "echo":
        got = [torch.empty_like(t) for t, _ in messages()]
        tags = [tag for _, tag in messages()]
        for tag in (TAG_BYTES, TAG_DATA, TAG_HEAD):
            for i in [i for i in range(len(got)) if tags[i] == tag]:
                link.recv([got[i]], [tag], time.perf_counter() + 30, 30)
        link.send(got, tags, time.perf_counter() + 30, 30)
    elif how == "close":
        time.sleep(0.5)
        link.close()
    time.sleep(30)


def linked(kids: Children, how: str) -> SharedLink:
    name = segment_name("ps")
    segment = create_segment(name, segment_bytes(RING))
    try:
        kids.start(echo, name, os.getpid(), how)
        assert kids.recv(0) == "mapped"
    finally:
        unlink_segment(name)
    return SharedLink(segment, True, kids.procs[0].pid, "client 0", RING)


def test_every_message_arrives_whole_in_its_tags_order():
    with Children() as kids:
        link = linked(kids, "echo")
        sent = messages()
        link.send([t for t, _ in sent], [tag for _, tag in sent], time.perf_counter() + 30, 30)
        back = [torch.empty_like(t) for t, _ in sent]
        link.recv(back, [tag for _, tag in sent], time.perf_counter() + 30, 30)
    for (t, _), b in zip(sent, back, strict=True):
        assert t.dtype == b.dtype and torch.equal(t.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("how", ["kill", "close"])
def test_a_peer_killed_or_closed_is_seen_within_a_second(how):
    with Children() as kids:
        link = linked(kids, how)
        if how == "kill":
            killed = time.monotonic()
            os.kill(kids.procs[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(PeerGone, match="client 0 closed the connection"):
            link.recv([torch.empty(4)], [TAG_HEAD], time.perf_counter() + 20, 20)
        took = time.monotonic() - (killed if how == "kill" else start)
        assert took < (1.0 if how == "kill" else 1.5), took


def test_a_silent_peer_is_named_at_the_deadline():
    with Children() as kids:
        link = linked(kids, "silent")
        start = time.monotonic()
        with pytest.raises(PeerGone, match=r"client 0 sent nothing for 0.5 s \(hung"):
            link.recv([torch.empty(4)], [TAG_HEAD], time.perf_counter() + 0.5, 0.5)
        assert 0.5 <= time.monotonic() - start < 2.0


def pair_client(port: int, mode: str, elsewhere: bool, conn) -> None:
    """Client 0's end of a pair (on another host where ``elsewhere``): one round trip."""
    if elsewhere:  # as a process of another host would describe itself
        linkoffer.host_key = lambda: "another host"  # type: ignore[assignment]
    ch = PairChannel(store_client(port), 0, 0, 20.0, intra_host=mode)
    got = torch.empty(5)
    ch.recv([got], tags=[TAG_DATA])
    ch.send([got * 2], tags=[TAG_DATA])
    send_to_parent(conn, ch.shared)
    time.sleep(1)  # the server's receive before this end closes


def no_room(name: str, size: int) -> None:
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("mode, where, shared", [
    ("auto", "here", True), ("gloo", "here", False), ("auto", "elsewhere", False),
    ("auto", "full", False)])
def test_a_pair_shares_memory_only_on_one_host_unless_told_gloo(monkeypatch, mode, where,
                                                                shared):
    """Shared memory between two processes of this host; Gloo under ``--intra-host gloo``,
    between hosts, and where ``/dev/shm`` has no room for the segment."""
    store = served_store(monkeypatch)
    if where == "full":
        monkeypatch.setattr(linkoffer, "create_segment", no_room)
    elsewhere = where == "elsewhere"
    before = {n for n in os.listdir(SHM_DIR) if n.startswith("shoal-ps-")}
    with Children() as kids:
        kids.start(pair_client, store.port, mode, elsewhere)
        ch = PairChannel(store, 0, 0, 20.0, fields=(), intra_host=mode)
        ch.send([torch.arange(5.0)], tags=[TAG_DATA])
        back = torch.empty(5)
        ch.recv([back], tags=[TAG_DATA])
        assert kids.recv(0) is shared and ch.shared is shared
        ch.close()
    assert torch.equal(back, torch.arange(5.0) * 2)
    mine = {n for n in os.listdir(SHM_DIR) if n.startswith(f"shoal-ps-{os.getpid()}-")}
    assert not mine - before  # unlinked once both ends mapped it


def test_closing_this_end_ends_its_own_waits():
    """Another thread closes this end (a server shutting down) while one waits for the
    peer: the wait ends at once, not at its deadline."""
    with Children() as kids:
        link = linked(kids, "silent")
        closer = threading.Timer(0.3, link.close)
        closer.start()
        start = time.monotonic()
        with pytest.raises(PeerGone, match="closed"):
            link.recv([torch.empty(4)], [TAG_HEAD], time.perf_counter() + 20, 20)
        closer.join()
        assert time.monotonic() - start < 1.5


#: Sizes (float32 values) of the rounds below: odd, so positions move and messages meet the
#: ring's end; the last is larger than the ring and streams.
IN_PLACE = [1, 333, 17, 501, 250, 999, 3, 640, 128, 777] * 3 + [3 * RING // 4 + 5]


def echo_in_place(name: str, parent: int, conn) -> None:
    """The far end as a server answers an exchange: each vector taken where it lies, its
    answer (a header saying whether it was in place, and the vector doubled) written where
    the peer reads it; through copies where a message is larger than the ring."""
    link = SharedLink(open_segment(name, segment_bytes(RING)), False, parent, "server", RING)
    send_to_parent(conn, "mapped")
    for n in IN_PLACE:
        fallback = np.empty(4 * n, dtype=np.uint8)
        got = link.take(TAG_DATA, fallback, time.perf_counter() + 30, 30)
        head = np.array([got is not fallback], dtype=np.int64)
        room = link.reserve([TAG_HEAD, TAG_DATA], [8, 4 * n], time.perf_counter() + 30, 30)
        if room is None:
            link.send([torch.from_numpy(head), torch.from_numpy(got.view(np.float32) * 2)],
                      [TAG_HEAD, TAG_DATA], time.perf_counter() + 30, 30)
            continue
        room[0][:] = head.view(np.uint8)
        np.multiply(got.view(np.float32), 2, out=room[1].view(np.float32))
        link.release()
        link.commit()
    time.sleep(30)


def test_a_message_that_fits_is_read_and_answered_where_it_lies():
    """Every message that fits the ring reaches the far end whole and in place (aligned
    for its dtype), and its answer written in place reaches this end bit for bit; rounds
    of odd sizes meet the ring's end (a padding frame), and a message larger than the ring
    goes through copies."""
    name = segment_name("ps")
    segment = create_segment(name, segment_bytes(RING))
    g = torch.Generator().manual_seed(5)
    with Children() as kids:
        try:
            kids.start(echo_in_place, name, os.getpid())
            assert kids.recv(0) == "mapped"
        finally:
            unlink_segment(name)
        link = SharedLink(segment, True, kids.procs[0].pid, "client 0", RING)
        for n in IN_PLACE:
            sent = torch.randn(n, generator=g)
            link.send([sent], [TAG_DATA], time.perf_counter() + 30, 30)
            head, back = torch.empty(1, dtype=torch.int64), torch.empty(n)
            link.recv([head, back], [TAG_HEAD, TAG_DATA], time.perf_counter() + 30, 30)
            assert torch.equal(back, sent * 2), n
            assert bool(head.item()) is (4 * n + 16 <= RING), n


def test_a_malformed_frame_is_named_not_allocated():
    """A frame whose length no message can have (a peer's bug) fails the receive in one
    line, without allocating it."""
    name = segment_name("ps")
    segment = create_segment(name, segment_bytes(RING))
    unlink_segment(name)
    mine = SharedLink(segment, True, os.getpid(), "client 0", RING)
    theirs = SharedLink(segment, False, os.getpid(), "server", RING)
    theirs.send([torch.zeros(4)], [TAG_DATA], time.perf_counter() + 5, 5)
    frame = np.ndarray((2,), dtype=np.int64, buffer=segment,
                       offset=segment_bytes(RING) - RING)  # the client's ring, its first frame
    frame[1] = -(1 << 62)
    with pytest.raises(PeerGone, match=r"client 0 sent a malformed frame \(tag 1, "):
        mine.recv([torch.empty(4)], [TAG_DATA], time.perf_counter() + 5, 5)
