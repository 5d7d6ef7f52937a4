"""Exposed communication, as shoal books it on real Gloo ranks: the time a rank's loop is
blocked on an exchange (launching it, waiting on its handle) is ``comm``; time it computes
while the exchange travels is not; with a barrier first (``--measure-wait``) a slower
peer's lead is ``wait``, not ``comm``. And every rank's numbers reach every rank
(``shoal.core.ops.values_by_rank``), which ``summary.json``'s ``*_by_rank`` fields are made of."""

from __future__ import annotations

import time

import pytest
import torch

import shoal
from shoal.core.ops import values_by_rank
from shoal.core.processes import spawn
from shoal.core.timeline import COMM, WAIT

pytestmark = pytest.mark.timeout(120)
LAG = 1.0  # seconds rank 1 arrives late, or rank 0 computes with an exchange in flight


def booked(comm, body) -> dict[str, float]:
    """The comm and wait seconds ``body()`` booked on ``comm``'s timeline."""
    before = dict(comm.timeline.totals)
    body()
    return {k: comm.timeline.totals.get(k, 0.0) - before.get(k, 0.0) for k in (COMM, WAIT)}


def cases_on_ranks() -> dict:
    comm = shoal.init(device="cpu")
    late = comm.rank == 1

    def peer_late() -> None:  # rank 0 launches at once and waits on the handle for rank 1
        if late:
            time.sleep(LAG)
        comm.all_reduce_async(torch.ones(1000), name="late").wait()

    def peer_late_measured() -> None:  # the same after a barrier, as --measure-wait does
        if late:
            time.sleep(LAG)
        comm.barrier()
        comm.all_reduce_async(torch.ones(1000), name="late").wait()

    def overlapped() -> None:  # rank 0 computes while its exchange travels, then waits
        handle = comm.all_reduce_async(torch.ones(1000), name="overlapped")
        if not late:
            time.sleep(LAG)
        handle.wait()

    found = {name: booked(comm, body) for name, body in
             [("peer_late", peer_late), ("peer_late_measured", peer_late_measured),
              ("overlapped", overlapped)]}
    found["by_rank"] = values_by_rank(comm, [float(comm.rank), 10.0 + comm.rank])
    shoal.shutdown()
    return found


@pytest.fixture(scope="module")
def found() -> list[dict]:
    return spawn(2, cases_on_ranks)  # each rank's return value, in rank order


def test_blocked_on_the_handle_is_comm(found):
    """Rank 0 waits on its exchange's handle while rank 1 arrives late: booked as comm."""
    assert found[0]["peer_late"][COMM] >= 0.9 * LAG, found[0]
    assert found[0]["peer_late"][WAIT] == 0.0


def test_a_barrier_first_books_a_late_peer_as_wait(found):
    got = found[0]["peer_late_measured"]
    assert got[WAIT] >= 0.9 * LAG and got[COMM] < got[WAIT], got


def test_compute_while_the_exchange_travels_is_not_comm(found):
    """Rank 0 spends LAG seconds computing between launch and wait: the exchange finished
    meanwhile, so what it books is the launch and a wait that returns at once."""
    assert found[0]["overlapped"][COMM] < 0.5 * LAG, found[0]


def test_every_rank_gets_every_ranks_values(found):
    for rank in range(2):
        assert found[rank]["by_rank"] == [[0.0, 10.0], [1.0, 11.0]]
