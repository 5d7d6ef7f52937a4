"""When a parameter server applies an exchange (``shoal.ps.admission``): the policy built and
checked once, its decisions on a shard's ledger, the staleness over every shard; and
between real processes, no lost update under concurrent locked pushes, the staleness bound
and the round-robin order."""

from __future__ import annotations

import pytest
import torch

from shoal.core.ops import split_ranges
from shoal.errors import ShoalError
from shoal.ps import Admission, ShardServer, staleness_summary
from shoal.ps.admission import Ledger

from ps_doubles import Children, close_all, pushing_client, serve, served_store

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def store(monkeypatch):
    return served_store(monkeypatch)


@pytest.mark.parametrize("kwargs, expected", [
    ({"order": "fifo"}, "--order must be one of arrival, round-robin, got 'fifo'"),
    ({"max_staleness": -1}, "--max-staleness must be at least 0, got -1"),
    ({"max_staleness": 0, "unit": "group"},
     "--max-staleness 0 with 2 groups: a group waits for the 1 others to push, so the bound "
     "must be at least 1 (groups - 1)"),
])
def test_admission_is_checked_as_it_is_built(kwargs, expected):
    with pytest.raises(ShoalError) as err:
        Admission((3, 0), **kwargs)
    assert str(err.value) == expected
    assert Admission((3, 0, 3), max_staleness=1).pushers == (0, 3)


def test_a_server_takes_only_pushers_among_its_clients():
    with pytest.raises(ShoalError, match=r"server 0: pushers \[0, 3\] must be among the 3 clients"):
        ShardServer(None, 0, 3, None, torch.zeros(2), timeout=1.0, admission=Admission((0, 3)))


def test_bound_and_order_on_a_ledger():
    """Bound 1, two pushers: one that pushed may not push again before the other has
    pushed or pulled; round robin: pusher 1 waits for pusher 0's exchange of its round."""
    ledger, bound = Ledger(3), Admission((0, 1), max_staleness=1)
    assert bound.blockers(0, ledger, [0, 1]) == []
    ledger.book(0)
    assert bound.blockers(0, ledger, [0, 1]) == [1]  # 1 would be 2 versions behind
    assert bound.blockers(2, ledger, [0, 1]) == []  # not a pusher (the coordinator)
    assert bound.blockers(0, ledger, [0]) == []  # 1 was lost: nobody to wait for
    ledger.saw(1)
    assert bound.blockers(0, ledger, [0, 1]) == []
    robin = Admission((0, 1), order="round-robin")
    assert robin.blockers(1, Ledger(2), [0, 1]) == [0] and robin.blockers(0, Ledger(2), [0, 1]) == []
    assert not Admission((0, 1)).waits and robin.waits and bound.waits


def test_a_resting_pusher_holds_nobody_and_rejoins_the_round():
    """An elastic worker done with its schedule rests (--elastic): the staleness bound and
    the round robin stop waiting for it; back with a share dealt to it, it takes its turn
    from the others' round instead of owing them every round it missed."""
    server = ShardServer(None, 0, 3, None, torch.zeros(2), timeout=1.0,
                         admission=Admission((0, 1, 2), order="round-robin", max_staleness=2))
    for _ in range(3):  # 0 and 1 push three rounds while 2 rests
        server.rest(2, True)
        assert server.admission.blockers(0, server.ledger, server._active(0)) == []
        server.ledger.book(0)
        assert server.admission.blockers(1, server.ledger, server._active(1)) == []
        server.ledger.book(1)
    assert server.admission.blockers(0, server.ledger, [1, 2]) == [2]  # were 2 not resting
    server.rest(2, False)
    server.ledger.saw(2)  # back, it pulls the center first (AsyncStrategy.rejoin)
    assert server.ledger.counts[2] == 3  # its turn in round 3, after 0 and 1, not round 0
    assert server.admission.blockers(0, server.ledger, server._active(0)) == []
    assert server.admission.blockers(2, server.ledger, server._active(2)) == [0, 1]


def test_a_client_added_takes_its_turn_and_a_bound_that_cannot_take_it_refuses(store):
    """A worker that joins a running job (shoal join) is a new pusher: in a round robin it
    takes its turn from the others' round (not round 0, which would hold them back three
    rounds); a staleness bound too small for one more pusher refuses it, and the server's
    clients stay as they were."""
    bound = ShardServer(store, 0, 2, None, torch.zeros(2), timeout=1.0,
                        admission=Admission((0, 1), max_staleness=1))
    with pytest.raises(ShoalError, match="must be at least 2"):
        bound.add_client(2, 2.0)
    assert bound.ids == {0, 1} and bound.admission.pushers == (0, 1)
    robin = ShardServer(store, 1, 2, None, torch.zeros(2), timeout=1.0,
                        admission=Admission((0, 1), order="round-robin"))
    for _ in range(3):
        robin.ledger.book(0)
        robin.ledger.book(1)
    robin.add_client(2, 2.0)  # nobody connects: lost after 2 s, on its thread
    try:
        assert robin.ids == {0, 1, 2} and robin.admission.pushers == (0, 1, 2)
        assert robin.ledger.counts[2] == 3
        assert robin.admission.blockers(0, robin.ledger, [1, 2]) == []
        assert robin.admission.blockers(2, robin.ledger, [0, 1]) == [0, 1]
    finally:
        robin.close(timeout=5.0)


def test_staleness_is_summed_over_every_shard():
    one = staleness_summary([{0: 3, 2: 1}])
    assert one == {"histogram": {"0": 3, "2": 1}, "updates": 4, "max": 2, "mean": 0.5,
                   "shards": [{"histogram": {"0": 3, "2": 1}, "updates": 4, "max": 2, "mean": 0.5}]}
    two = staleness_summary([{0: 3, 2: 1}, {0: 2, 1: 2}])
    assert two["histogram"] == {"0": 5, "1": 2, "2": 1} and two["updates"] == 8
    assert two["max"] == 2 and two["mean"] == pytest.approx(4 / 8)
    assert [s["updates"] for s in two["shards"]] == [4, 4]


def test_locked_rule_loses_no_update(store):
    n, clients, pushes = 1000, 3, 60
    servers, _ = serve(store, clients, n, servers=2, timeout=20.0)
    try:
        with Children() as kids:
            for c in range(clients):
                kids.start(pushing_client, store.port, c, split_ranges(n, 2), pushes, 0.0, 20.0, 0,
                           "", "auto")
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
    with pytest.raises(ShoalError) as err:
        Admission((0, 1, 2), max_staleness=1)
    assert str(err.value) == ("--max-staleness 1 with 3 workers: a worker waits for the 2 others "
                              "to push, so the bound must be at least 2 (workers - 1)")
    n, k = 64, 2
    servers, _ = serve(store, 3, n, timeout=20.0, admission=Admission((0, 1, 2), max_staleness=k))
    try:
        with Children() as kids:
            for c, (pushes, pause) in enumerate([(40, 0.0), (15, 0.02), (6, 0.1)]):
                kids.start(pushing_client, store.port, c, split_ranges(n, 1), pushes, pause, 20.0,
                           0, "", "auto")
            assert all(kids.recv(c)[0] == "done" for c in range(3))
        assert servers[0].wait(10)
        staleness = servers[0].staleness
        assert sum(staleness.values()) == 61 and max(staleness) == k, staleness  # it bit
    finally:
        close_all(servers)


def test_round_robin_order(store):
    n, rounds = 32, 8
    servers, rules = serve(store, 3, n, timeout=20.0,
                           admission=Admission((0, 1, 2), order="round-robin"))
    try:
        with Children() as kids:
            for c, pause in enumerate([0.03, 0.0, 0.01]):
                kids.start(pushing_client, store.port, c, split_ranges(n, 1), rounds, pause, 20.0,
                           0, "", "auto")
            assert all(kids.recv(c)[0] == "done" for c in range(3))
        assert servers[0].wait(10)
        assert rules[0].clients == [0, 1, 2] * rounds
    finally:
        close_all(servers)


