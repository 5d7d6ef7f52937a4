"""The parameter server's transport (``shoal.core.ps``) between real processes: round trips
over two shards, no lost update under concurrent locked pushes, the staleness bound, the
round-robin order, lost clients (kill -9, stopped) while the others finish, reports and
state, and a client whose server dies.

The servers run in the test process (their state is inspected directly), the clients in
fresh processes (``start_process``), except where the server must die: then the server is
the child. Every wait is bounded; every child is killed in ``finally``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shoal.core.ops import split_sizes
from shoal.core.processes import loopback_store, start_process
from shoal.core.ps import (
    ChannelError,
    Header,
    LoopbackClient,
    ServerClient,
    ShardServer,
)
from shoal.core.timeline import COMM, Timeline
from shoal.errors import ShoalError

pytestmark = pytest.mark.timeout(90)


class AddRule:
    """center += payload; reply = the new center. Read, yield, write: without the shard's
    lock, concurrent exchanges would lose updates."""

    def __init__(self, center: torch.Tensor, locked: bool = True, delay: float = 0.0,
                 sleep_on: int = 0) -> None:
        self.center, self.locked, self.delay, self.sleep_on = center, locked, delay, sleep_on
        self.applied = 0

    def apply(self, header: Header, payload: torch.Tensor, reply: torch.Tensor) -> None:
        self.applied += 1
        if self.sleep_on and self.applied == self.sleep_on:
            time.sleep(60)  # an exchange the client waits for while this server is killed
        value = self.center.clone()
        time.sleep(self.delay)
        self.center.copy_(value + payload)
        reply.copy_(self.center)

    def state_dict(self) -> dict:
        return {"applied": self.applied}

    def load_state_dict(self, state: dict) -> None:
        self.applied = state["applied"]


def ranges_of(n: int, servers: int) -> list[tuple[int, int]]:
    out, start = [], 0
    for size in split_sizes(n, servers):
        out.append((start, start + size))
        start += size
    return out


@pytest.fixture
def store(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # the pairs stay on loopback; children inherit
    return loopback_store(30.0)


def _connect(port: int, client: int, ranges, timeout: float, keepalive=None) -> ServerClient:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30))
    return ServerClient(store, client, ranges, timeout=timeout, keepalive=keepalive,
                        connect_timeout=30.0)


def _send(conn, obj: Any) -> None:
    """Tensors by value (the pipe's own pickler would share their memory with a process
    that may be gone when they are read)."""
    conn.send_bytes(pickle.dumps(obj))


# -- client processes ------------------------------------------------------------------------
def round_trip_client(port: int, ranges, conn) -> None:
    """pull, exchange ones, report, fetch state of server 1, leave; sends what it saw."""
    ps = _connect(port, 0, ranges, 20.0)
    n = ranges[-1][1]
    pulled = torch.zeros(n)
    ps.pull(pulled, Header(0, 0))
    after_pull = list(ps.versions)
    reply = torch.zeros(n)
    ps.exchange(torch.ones(n), reply, Header(0, 0, clock=1, step=7, samples=70, lr=0.5))
    after_exchange = list(ps.versions)
    ps.report({"epoch": 1, "loss": 0.25})
    state = ps.fetch_state(1)
    ps.close()
    _send(conn, (pulled, after_pull, reply, after_exchange, state))


def pushing_client(port: int, client: int, ranges, pushes: int, pause: float, timeout: float,
                   die_after: int, how: str, conn) -> None:
    """``pushes`` exchanges of small random integers, ``pause`` s apart; sends their sum.
    With ``die_after``: after that many, report the time and kill (or stop) itself."""
    ps = _connect(port, client, ranges, timeout)
    n = ranges[-1][1]
    g = torch.Generator().manual_seed(100 + client)
    total = torch.zeros(n)
    reply = torch.zeros(n)
    for i in range(pushes):
        payload = torch.randint(-3, 4, (n,), generator=g).float()
        ps.exchange(payload, reply, Header(0, 0, clock=i + 1, step=i + 1, samples=10 * (i + 1)))
        total += payload
        if die_after and i + 1 == die_after:
            _send(conn, ("dying", time.time()))
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        time.sleep(pause)
    ps.close()
    _send(conn, ("done", total))


def server_process(port: int, n: int, conn) -> None:
    """A server whose rule sleeps in its second exchange (the parent kills it then)."""
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30))
    center = torch.zeros(n)
    server = ShardServer(store, 0, 1, AddRule(center, sleep_on=2), center, timeout=20.0)
    server.start()
    _send(conn, "serving")
    server.wait(60)


# -- helpers ---------------------------------------------------------------------------------
class Children:
    """Child processes with a pipe each; all killed on exit."""

    def __init__(self) -> None:
        self.mp = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.pipes: list[Any] = []

    def start(self, target, *args) -> int:
        parent, child = self.mp.Pipe()
        self.procs.append(start_process(target, (*args, child)))
        self.pipes.append(parent)
        return len(self.procs) - 1

    def recv(self, i: int, timeout: float = 30.0) -> Any:
        if not self.pipes[i].poll(timeout):
            code = self.procs[i].exitcode
            raise AssertionError(f"child {i} sent nothing within {timeout} s (exit code {code})")
        return pickle.loads(self.pipes[i].recv_bytes())

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.exitcode is None and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.join(10)


def serve(store, clients: int, n: int, servers: int = 1, **kw) -> tuple[list[ShardServer], list]:
    shards = [torch.zeros(size) for size in split_sizes(n, servers)]
    rules = [AddRule(c) for c in shards]
    out = [ShardServer(store, s, clients, rules[s], shards[s], **kw) for s in range(servers)]
    for server in out:
        server.start()
    return out, rules


def close_all(servers: list[ShardServer]) -> None:
    for server in servers:
        server.close(timeout=2.0)


# -- tests -----------------------------------------------------------------------------------
def test_round_trip_over_two_shards(store):
    n = 11
    reports: list = []
    shards = [torch.arange(size, dtype=torch.float32) + 100 * s
              for s, size in enumerate(split_sizes(n, 2))]
    initial = torch.cat(shards)
    servers = [ShardServer(store, s, 1, AddRule(shards[s]), shards[s], timeout=20.0,
                           on_report=lambda c, obj: reports.append((c, obj)),
                           extra_state=lambda s=s: {"server": s})
               for s in range(2)]
    try:
        for server in servers:
            server.start()
        with Children() as kids:
            kids.start(round_trip_client, store.port, ranges_of(n, 2))
            pulled, after_pull, reply, after_exchange, state = kids.recv(0)
        assert torch.equal(pulled, initial)  # each server's own slice, in place
        assert after_pull == [0, 0]
        assert torch.equal(reply, initial + 1) and after_exchange == [1, 1]
        assert all(server.wait(10) for server in servers)
        assert [s.version for s in servers] == [1, 1] and servers[0].left == {0}
        assert servers[1].clocks[0] == 1 and servers[1].steps[0] == 7
        assert reports == [(0, {"epoch": 1, "loss": 0.25})]
        assert torch.equal(state["center"], shards[1]) and state["version"] == 1
        assert state["rule"] == {"applied": 1} and state["extra"] == {"server": 1}
        assert not servers[0].lost and not servers[1].lost
    finally:
        close_all(servers)


def test_locked_rule_loses_no_update(store):
    n, clients, pushes = 1000, 3, 60
    servers, _ = serve(store, clients, n, servers=2, timeout=20.0)
    try:
        with Children() as kids:
            for c in range(clients):
                kids.start(pushing_client, store.port, c, ranges_of(n, 2), pushes, 0.0, 20.0, 0, "")
            totals = [kids.recv(c) for c in range(clients)]
        assert all(kind == "done" for kind, _ in totals)
        expected = sum(total for _, total in totals)
        assert all(server.wait(10) for server in servers)
        assert torch.equal(torch.cat([s.snapshot() for s in servers]), expected)
        assert [s.version for s in servers] == [clients * pushes] * 2
        assert sum(servers[0].staleness.values()) == clients * pushes
        assert max(servers[0].staleness) > 0  # the pushes did overlap
    finally:
        close_all(servers)


def test_staleness_bound(store):
    with pytest.raises(ShoalError, match="max staleness 1 is below pushers - 1 = 2: with 3 workers pushing"):
        ShardServer(store, 0, 3, None, torch.zeros(4), timeout=5.0, max_staleness=1)
    n, k = 64, 2
    servers, _ = serve(store, 3, n, timeout=20.0, max_staleness=k)
    try:
        with Children() as kids:
            for c, (pushes, pause) in enumerate([(40, 0.0), (15, 0.02), (6, 0.1)]):
                kids.start(pushing_client, store.port, c, ranges_of(n, 1), pushes, pause, 20.0, 0, "")
            assert all(kids.recv(c)[0] == "done" for c in range(3))
        assert servers[0].wait(10)
        staleness = servers[0].staleness
        assert sum(staleness.values()) == 61 and max(staleness) == k, staleness  # it bit
    finally:
        close_all(servers)


def test_round_robin_order(store):
    n, rounds = 32, 8
    servers, _ = serve(store, 3, n, timeout=20.0, order="round-robin")
    try:
        with Children() as kids:
            for c, pause in enumerate([0.03, 0.0, 0.01]):
                kids.start(pushing_client, store.port, c, ranges_of(n, 1), rounds, pause, 20.0, 0, "")
            assert all(kids.recv(c)[0] == "done" for c in range(3))
        assert servers[0].wait(10)
        assert list(servers[0].applied) == [0, 1, 2] * rounds
    finally:
        close_all(servers)


def idle_client(store, ranges, timeout: float, out: list) -> None:
    """The coordinator's pattern: pull, stay silent for longer than the servers' timeout
    (kept alive by pings), pull again."""
    ps = ServerClient(store, 3, ranges, timeout=timeout, keepalive=timeout / 4,
                      connect_timeout=30.0)
    n = ranges[-1][1]
    ps.pull(torch.zeros(n), Header(0, 0))
    time.sleep(1.5 * timeout)
    ps.pull(torch.zeros(n), Header(0, 0))
    ps.close()
    out.append("done")


def test_lost_clients_do_not_stop_the_others(store):
    """Client 1 is killed (kill -9) and client 2 stopped (hung) after 5 exchanges; client 0
    goes on under a staleness bound that the two held up until they were lost; client 3
    (not a worker, as the coordinator; a thread here) stays silent longer than the timeout,
    kept alive by pings."""
    n, timeout = 16, 3.0
    servers, _ = serve(store, 4, n, workers=3, timeout=timeout, max_staleness=2,
                       connect_timeout=30.0)
    server = servers[0]
    idled: list[str] = []
    try:
        with Children() as kids:
            ranges = ranges_of(n, 1)
            kids.start(pushing_client, store.port, 0, ranges, 25, 0.05, timeout, 0, "")
            kids.start(pushing_client, store.port, 1, ranges, 40, 0.05, timeout, 5, "kill")
            kids.start(pushing_client, store.port, 2, ranges, 40, 0.05, timeout, 5, "stop")
            idle = threading.Thread(target=idle_client, args=(store, ranges, timeout, idled),
                                    daemon=True)
            idle.start()
            _, killed_at = kids.recv(1)
            _, stopped_at = kids.recv(2)
            assert kids.recv(0, 40)[0] == "done"
            idle.join(40)
            assert idled == ["done"]
            assert server.wait(10)
        assert sorted(server.lost) == [1, 2] and server.left == {0, 3}
        killed, stopped = server.lost[1], server.lost[2]
        assert killed["time"] - killed_at < 3.0, killed  # connection reset: at once
        assert "closed the connection" in killed["error"]
        assert killed["step"] == 5 and killed["samples"] == 50 and killed["clock"] == 5
        assert timeout - 0.5 < stopped["time"] - stopped_at < timeout + 3.0, stopped
        assert f"sent nothing for {timeout:g} s" in stopped["error"] and stopped["step"] == 5
        assert max(server.staleness) <= 2 and server.staleness.total() == 35
        assert "\n" not in killed["error"] + stopped["error"]
    finally:
        close_all(servers)


def test_client_of_a_dead_server_fails_in_one_line(store):
    n = 8
    with Children() as kids:
        kids.start(server_process, store.port, n)
        assert kids.recv(0) == "serving"
        client = ServerClient(store, 0, ranges_of(n, 1), timeout=20.0)
        reply = torch.zeros(n)
        client.exchange(torch.ones(n), reply, Header(0, 0))
        assert torch.equal(reply, torch.ones(n))

        def kill_soon() -> None:
            time.sleep(1.0)
            os.kill(kids.procs[0].pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_soon)
        killer.start()
        start = time.monotonic()
        with pytest.raises(ChannelError) as err:  # the rule holds this exchange: in flight
            client.exchange(torch.ones(n), reply, Header(0, 0))
        killer.join()
        assert time.monotonic() - start < 5.0
        message = str(err.value)
        assert "\n" not in message and "server 0 closed the connection" in message
        with pytest.raises(ChannelError, match="server 0 closed the connection"):
            client.pull(reply, Header(0, 0))  # the pair stays broken
        client.close()  # never raises


def test_client_without_server_times_out(store):
    start = time.monotonic()
    with pytest.raises(ChannelError, match="server 0 did not connect within 1 s"):
        ServerClient(store, 5, [(0, 4)], timeout=1.0)
    assert time.monotonic() - start < 4.0


def test_loopback_client_applies_rules_in_process():
    shards = [torch.zeros(3), torch.zeros(2)]
    rules = [AddRule(c) for c in shards]
    client = LoopbackClient(rules, shards)
    reply = torch.zeros(5)
    client.exchange(torch.arange(5.0), reply, Header(0, 0))
    assert torch.equal(reply, torch.arange(5.0)) and client.versions == [1, 1]
    pulled = torch.zeros(5)
    client.pull(pulled, Header(0, 0))
    assert torch.equal(pulled, torch.arange(5.0))
    assert client.fetch_state(1)["rule"] == {"applied": 1}
    client.report({"x": 1})
    assert client.reports == [{"x": 1}]


class FailingRule(AddRule):
    def apply(self, header: Header, payload: torch.Tensor, reply: torch.Tensor) -> None:
        if header.step == 2:
            raise ValueError("diverged\nsecond line")
        super().apply(header, payload, reply)


def test_server_side_failures_reach_the_client_in_one_line(store):
    """A rule that raises, a server without a rule, a report nobody takes: the client gets
    one line, the pair goes on; the rule's failure is the server's too (wait raises)."""
    n = 6
    center = torch.zeros(n)
    failing = ShardServer(store, 0, 1, FailingRule(center), center, timeout=10.0)
    ruleless = ShardServer(store, 1, 1, None, torch.zeros(n), timeout=10.0)
    failing.start()
    ruleless.start()
    client = ServerClient(store, 0, [(0, n), (n, 2 * n)], servers=[0, 1], timeout=10.0)
    try:
        reply = torch.zeros(2 * n)
        with pytest.raises(ShoalError) as err:
            client.exchange(torch.ones(2 * n), reply, Header(0, 0, step=2))
        assert str(err.value) == "server 0: ValueError: diverged"
        with pytest.raises(ShoalError, match="server 0 takes no reports"):
            client.report({"x": 1})
        pulled = torch.zeros(2 * n)
        client.pull(pulled, Header(0, 0))  # both pairs still work
        assert torch.equal(pulled, torch.zeros(2 * n))
        client.close()
        with pytest.raises(ShoalError, match="update rule failed on client 0's exchange"):
            failing.wait(10)
        assert ruleless.wait(10) and ruleless.left == {0}
    finally:
        client.close()
        close_all([failing, ruleless])


def test_client_books_comm_time_and_counts_payload_bytes(store):
    n = 10
    center = torch.zeros(n)
    reports = []
    server = ShardServer(store, 0, 1, AddRule(center), center, timeout=10.0,
                         on_report=lambda c, obj: reports.append(obj))
    server.start()
    timeline, sent = Timeline(keep_events=True), []
    client = ServerClient(store, 0, [(0, n)], timeout=10.0, timeline=timeline, count=sent.append)
    try:
        reply = torch.zeros(n)
        client.exchange(torch.ones(n), reply, Header(0, 0))
        client.pull(reply, Header(0, 0))
        client.report({"epoch": 1})  # bookkeeping, as a synchronous run's metric reductions
        assert reports == [{"epoch": 1}]
        assert sent == [4 * n]  # the exchange's payload; a pull sends none
        assert timeline.totals[COMM] > 0
        assert [e.name for e in timeline.events] == ["push+pull", "pull"]
    finally:
        client.close()
        close_all([server])
