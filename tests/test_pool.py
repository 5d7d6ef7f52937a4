"""The worker pool (shoal/core/pool.py), with real processes: a command reaches every worker
and every answer comes back in rank order; a worker that dies or stays silent is named at
once, not at the end of a timeout; workers that something else started join over a socket
only with the session's secret, and every message on it is sealed: forged, replayed,
reflected or misrouted messages are refused."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import stat
import threading
import time
from pathlib import Path

import pytest

from shoal.core.pool import Listener, Pool, SealedLink, WorkerLost, join_pool
from shoal.core.processes import start_process, stop_processes
from shoal.core.trust import Seal
from shoal.errors import ShoalError

pytestmark = pytest.mark.timeout(90)


def echo(link, rank: int) -> None:
    """A worker: answer each command with itself and this rank, until its link closes.
    ``die R`` makes rank R exit without answering, ``sleep R`` makes it late (3 s), and a
    command it refuses is answered with the refusal's line."""
    while True:
        try:
            command = link.recv_bytes()
        except EOFError:
            return
        except ShoalError as exc:
            link.send_bytes(b"refused: " + str(exc).encode())
            return
        if command == b"die %d" % rank:
            os._exit(3)
        if command == b"sleep %d" % rank:
            time.sleep(3)
        link.send_bytes(command + b" from %d" % rank)


def joiner(address: str, rank: int, key: bytes) -> None:
    """A worker that its controller did not start: it joins over ``address``, then echoes."""
    echo(join_pool(address, rank, Seal(key), 30.0), rank)


@pytest.fixture
def local_pool():
    pool = Pool()
    try:
        pool.start(echo, range(1, 4), (), name="test-pool")
        yield pool
    finally:
        pool.stop(0.0)


def test_a_command_reaches_every_worker_and_every_answer_comes_back_in_rank_order(local_pool):
    for n in range(3):
        local_pool.send_all(b"call %d" % n)
        assert local_pool.recv_all(30.0) == [b"call %d from %d" % (n, r) for r in (1, 2, 3)]
    local_pool.close()  # a worker waiting for a command sees its end and leaves
    stop_processes(local_pool.procs, 30.0)
    assert [p.exitcode for p in local_pool.procs] == [0, 0, 0]


def test_a_worker_that_dies_is_named_at_once_and_a_silent_one_at_the_timeout(local_pool):
    local_pool.send_all(b"up")
    local_pool.recv_all(60.0)
    local_pool.send_all(b"sleep 1")
    got, lost = local_pool.gather(1.0)
    assert lost is not None and lost.timed_out and lost.rank == 1
    assert got == {2: b"sleep 1 from 2", 3: b"sleep 1 from 3"}
    local_pool.links[1].recv_bytes()  # its late answer: rank 1 is free again
    local_pool.send_all(b"die 2")
    with pytest.raises(WorkerLost) as lost:
        local_pool.recv_all(60.0)  # a worker's end, not this minute, ends the wait
    assert lost.value.rank == 2 and not lost.value.timed_out
    local_pool.procs[1].join(30.0)
    assert local_pool.procs[1].exitcode == 3


@pytest.fixture
def seal():
    return Seal()


@pytest.fixture
def listener(seal):
    listener = Listener(seal)
    yield listener
    listener.close()


@pytest.fixture
def procs():
    started: list = []
    yield started
    stop_processes(started, 0.0)


def test_workers_started_elsewhere_join_over_a_private_socket_and_talk_sealed(seal, listener, procs):
    folder = Path(listener.address).parent
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and listener.address.startswith("/")
    procs += [start_process(joiner, (listener.address, rank, bytes.fromhex(seal.key_hex)))
              for rank in (1, 0)]
    pool = listener.accept(range(2), 60.0)
    listener.close()
    assert not folder.exists()  # nothing listens once every worker is in
    assert list(pool.links) == [0, 1]
    pool.send_all(b"train")
    assert pool.recv_all(30.0) == [b"train from 0", b"train from 1"]
    pool.send_all(b"die 1")  # no process sentinel here: the link's end shows it
    with pytest.raises(WorkerLost) as lost:
        pool.recv_all(60.0)
    assert lost.value.rank == 1 and not lost.value.timed_out
    pool.close()
    stop_processes(procs, 30.0)
    assert [p.exitcode for p in procs] == [3, 0]


def test_a_stranger_without_the_secret_takes_no_rank(seal, listener, procs, caplog):
    """A connection that signs with another secret or claims a rank already taken is dropped
    (and said so), one that says nothing is dropped too; the real worker of that rank
    still joins."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.connect(listener.address)
        strangers: list = []  # as rank 0, with a secret of its own
        thread = threading.Thread(
            target=lambda: strangers.append(join_pool(listener.address, 0, Seal(), 30.0)))
        thread.start()
        procs.append(start_process(joiner, (listener.address, 0, bytes.fromhex(seal.key_hex))))
        pool = listener.accept(range(1), 60.0)
        thread.join(30.0)
    stranger, = strangers
    pool.send_all(b"hello")
    assert pool.recv_all(30.0) == [b"hello from 0"]
    assert stranger.poll(10)
    with pytest.raises(EOFError):
        stranger.recv_bytes()
    pool.close()
    # a warning: on stderr for a library user too (logging's last resort)
    assert any(r.levelno == logging.WARNING and "refused a connection" in r.getMessage()
               for r in caplog.records)


def _message(seal: Seal, nonce: bytes, controller: bool, number: int) -> bytes:
    """What a link of that side sends as its message ``number`` (``trial NUMBER``)."""
    ours, theirs = mp.Pipe()
    link = SealedLink(ours, seal, nonce, controller)
    for n in range(number + 1):
        link.send_bytes(b"trial %d" % n)
        wire = theirs.recv_bytes()
    return wire


def test_a_forged_replayed_reflected_or_misrouted_message_is_refused():
    """Each bad message differs from the good one in one thing only; the link takes the good
    one after refusing them all."""
    seal, nonce = Seal(), os.urandom(16)
    controller_end, worker_end = mp.Pipe()
    worker = SealedLink(worker_end, seal, nonce, controller=False)
    controller_end.send_bytes(_message(seal, nonce, True, 0))
    assert worker.recv_bytes() == b"trial 0"
    good = _message(seal, nonce, True, 1)
    bad = {"replayed": _message(seal, nonce, True, 0),
           "forged (another secret)": _message(Seal(), nonce, True, 1),
           "altered": good[:-1] + b"9",
           "from another link": _message(seal, os.urandom(16), True, 1),
           "reflected (the worker's own)": _message(seal, nonce, False, 1)}
    for what, message in bad.items():
        controller_end.send_bytes(message)
        with pytest.raises(ShoalError, match="not sent by this shoal session"):
            pytest.fail(f"a {what} message was taken: {worker.recv_bytes()!r}")
    controller_end.send_bytes(good)
    assert worker.recv_bytes() == b"trial 1"


def test_workers_on_other_machines_join_over_tcp(seal, procs):
    """``HOST:PORT``: the same handshake and seals over TCP (here on loopback, port 0)."""
    listener = Listener(seal, "127.0.0.1:0")
    try:
        host, port = listener.address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        procs.append(start_process(joiner, (listener.address, 0, bytes.fromhex(seal.key_hex))))
        pool = listener.accept(range(1), 60.0)
    finally:
        listener.close()
    pool.send_all(b"over tcp")
    assert pool.recv_all(30.0) == [b"over tcp from 0"]
    pool.close()


def test_accepting_ends_when_the_job_ends_or_the_timeout_passes(listener):
    with pytest.raises(WorkerLost, match="did not join within 0.2 s") as lost:
        listener.accept(range(2), 0.2)
    assert lost.value.rank == 0 and lost.value.timed_out
    ended, ends = mp.Pipe(duplex=False)
    ends.close()  # the job that was to start the workers is over
    with pytest.raises(WorkerLost, match="ended before it joined") as lost:
        listener.accept(range(2), 60.0, ended=[ended])
    assert not lost.value.timed_out
    for bad in ("nowhere", "host:port"):
        with pytest.raises(ShoalError, match="a socket's path or HOST:PORT"):
            Listener(Seal(), bad)
