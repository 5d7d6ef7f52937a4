"""A parameter server's pair through the host's shared memory (``shoal.core.mailbox``),
between real processes: every dtype shoal sends arrives bit for bit, messages larger than
the ring stream through it, each tag's messages keep their order while another tag's wait,
a peer killed or closed is seen within a second, a silent one at the deadline; a pair whose
ends are not on one host (or ``--intra-host gloo``, or no room in ``/dev/shm``) goes through
Gloo, and no segment is left in ``/dev/shm``. The same pairs under the server's rules:
test_ps_transport.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from shoal.core import mailbox
from shoal.core.mailbox import PeerGone, SharedLink, segment_bytes
from shoal.core.pairs import TAG_BYTES, TAG_DATA, TAG_HEAD, PairChannel
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
        mailbox.host_key = lambda: "another host"  # type: ignore[assignment]
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
        monkeypatch.setattr(mailbox, "create_segment", no_room)
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
