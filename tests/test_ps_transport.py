"""The parameter server (``shoal.ps`` on ``shoal.core.pairs``) between real processes: round
trips over two shards with the rule's own header fields, lost clients (kill -9, stopped)
while the others finish, reports and state, failures on the server, a client whose server
dies, and what a client books on its Comm. The order and the staleness bound:
test_ps_admission.py.

The servers run in the test process (their state is inspected directly), the clients in
fresh processes (``start_process``), except where the server must die: then the server is
the child. Every wait is bounded; every child is killed in ``finally``.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from shoal.core.comm import Comm
from shoal.core.env import Environment
from shoal.core.header import Header
from shoal.core.ops import split_ranges, split_sizes
from shoal.core.pairs import ChannelError
from shoal.core.timeline import COMM, Timeline
from shoal.errors import ShoalError
from shoal.ps import Admission, ServerClient, ShardServer

from ps_doubles import (
    AddRule,
    Children,
    LoopbackClient,
    close_all,
    connect,
    pushing_client,
    send_to_parent,
    serve,
    served_store,
    store_client,
)

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def store(monkeypatch):
    return served_store(monkeypatch)


# -- client processes ------------------------------------------------------------------------
def round_trip_client(port: int, ranges, conn) -> None:
    """pull, exchange ones, report, fetch state of server 1, leave; sends what it saw."""
    ps = connect(port, 0, ranges, 20.0)
    n = ranges[-1][1]
    pulled = torch.zeros(n)
    ps.pull(pulled, Header(0, 0))
    after_pull = list(ps.versions)
    reply = torch.zeros(n)
    ps.exchange(torch.ones(n), reply, Header(0, 0, clock=1, step=7, samples=70,
                                             fields={"lr": 0.5, "alpha": 0.25}))
    after_exchange = list(ps.versions)
    ps.report({"epoch": 1, "loss": 0.25})
    state = ps.fetch_state(1)
    ps.close()
    send_to_parent(conn, (pulled, after_pull, reply, after_exchange, state))


def server_process(port: int, n: int, conn) -> None:
    """A server whose rule sleeps in its second exchange (the parent kills it then)."""
    store = store_client(port)
    center = torch.zeros(n)
    server = ShardServer(store, 0, 1, AddRule(center, sleep_on=2), center, timeout=20.0)
    server.start()
    send_to_parent(conn, "serving")
    server.wait(60)


# -- tests -----------------------------------------------------------------------------------
def test_round_trip_over_two_shards(store):
    n = 11
    reports: list = []
    shards = [torch.arange(size, dtype=torch.float32) + 100 * s
              for s, size in enumerate(split_sizes(n, 2))]
    initial = torch.cat(shards)
    rules = [AddRule(shard) for shard in shards]
    servers = [ShardServer(store, s, 1, rules[s], shards[s], timeout=20.0,
                           on_report=lambda c, obj: reports.append((c, obj)))
               for s in range(2)]
    try:
        for server in servers:
            server.start()
        with Children() as kids:
            kids.start(round_trip_client, store.port, split_ranges(n, 2))
            pulled, after_pull, reply, after_exchange, state = kids.recv(0)
        assert torch.equal(pulled, initial)  # each server's own slice, in place
        assert after_pull == [0, 0]
        assert torch.equal(reply, initial + 1) and after_exchange == [1, 1]
        assert all(server.wait(10) for server in servers)
        assert [s.version for s in servers] == [1, 1] and servers[0].left == {0}
        assert servers[1].clocks[0] == 1 and servers[1].steps[0] == 7
        assert reports == [(0, {"epoch": 1, "loss": 0.25})]
        assert torch.equal(state["center"], shards[1]) and state["version"] == 1
        assert state["rule"] == {"applied": 1}
        assert not servers[0].lost and not servers[1].lost
        # The rule's own fields reach it, and only those: the transport names none of them.
        assert [rule.seen for rule in rules] == [[{"lr": 0.5}], [{"lr": 0.5}]]
        # A rule that keeps something per client (DC-ASGD's w_bak) hears of each pull and
        # of each client gone.
        assert [rule.told for rule in rules] == [[("sent", 0), ("forget", 0)]] * 2
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


@pytest.mark.parametrize("path", ["auto", "gloo"])
def test_lost_clients_do_not_stop_the_others(store, path):
    """Client 1 is killed (kill -9) and client 2 stopped (hung) after 5 exchanges; client 0
    goes on under a staleness bound that the two held up until they were lost; client 3
    (not a worker, as the coordinator; a thread here) stays silent longer than the timeout,
    kept alive by pings. Over this host's shared memory (``auto``) and over Gloo."""
    n, timeout = 16, 3.0
    servers, rules = serve(store, 4, n, timeout=timeout, connect_timeout=30.0,
                           admission=Admission((0, 1, 2), max_staleness=2), intra_host=path)
    server = servers[0]
    idled: list[str] = []
    try:
        with Children() as kids:
            ranges = split_ranges(n, 1)
            for c, (pushes, dies, how) in enumerate([(25, 0, ""), (40, 5, "kill"),
                                                     (40, 5, "stop")]):
                kids.start(pushing_client, store.port, c, ranges, pushes, 0.05, timeout, dies,
                           how, path)
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
        gone = sorted(c for hook, c in rules[0].told if hook == "forget")
        assert gone == [0, 1, 2, 3]  # the rule frees what it kept for each, lost or left
        assert ("sent", 3) not in rules[0].told  # a reader's pulls are no gradient's point
    finally:
        close_all(servers)


def test_client_of_a_dead_server_fails_in_one_line(store):
    n = 8
    with Children() as kids:
        kids.start(server_process, store.port, n)
        assert kids.recv(0) == "serving"
        client = ServerClient(store, 0, split_ranges(n, 1), timeout=20.0)
        reply = torch.zeros(n)
        client.exchange(torch.ones(n), reply, Header(0, 0, fields={"lr": 1.0}))
        assert torch.equal(reply, torch.ones(n))

        def kill_soon() -> None:
            time.sleep(1.0)
            os.kill(kids.procs[0].pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_soon)
        killer.start()
        start = time.monotonic()
        with pytest.raises(ChannelError) as err:  # the rule holds this exchange: in flight
            client.exchange(torch.ones(n), reply, Header(0, 0, fields={"lr": 1.0}))
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


def test_a_connect_ended_by_sigterm_says_so_not_that_the_server_was_late(store):
    """SIGTERM while a worker waits for its pair (the job stopping around it) is named as
    such; before, it read as a server that did not connect within the timeout."""
    from shoal.core.stop import STOP, request_stop

    request_stop()
    try:
        with pytest.raises(ChannelError, match="stopped by SIGTERM while connecting to server 0"):
            ServerClient(store, 6, [(0, 4)], timeout=1.0)
    finally:
        STOP.clear()


def test_loopback_client_applies_rules_in_process():
    shards = [torch.zeros(3), torch.zeros(2)]
    rules = [AddRule(c) for c in shards]
    client = LoopbackClient(rules, shards)
    reply = torch.zeros(5)
    client.exchange(torch.arange(5.0), reply, Header(0, 0, fields={"lr": 1.0, "other": 2.0}))
    assert rules[0].seen == [{"lr": 1.0}]  # what a server would unpack
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
    """A rule that raises, a server without a rule, a report nobody takes, an exchange
    without a field the rule reads: the client gets one line, the pair goes on; the rule's
    failure is the server's too (wait raises)."""
    n = 6
    center = torch.zeros(n)
    failing = ShardServer(store, 0, 1, FailingRule(center), center, timeout=10.0)
    ruleless = ShardServer(store, 1, 1, None, torch.zeros(n), timeout=10.0)
    failing.start()
    ruleless.start()
    client = ServerClient(store, 0, [(0, n), (n, 2 * n)], servers=[0, 1], timeout=10.0)
    try:
        reply = torch.zeros(2 * n)
        with pytest.raises(ShoalError) as err:  # refused before anything is sent
            client.exchange(torch.ones(2 * n), reply, Header(0, 0, step=2))
        assert str(err.value) == "server 0's rule reads lr, which this exchange's header does " \
                                 "not carry"
        with pytest.raises(ShoalError) as err:
            client.exchange(torch.ones(2 * n), reply, Header(0, 0, step=2, fields={"lr": 1.0}))
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


def test_client_books_comm_time_and_payload_bytes_on_the_comm(store):
    n = 10
    center = torch.zeros(n)
    reports = []
    server = ShardServer(store, 0, 1, AddRule(center), center, timeout=10.0,
                         on_report=lambda c, obj: reports.append(obj))
    server.start()
    comm = Comm(Environment(), torch.device("cpu"), Timeline(keep_events=True), peers=False)
    client = ServerClient(store, 0, [(0, n)], timeout=10.0, comm=comm)
    try:
        reply = torch.zeros(n)
        client.exchange(torch.ones(n), reply, Header(0, 0, fields={"lr": 1.0}))
        client.pull(reply, Header(0, 0))
        client.report({"epoch": 1})  # bookkeeping, as a synchronous run's metric reductions
        assert reports == [{"epoch": 1}]
        assert comm.bytes_sent == 4 * n  # the exchange's payload; a pull sends none
        assert comm.timeline.totals[COMM] > 0
        assert [e.name for e in comm.timeline.events] == ["push+pull", "pull"]
    finally:
        client.close()
        close_all([server])


def test_a_client_that_abandons_is_seen_gone_at_once(store):
    """A worker that failed (and reported it) leaves its pairs without a word while its
    process goes on (a trial inside a job): the server's thread waiting for its next request
    sees the connection close at once, not at the timeout nor when the process ends (where
    a thread still waiting in Gloo ends the process in std::terminate)."""
    n, timeout = 8, 20.0
    center = torch.zeros(n)
    server = ShardServer(store, 0, 1, AddRule(center), center, timeout=timeout)
    server.start()
    client = ServerClient(store, 0, [(0, n)], timeout=timeout)
    try:
        client.pull(torch.zeros(n), Header(0, 0))
        began = time.monotonic()
        client.abandon()
        assert server.wait(10), "the server still waits for the abandoned client"
        assert time.monotonic() - began < 5.0
        assert list(server.lost) == [0] and "closed the connection" in server.lost[0]["error"]
        assert all(not t.is_alive() for t in server._threads)
    finally:
        client.close()  # after abandon: nothing more to do
        close_all([server])
