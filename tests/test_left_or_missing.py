"""A rank that leaves the job while the others still need it, or never comes to a collective,
is named within seconds (or at the timeout, with lines meanwhile); a rank that merely finishes
earlier is normal. Real processes, Gloo on CPU; nothing is left running."""

from __future__ import annotations

import sys
import threading
import time
import uuid

import pytest

import shoal

from conftest import one_error_line, run, shoal_env

pytestmark = pytest.mark.timeout(120)

LEAVES = """\
import os, sys, time
import torch, shoal

comm = shoal.init(timeout=60)
if comm.rank == 1:
    {leave}
t = torch.ones(2)
comm.all_reduce(t)  # rank 1 never comes: only its leaving can end this before the timeout
print("rank", comm.rank, "sum", t[0].item(), flush=True)
"""


def shoal_run(tmp_path, program: str, workers: int = 2, timeout: float = 60):
    """``shoal run --workers N`` of ``program`` in a new session (killed after ``timeout``),
    and the seconds it took."""
    (tmp_path / "job.py").write_text(program)
    start = time.monotonic()
    res = run([sys.executable, "-m", "shoal", "run", "--workers", str(workers), "job.py"],
              env=shoal_env(uuid.uuid4().hex), cwd=tmp_path, timeout=timeout)
    assert res.stray == [], "processes outlived the job"
    return res, time.monotonic() - start


@pytest.mark.parametrize("leave, how", [
    ("sys.exit(0)", "exited with status 0"),
    ("os._exit(0)", "exited with status 0"),
    ("shoal.shutdown(); sys.exit(0)", "called shoal.shutdown()"),
])
def test_a_rank_that_leaves_while_another_waits_for_it_is_named(tmp_path, leave, how):
    """Rank 1 ends cleanly right after joining while rank 0 all-reduces: the job fails within
    seconds (the timeout is 60 s) and says that rank 1 left, not that rank 0 lost a peer."""
    res, elapsed = shoal_run(tmp_path, LEAVES.format(leave=leave))
    assert res.returncode == 1, res.stderr
    line = one_error_line(res.stderr)
    assert line.startswith(f"shoal: error: rank 1: {how} while the others were still running"), line
    assert elapsed < 30, f"the job took {elapsed:.0f} s to end"


FINISHES_FIRST = """\
import os, sys, time
import torch, shoal

comm = shoal.init(timeout=60)
t = torch.ones(2)
comm.all_reduce(t)
leave = {LEAVES}.get(comm.rank)
# Each line in one write (a pipe keeps a short write whole; print's pieces, unbuffered
# where PYTHONUNBUFFERED is set, would mix with the other ranks').
if leave is not None:
    os.write(1, f"rank {{comm.rank}} ends by {{leave}}\\n".encode())
    exec(leave)  # its script ends here
else:
    time.sleep(3)  # rank 0 goes on working alone, with no collective left to do
    os.write(1, f"rank {{comm.rank}} sum {{t[0].item()}}\\n".encode())
"""
#: How ranks 1, 2 and 3 of one job finish while rank 0 goes on alone.
FINISHES = ["pass", "sys.exit(0)", "os._exit(0)"]


@pytest.fixture(scope="class")
def finished(tmp_path_factory):
    """One job of four ranks: ranks 1-3 each finish earlier in one of the ways, rank 0 goes
    on alone."""
    leaves = dict(enumerate(FINISHES, 1))
    return shoal_run(tmp_path_factory.mktemp("finishes"),
                     FINISHES_FIRST.format(LEAVES=repr(leaves)), workers=1 + len(leaves))[0]


class TestARankThatFinishesEarlier:
    """Ranks that finish earlier than the others, in every way (one job shows them all),
    are normal: nothing of it is a failure."""

    @pytest.mark.parametrize("leave", FINISHES)
    def test_a_rank_that_finishes_earlier_is_normal(self, finished, leave):
        res = finished
        assert f"rank {FINISHES.index(leave) + 1} ends by {leave}\n" in res.stdout, res.stdout
        assert res.returncode == 0, res.stderr
        assert "rank 0 sum 4.0" in res.stdout, res.stdout
        assert "shoal" not in res.stderr, res.stderr  # nothing to report


def leaves_early(leave: bool) -> str:
    comm = shoal.init(timeout=60)
    ones = __import__("torch").ones(1)
    comm.all_reduce(ones)
    if comm.rank == 1 and leave:
        return "early"
    time.sleep(2)
    if comm.rank == 0:
        comm.all_reduce(ones)  # a second collective rank 1 never joins
    return "late"


def test_launch_names_a_rank_that_returned_while_needed():
    start = time.monotonic()
    with pytest.raises(shoal.WorkerError) as info:
        shoal.launch(leaves_early, True, workers=2)
    assert str(info.value) == "rank 1: returned while the others were still running"
    assert time.monotonic() - start < 30


def test_a_departure_counts_only_for_the_comm_it_left():
    """A process may leave the job and join it again (``shoal.shutdown()``, ``shoal.init()``):
    that it left its first Comm before any collective must not make a wait in its second
    one look like its leaving. (The store is real; joining twice is not done here, as torch's
    own rendezvous on a reused store is racy.)"""
    import torch.distributed as dist

    from shoal.core.processes import loopback_store
    from shoal.core.waits import CollectiveLog, Keys, Waits, say_left

    served = loopback_store(timeout=10)  # held: torch drops a Python store only C++ holds
    store = dist.PrefixStore("shoal/0", served)
    say_left(store, Keys(0), 1, 2, "returned", 0)  # rank 1 left its first Comm at once
    log = CollectiveLog()
    log.start("all_reduce")  # rank 0's first collective in the second Comm, not finished
    time.sleep(1.2)  # a wait is looked into after a second

    def call(fn, *args):
        return fn(*args)

    assert Waits(0, 2, log, Keys(1), 60.0).look(store, call) is None
    assert Waits(0, 2, log, Keys(0), 60.0).look(store, call) == (
        1, "returned while the others were still running")


SLEEPS = """\
import time
import torch, shoal

comm = shoal.init(timeout=8, heartbeat_timeout=2)
first = comm.all_reduce_async(torch.ones(2), name="first")  # waited for only at the end
if comm.rank == 1:
    time.sleep(1000)  # alive (its watchdog beats) but never comes
comm.all_reduce(torch.ones(2))
first.wait()
"""


def test_a_rank_that_never_comes_is_named_meanwhile_and_at_the_timeout(tmp_path):
    """Rank 1 sleeps instead of joining the second all-reduce: rank 0 says whom it waits for
    (from a quarter of the timeout on, at growing intervals), and at the timeout the job ends
    naming rank 1. What rank 0 waits in is the second all-reduce, not the first one, which
    is done but not waited for yet."""
    res, elapsed = shoal_run(tmp_path, SLEEPS)
    assert res.returncode == 1, res.stderr
    waits = [ln for ln in res.stderr.splitlines() if "has waited" in ln]
    assert waits and waits[0].startswith(
        "shoal: rank 0 has waited 2 s in all_reduce #2 for rank 1 (last seen in collective #1"
    ), res.stderr
    assert len(waits) == 2 and "has waited 4 s" in waits[1], res.stderr  # at 2 s and 4 s
    line = one_error_line(res.stderr)
    assert line.startswith("shoal: error: rank 1: never joined all_reduce #2: rank 0 waited "), line
    assert "the timeout is 8 s" in line, line
    assert elapsed < 40, f"the job took {elapsed:.0f} s to end"


def test_a_training_rank_that_never_comes_is_named(tmp_path):
    """The same for `shoal train`: rank 1 sleeps in its forward pass (step 3), rank 0 waits in
    the gradients' all-reduce."""
    res = run([sys.executable, "-m", "shoal", "train", "--model",
               "tests.fixtures_models:sleeps_on_rank1", "--dataset", "digits", "--workers", "2",
               "--epochs", "1", "--timeout", "8", "--heartbeat-timeout", "2", "--progress",
               "none", "--out", str(tmp_path)], env=shoal_env(uuid.uuid4().hex), timeout=90)
    assert res.stray == []
    assert res.returncode == 1, res.stderr
    assert "shoal: rank 0 has waited 2 s in all_reduce (gradients) #" in res.stderr, res.stderr
    line = one_error_line(res.stderr)
    assert line.startswith("shoal: error: rank 1: never joined all_reduce (gradients) #"), line


def test_the_heartbeat_carries_the_collective_count_without_overflowing():
    """The count rides in the heartbeat counter (one store call a beat): it reads back exactly,
    also past the modulus it is carried in, and the counter stays far inside the store's
    64-bit integers however long the job runs."""
    from shoal.core.waits import SEQ_MOD, SEQ_UNIT, beat, count_of

    counter = published = 0
    counts = [0, 1, 1, 5, SEQ_MOD - 1, SEQ_MOD, SEQ_MOD + 7, 3 * SEQ_MOD + 2, 3 * SEQ_MOD + 2]
    for count in counts:
        counter += beat(count, published)
        published = count
        for near in (count, count + 3, count - 3):  # the reader's own count, a few apart
            assert count_of(counter, near) == count
        assert 0 <= counter < SEQ_MOD * SEQ_UNIT < 2**63
    assert counter % SEQ_UNIT == len(counts)  # every call was a beat


@pytest.mark.parametrize("elastic,what", [(False, "joined"), (True, "joined"),
                                          (False, "connected")])
def test_sigterm_ends_the_wait_for_a_rank_that_never_comes(elastic, what):
    """Rank 1 of 2 never joins (or, once a group formed, never says it connected) and nobody
    says it ended (its keeper killed under torchrun): rank 0's wait for it ends at SIGTERM
    with that line, which names the wait, not at the timeout (torchrun gives a rank 30 s
    after its SIGTERM, then kills it)."""
    from datetime import timedelta

    import torch.distributed as dist

    from shoal.core.env import Environment
    from shoal.core.group import all_joined
    from shoal.core.stop import STOP, request_stop
    from shoal.errors import Terminated

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    env = Environment(rank=0, world_size=2, master_port=store.port)
    timer = threading.Timer(0.5, request_stop)
    timer.start()
    try:
        with pytest.raises(Terminated, match=r"stopped by SIGTERM before every rank of the job "
                           rf"at 127\.0\.0\.1:{store.port} {what} \(rank 0 of 2\)"):
            all_joined(store, env, 20.0, elastic=elastic, what=what)
    finally:
        timer.cancel()
        STOP.clear()
