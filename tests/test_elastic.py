"""Elastic membership (--elastic): a worker killed mid-epoch (kill -9) does not stop the job;
the others re-form the group at the next meeting and train its unfinished share, so every
sample of every epoch is trained exactly once. Real processes, Gloo on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shoal.cli import main
from shoal.data.sharding import EpochPlan

from conftest import (
    EPOCHS,
    TRAIN_ROWS,
    assert_each_sample_once,
    one_error_line,
    step_workers,
    train_here,
    train_losing,
)

pytestmark = pytest.mark.timeout(600)


# sync and diloco losing worker 2 at the same step: tests/test_elastic_join.py, before the join.
# Losing worker 0, which wrote the records: worker 1 (then rank 0) writes them on.
# (diloco losing worker 0: tests/test_elastic_join.py, before the join in its place.)
@pytest.mark.parametrize("strategy, killed", [("local-sgd", 1), ("easgd", 1), ("sync", 0)])
def test_a_killed_worker_leaves_and_the_others_train_its_share(tmp_path, strategy, killed):
    # 3 workers x 16 rows: 30 steps an epoch; the worker kills itself (SIGKILL) at its 40th
    # training forward, step 10 of epoch 2, inside a round of --tau 4 (the last exchange
    # was at step 36).
    out = tmp_path / "run"
    res = train_losing(out, killed, "train:40", "--schedule", "constant", "--log-every", "1",
                       "--strategy", strategy, *([] if strategy == "sync" else ["--tau", "4"]))
    assert res.returncode == 0, res.stderr
    assert res.stray == []
    assert f"worker {killed} left at step 39" in res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and "restarts" not in summary
    [change] = summary["membership_changes"]
    assert change["left"] == [killed] and change["workers"] == 2
    assert change["why"] == {str(killed): f"worker {killed} killed by signal 9"}
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    workers = {r["step"]: r["workers"] for r in steps if r.get("event") == "step"}
    assert workers[39] == 3 and workers[40] == 2 and max(workers) > 60  # more, smaller steps
    # one record a step, in order, whoever wrote it
    assert [r["step"] for r in steps if r.get("event") == "step"] == sorted(workers)
    assert [r["epoch"] for r in steps if r.get("event") == "epoch"] == list(range(1, EPOCHS + 1))


def test_sync_with_a_16_bit_all_reduce_loses_a_worker_like_without(tmp_path):
    """--compress bf16 under --elastic: the bucket hook's all-reduce is a meeting voted on
    and left like the plain one (it divides by the group's size at each step)."""
    out = tmp_path / "run"
    res = train_losing(out, 1, "train:40", "--strategy", "sync", "--compress", "bf16",
                       "--log-every", "1")
    assert res.returncode == 0, res.stderr
    assert "worker 1 left at step 39" in res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and summary["test_accuracy"] > 0.85
    assert summary["strategy_options"]["compress"] == "bf16"
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)
    assert step_workers(out)[40] == 2


def test_a_worker_lost_before_ddps_buffer_broadcast_is_left_like_in_any_meeting(tmp_path):
    """sync on a model with BatchNorm: DDP broadcasts rank 0's buffers at every forward.
    Worker 1 dies right after its optimizer's step 39, every meeting of that step done: the
    next the others meet is step 40's buffer broadcast, which fails the job in DDP's own
    (outside any vote). Under --elastic it is a meeting like the others: the step is taken
    again by the two left and no sample is lost or trained twice."""
    out = tmp_path / "run"
    res = train_losing(out, 1, "step:39", "--strategy", "sync", "--log-every", "1",
                       model="tests.fixtures_models:batchnorm_killed_after_step")
    assert res.returncode == 0, res.stderr
    assert res.stray == []
    assert "worker 1 left at step 39" in res.stderr
    [change] = json.loads((out / "summary.json").read_text())["membership_changes"]
    assert change["left"] == [1] and change["workers"] == 2
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)
    assert step_workers(out)[40] == 2


def test_worker_0_lost_while_the_job_starts_is_left_at_the_first_epoch(tmp_path):
    """sync: worker 0 dies in its model's first forward (the shape check, before DDP wraps
    it), after the group formed and before it wrote anything: the others go on from the
    first step, worker 1 writes config.json and the records (before, DDP's first collective
    failed the job with Gloo's 'Connection closed by peer')."""
    out = tmp_path / "run"
    res = train_losing(out, 0, "eval:1", "--strategy", "sync", "--log-every", "1")
    assert res.returncode == 0, res.stderr
    assert res.stray == []
    assert "worker 0 left at step 0" in res.stderr
    assert "2 worker(s), strategy sync, global batch 32, 45 steps/epoch" in res.stdout
    summary = json.loads((out / "summary.json").read_text())
    [change] = summary["membership_changes"]
    assert change["left"] == [0] and change["workers"] == 2 and change["step"] == 0
    assert summary["completed"] and summary["workers"] == 2
    assert json.loads((out / "config.json").read_text())["elastic"]
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)
    assert set(step_workers(out).values()) == {2}


def test_a_worker_lost_in_the_last_test_leaves_the_test_accuracy_whole(tmp_path):
    """A worker dies in the test after the last epoch (its shard's results go with it): the
    test is taken again over the two left, so the run reports the uninterrupted run's
    accuracy and loss, its model being the same (before: a third of the test set missing,
    63% instead of 95%)."""
    killed = 0  # any worker's shard went with it (worker 2's too, before)
    # the uninterrupted run: its flags, nobody killed, in this process (only its summary is read)
    train_here(tmp_path / "whole", "--model", "tests.fixtures_models:killed_at", "--dataset",
               "digits", "--workers", "3", "--epochs", str(EPOCHS), "--strategy", "sync",
               "--elastic", "--record-samples")
    res = train_losing(tmp_path / "run", killed, f"eval:{EPOCHS + 1}", "--strategy", "sync")
    assert res.returncode == 0, res.stderr
    assert f"worker {killed} left at step" in res.stderr and "2 go on (no samples left)" in res.stderr
    expected, got = (json.loads((tmp_path / name / "summary.json").read_text())
                     for name in ("whole", "run"))
    [change] = got["membership_changes"]
    assert change["left"] == [killed] and change["samples_dealt_again"] == 0
    assert got["test_accuracy"] == expected["test_accuracy"] > 0.9
    # the same sums in float32 batches of other sizes (two shards, not three)
    assert got["test_loss"] == pytest.approx(expected["test_loss"], rel=1e-6)


def test_every_worker_lost_fails_the_job_in_one_line(tmp_path):
    """Each worker alone may be lost under --elastic (worker 0 too); all of them is the job
    lost: one line and status 1, not a silent success with no summary."""
    out = tmp_path / "run"
    res = train_losing(out, "0,1", "train:40", "--strategy", "local-sgd", "--tau", "4",
                       workers=2)
    assert res.returncode == 1, res.stderr
    assert res.stray == []
    assert "every worker was lost (worker 0 killed by signal 9; worker 1 killed by signal 9)" \
        in one_error_line(res.stderr)
    assert not (out / "summary.json").exists()


def test_a_worker_that_is_not_the_lost_ones_neighbour_does_not_wait_out_the_timeout(tmp_path):
    """4 workers: worker 2 dies in a step's all-reduce. Workers 1 and 3 (its ring neighbours)
    see their connections close; worker 0 does not, and used to sit in Gloo until the
    collectives' timeout (the heartbeat timeout, here 120 s) before the group re-formed. It
    now leaves as soon as the others vote the step failed; and no process of the job dies
    on its way out for the collective it left."""
    out = tmp_path / "run"
    res = train_losing(out, 2, "train:40", "--strategy", "sync", "--log-every", "1",
                       "--heartbeat-timeout", "120", workers=4)
    assert res.returncode == 0, res.stderr
    assert "died while exiting" not in res.stderr and "terminate called" not in res.stderr
    [change] = json.loads((out / "summary.json").read_text())["membership_changes"]
    assert change["left"] == [2] and change["workers"] == 3
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    elapsed = {r["step"]: r["elapsed_s"] for r in steps if r.get("event") == "step"}
    stall = max(elapsed[s + 1] - elapsed[s] for s in range(1, max(elapsed)) if s + 1 in elapsed)
    assert stall < 60, f"the survivors stood still {stall:.1f} s: the collectives' timeout"
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)


def test_the_rest_of_an_epoch_after_a_loss():
    """Lost rank 1 of 3 read 2 uncounted steps (2 and 3 of 5): its shards of those steps,
    then the steps nobody started, dealt over 2 workers; nothing dropped or repeated."""
    plan = EpochPlan(30, 6, 3, seed=0)
    perm = plan.permutation(0)
    lost = plan.lost_shards(perm, range(2, 4), [1])
    assert [t.tolist() for t in lost] == [perm[14:16].tolist(), perm[20:22].tolist()]
    order = torch.cat([*lost, plan.rest(perm, 4)])
    assert order.tolist() == perm[14:16].tolist() + perm[20:22].tolist() + perm[24:].tolist()
    rest = EpochPlan(len(order), 4, 2, seed=0, order=order)
    read = torch.cat([rest.local(rest.permutation(5), s, r)[0]
                      for s in range(rest.steps_per_epoch) for r in range(2)])
    assert read.tolist() == order.tolist()
    assert EpochPlan(0, 4, 2, seed=0, order=order[:0]).steps_per_epoch == 0


@pytest.mark.parametrize("args, expected", [
    (["--strategy", "groups", "--elastic", "--max-restarts", "1"],
     "--elastic groups does not restart yet (--max-restarts)"),
    (["--record-samples"], "add --elastic"),
    (["--max-workers", "3"], "add --elastic"),
])
def test_what_elastic_does_not_take_is_one_line(tmp_path, capsys, args, expected):
    code = main(["train", "--out", str(tmp_path / "run"), "--workers", "2", "--epochs", "1",
                 "--dataset", "digits", *args])
    assert code == 2
    assert expected in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_a_worker_that_stops_answering_is_left_out(tmp_path):
    """Worker 1 stops (SIGSTOP) mid-epoch: the others drop it after the collectives' and the
    heartbeat's timeouts, finish the run with its share, and the launcher ends it."""
    out = tmp_path / "run"
    res = train_losing(out, 1, "train:40", "--strategy", "local-sgd", "--tau", "4",
                       "--heartbeat-timeout", "5", signal=19)
    assert res.returncode == 0, res.stderr
    assert res.stray == []
    [change] = json.loads((out / "summary.json").read_text())["membership_changes"]
    assert change["left"] == [1] and change["why"]["1"].startswith("worker 1 stopped answering")
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)


def test_a_chain_of_collectives_is_left_as_soon_as_its_meeting_is_voted_failed():
    """PowerSGD's DDP hook issues its all-reduces itself, one after another: under --elastic
    its future is watched as one collective (``FutureWork``), so a member that stopped
    answering holds it only until the meeting is voted failed (measured: the survivors of
    a stopped worker stalled 8.1 s with --heartbeat-timeout 4 before, 5.0 s after, as
    plain sync's 5.1 s). A chain that completes hands its value on."""
    import torch
    import torch.distributed as dist

    from shoal.core.inflight import FutureWork
    from shoal.core.membership import Membership
    from shoal.core.waits import ELASTIC

    store = dist.HashStore()
    m = Membership(store, 0, 3, lambda member: f"beat/{member}", timeout=0.5, patience=5.0,
                   device_type="cpu", connect=lambda: store)
    try:
        done: torch.futures.Future = torch.futures.Future()
        done.set_result([torch.ones(2)])
        assert m.watched(FutureWork(done)).wait()[0].tolist() == [1.0, 1.0]
        failing: torch.futures.Future = torch.futures.Future()
        failing.set_exception(RuntimeError("Connection closed by peer"))
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            m.watched(FutureWork(failing)).wait()
        hung: torch.futures.Future = torch.futures.Future()  # a peer that never answers
        watched = m.watched(FutureWork(hung))
        dist.PrefixStore(ELASTIC, store).set(m.decision, "abort")
        with pytest.raises(RuntimeError, match="voted failed"):
            watched.wait()
        # Left behind: the group's clean-up (leave_group, prune) asks each collective left
        # whether it is over, a chain as a single collective (it raised AttributeError).
        assert [w.is_completed() for w in m.inflight.left] == [False]
        hung.set_result([torch.ones(2)])
        assert [w.is_completed() for w in m.inflight.left] == [True]
    finally:
        m.inflight.stop(timeout=5)


def test_the_in_flight_watch_outlives_a_failed_store_call_and_a_decision_deleted():
    """A store call of the in-flight poll thread that fails once does not end the watch:
    before, it ended the poll thread for good, and the next member lost left this one in
    Gloo for the collectives' timeout (120 s, seen once in a whole suite). The thread reads
    a decision without waiting (a decision deleted between its check and its get, as every
    member is past the meeting, held it for the client's timeout, then raised): one
    deleted while watched is not a failed meeting."""
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from shoal.core.inflight import FutureWork, InFlight

    class Failing(dist.Store):  # the store, whose calls fail while ``fails`` > 0
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.fails = dist.HashStore(), 0

        def _call(self, name: str, *args):
            if self.fails > 0:
                self.fails -= 1
                raise RuntimeError("a store call failed")
            return getattr(self.inner, name)(*args)

        def set(self, key, value):
            return self._call("set", key, value)

        def get(self, key):
            return self._call("get", key)

        def check(self, keys):
            return self._call("check", keys)

        def compare_set(self, key, expected, desired):
            return self._call("compare_set", key, expected, desired)

    store = Failing()
    store.inner.set_timeout(timedelta(seconds=30))
    inflight = InFlight(lambda: store, "p")

    def left_within(seconds: float, decision: str, fails: int = 0) -> bool:
        watched = inflight.watch(FutureWork(torch.futures.Future()), decision)  # hung
        store.fails = fails
        store.inner.set(f"p/{decision}", "abort")
        deadline = time.monotonic() + seconds
        while not watched.done() and time.monotonic() < deadline:
            time.sleep(0.02)
        return watched.done()

    try:
        committed = inflight.watch(FutureWork(torch.futures.Future()), "0/0/decision")
        store.inner.set("p/0/0/decision", "commit")
        time.sleep(0.2)  # looked at, and not failed
        store.inner.delete_key("p/0/0/decision")  # every member past it: forgotten
        time.sleep(0.2)
        assert not committed.done()
        assert left_within(5, "0/1/decision", fails=1), "a failed store call ended the watch"
        assert left_within(5, "0/2/decision")
    finally:
        inflight.stop(timeout=5)


def test_a_slow_meeting_watches_the_heartbeats_so_a_stopped_member_is_gone_one_timeout_on():
    """While a meeting is waited on for more than a second, the in-flight poll thread looks at
    the members' heartbeat counters: a member whose counter stood still since is gone one
    heartbeat timeout after that look, not only a timeout after the first look the
    collective's own timeout leads to (before: a stopped worker was left after twice the
    heartbeat timeout). A member still beating is not gone; a fast meeting looks at none."""
    import threading
    import time

    import torch.distributed as dist

    from shoal.core.membership import Membership

    store = dist.HashStore()
    m = Membership(store, 0, 3, lambda member: f"beat/{member}", timeout=0.5, patience=5.0,
                   device_type="cpu", connect=lambda: store)
    with m.inflight.vote("0/0/decision", []):
        time.sleep(0.2)
    assert m._beats == {}  # a meeting that is not slow costs no heartbeat reads
    done = threading.Event()

    def beating() -> None:  # member 2 runs; member 1 stopped
        while not done.is_set():
            store.add("beat/2", 1)
            time.sleep(0.05)

    beater = threading.Thread(target=beating, daemon=True)
    beater.start()
    try:
        with m.inflight.vote("0/1/decision", []):
            deadline = time.monotonic() + 30
            while 1 not in m._beats and time.monotonic() < deadline:
                time.sleep(0.05)
            assert 1 in m._beats, "the poll thread never looked at the heartbeats"
            time.sleep(0.7)  # past the 0.5 s timeout since that look
            assert m._gone(1) and not m._gone(2)
    finally:
        done.set()
        beater.join(timeout=5)
        m.inflight.stop(timeout=5)


def _arrives_late_then_sums(delay: float) -> float:
    """Rank 1 comes ``delay`` seconds after rank 0 (a slow start on a busy machine), then
    both join the elastic group (1 s heartbeat timeout) and all-reduce once."""
    import time

    from shoal.core.connect import init_comm
    from shoal.core.env import detect_environment

    env = detect_environment()
    if env.rank == 1:
        time.sleep(delay)
    comm = init_comm(env, "cpu", timeout=60.0, heartbeat_timeout=1.0, elastic=True)
    total = torch.ones(1)
    comm.all_reduce(total)
    comm.close("returned")
    return float(total.item())


def test_a_rank_that_starts_late_is_waited_for_not_lost():
    # The rendezvous waits --timeout; only the elastic group's collectives wait the (short)
    # heartbeat timeout. Before, a rank 4 s late failed the job's start under --elastic.
    from shoal.core.processes import spawn

    assert spawn(2, _arrives_late_then_sums, (4.0,)) == [2.0, 2.0]


def _loses_rank_2_then_gathers_and_counts() -> tuple[float, list | None, float, int, int]:
    """4 elastic ranks (60 s collectives' timeout); rank 2 dies, then the others gather an
    object each (as a checkpoint's and the handover's bookkeeping do; rank 0 gets them),
    which re-forms their group without it, and sum again: how long the gather took, the
    workers gathered, the sum, how many TCP connections this process has open then other
    than its store's, and how many Gloo loop threads."""
    import gc
    import os
    import signal
    import time

    from shoal.core.connect import init_comm
    from shoal.core.env import detect_environment
    from shoal.core.sockets import connections, socket_inodes

    env = detect_environment()
    comm = init_comm(env, "cpu", timeout=60.0, heartbeat_timeout=60.0, elastic=True)
    comm.all_reduce(torch.ones(1))
    if env.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    got = comm.gather_objects({"worker": env.rank, "pad": "x" * 100_000})
    took = time.monotonic() - started
    total = torch.ones(1)
    comm.all_reduce(total)
    mine, ports = socket_inodes(), connections()
    opened = sum(1 for inode in mine if inode in ports and env.master_port not in ports[inode])
    gc.collect()
    task = f"/proc/{os.getpid()}/task"
    loops = sum(1 for t in os.listdir(task)
                if (Path(task) / t / "comm").read_text().strip() == "gloo_tcp_loop")
    comm.close("returned")
    return took, got and [o["worker"] for o in got], float(total), opened, loops


@pytest.fixture(scope="class")
def survivors() -> list[tuple[float, list | None, float, int, int]]:
    """What ranks 0, 1 and 3 of one job of :func:`_loses_rank_2_then_gathers_and_counts`
    return (its class's tests read it)."""
    from shoal.core.processes import spawn

    results = spawn(4, _loses_rank_2_then_gathers_and_counts, tolerate=lambda rank: rank == 2)
    return [r for rank, r in enumerate(results) if rank != 2]


class TestRank2LostOf4:
    """One job of 4 elastic ranks that loses rank 2, read by both tests."""

    def test_a_group_left_is_cut_off_not_kept_open(self, survivors):
        """A group left at a change is destroyed; where that could not happen at once (worker
        0, not dead worker 2's ring neighbour, left its all-reduce; a collective's error held
        the group) it was kept with its connections open, and data a peer had sent on one
        sat unread while Gloo's loop thread woke on it again and again (a soak's worker spent
        most of a core in it); and a failed collective's error, kept by torch's future in a
        cycle the collector cannot see, kept every old group's Gloo thread for good. Each
        survivor now has only its current group's connections (one to each of the 2 other
        members) and its one loop thread."""
        assert [r[1] for r in survivors] == [[0, 1, 3], None, None]
        assert [r[2] for r in survivors] == [3.0] * 3
        assert [r[3] for r in survivors] == [2, 2, 2], "an old group's connections"
        assert [r[4] for r in survivors] == [1, 1, 1], "an old group's Gloo thread"

    def test_an_object_gather_is_left_at_once_when_a_worker_is_lost(self, survivors):
        """Worker 0 is not dead worker 2's ring neighbour: torch's object collectives kept it
        in Gloo until the collectives' timeout (60 s); elastic ones are left when the vote
        fails."""
        (took, workers, *_), *_ = survivors
        assert workers == [0, 1, 3]
        assert took < 30, f"worker 0 waited {took:.1f} s: the collectives' timeout"


@pytest.mark.parametrize("strategy", ["sync", "diloco"])
def test_a_worker_lost_between_two_epochs_leaves_no_sample_twice(tmp_path, strategy):
    # Worker 2 dies in the evaluation after epoch 1 (its 2nd eval forward; the 1st is the
    # model's check): the loss is seen between epochs, all of epoch 1 counted, none of epoch 2
    # begun. Before, epoch 2's first step was taken on the plan for 3 workers, then all of
    # epoch 2 again over the 2 left (32 samples twice).
    out = tmp_path / "run"
    res = train_losing(out, 2, "eval:2", "--schedule", "constant", "--log-every", "1",
                       "--strategy", strategy, *([] if strategy == "sync" else ["--tau", "4"]))
    assert res.returncode == 0, res.stderr
    assert "worker 2 left at step 30" in res.stderr
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)


def test_streamed_fragments_count_a_lost_workers_steps_through_the_oldest_exchange(tmp_path):
    """Streaming DiLoCo (--fragments 2 --overlap-steps 1, tau 8) under --elastic: a step's
    work counts once every fragment's exchange carried it, so worker 1, killed at its 40th
    forward (step 40), counted through step 35 (fragment 0's last exchange started after it;
    fragment 1's after step 39). Its steps 36-39 are dealt to the others: every sample of
    every epoch once by the records, none of the lost worker's work missing from any
    fragment."""
    out = tmp_path / "run"
    res = train_losing(out, 1, "train:40", "--schedule", "constant", "--log-every", "1",
                       "--strategy", "diloco", "--tau", "8", "--fragments", "2",
                       "--overlap-steps", "1")
    assert res.returncode == 0, res.stderr
    assert "worker 1 left at step 42" in res.stderr  # fragment 0's next exchange
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and summary["strategy_options"]["fragments"] == 2
    [change] = summary["membership_changes"]
    assert change["left"] == [1] and change["workers"] == 2
    lines = [json.loads(line) for line in (out / "samples" / "worker1.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines][-3:] == [30, 31, 35]  # epoch 1's end, then fragment 0's
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)
    assert step_workers(out)[42] == 3 and step_workers(out)[43] == 2
