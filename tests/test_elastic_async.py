"""Elastic membership of the asynchronous strategies (--elastic): a worker killed mid-epoch
(kill -9) leaves its unfinished schedule, since its last push that counted at server 0, to
the workers left, so every sample of every epoch is trained exactly once; the dealing
itself (shoal.train.membership.schedule) without processes. Real processes, Gloo on CPU."""

from __future__ import annotations

import json

import pytest
import torch

from shoal.cli import _changed_compute_groups
from shoal.train.membership.schedule import Schedule, Slots, cut, deal

from conftest import (
    EPOCHS,
    TRAIN_ROWS,
    assert_each_sample_once,
    train_losing,
)

pytestmark = pytest.mark.timeout(300)



@pytest.mark.parametrize("strategy, servers", [("async-sgd", 2), ("async-easgd", 1)])
def test_a_killed_worker_leaves_and_the_others_train_its_share(tmp_path, strategy, servers):
    # 3 workers x 16 rows: 30 steps an epoch each. Worker 1 (rank servers + 1) kills itself
    # (SIGKILL) at its 20th training forward, mid-epoch 1 (async-easgd: inside an exchange
    # period of --tau 4): the rest of its epoch 1 and all of its epoch 2 are dealt. With 2
    # servers its count is the least of theirs, each taken once that server lost it too.
    out = tmp_path / "run"
    period = ["--tau", "4"] if strategy == "async-easgd" else []
    res = train_losing(out, servers + 1, "train:20", "--schedule", "constant", "--strategy",
                       strategy, "--servers", str(servers), *period, timeout=240)
    assert res.returncode == 0, res.stderr  # not 3: nothing was left untrained
    assert res.stray == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and not summary["degraded"] and "restarts" not in summary
    # every sample counted once in the summary too: the lost worker's counted samples of the
    # epoch it was lost in are in no epoch record (its sums went with it), and are added
    assert summary["samples"] == EPOCHS * TRAIN_ROWS
    [change] = summary["membership_changes"]
    assert change["left"] == [1] and change["workers"] == 2 and change["epoch"] == 1
    assert change["why"] == {"1": "worker 1 killed by signal 9"}
    counted = summary["lost_workers"][0]["samples_trained"]
    # Its last push carried its 19 steps (async-sgd) or the 16 before step 16's exchange.
    assert counted == 16 * (19 if strategy == "async-sgd" else 16)
    assert change["samples_dealt_again"] == 2 * 479 - counted  # its shard: 479 an epoch
    assert f"worker 1 left at step {change['step']} (worker 1 killed by signal 9); 2 go on " \
           f"with the {change['samples_dealt_again']} samples left of epochs 1 to 2" in res.stderr
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)


def test_a_worker_lost_after_its_push_counted_and_before_its_record_loses_no_line(tmp_path):
    """Worker 1 is killed right after server 0 applied its push of step 20 and before it
    wrote that step's --record-samples line: server 0 writes the line for it (its samples
    up to the last count), so every sample is recorded once."""
    out = tmp_path / "run"
    res = train_losing(out, 2, "train:20", "--strategy", "async-sgd", after_count=True,
                       timeout=240)
    assert res.returncode == 0, res.stderr
    assert res.stray == []
    [lost] = json.loads((out / "summary.json").read_text())["lost_workers"]
    last = json.loads((out / "samples" / "worker1.jsonl").read_text().splitlines()[-1])
    assert last == {"epoch": 0, "samples": last["samples"], "upto": lost["samples_trained"],
                    "recorded_by": "server 0"}
    assert len(last["samples"]) == 16  # step 20's batch: the worker wrote step 19's itself
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)


def test_a_worker_that_stops_answering_is_left_out(tmp_path):
    """Worker 1 stops (SIGSTOP) mid-epoch: server 0 loses it after --heartbeat-timeout, the
    others train its share, and the launcher ends it once they finished."""
    out = tmp_path / "run"
    res = train_losing(out, 2, "train:20", "--strategy", "async-sgd", "--heartbeat-timeout", "4",
                       signal=19, timeout=240)
    assert res.returncode == 0, res.stderr
    assert res.stray == []
    [change] = json.loads((out / "summary.json").read_text())["membership_changes"]
    assert change["left"] == [1] and change["why"]["1"].startswith("worker 1 stopped answering")
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)


def _read(slots, segments):
    return slots.samples(segments)[0].tolist()


def test_a_lost_schedule_is_dealt_once_even_after_a_second_loss():
    """Worker 2 of 3 is lost 50 samples into its schedule; workers 0 and 1 adopt their
    shares (worker 0 in its epoch 0, worker 1 already in epoch 1); then worker 1 is lost
    too, 40 samples into its own: what the lost ones counted, what worker 0 trains (its
    schedule and its share of worker 1's rest) hold every (epoch, sample) exactly once."""
    slots = Slots(100, 12, 3, seed=0)  # 3 slots of 34, 33, 33 samples an epoch
    schedules = {w: Schedule(slots, w, 3) for w in range(3)}
    shares = deal(schedules[2].rest(50), [0, 1])
    assert sum(hi - lo for s in shares.values() for _, _, lo, hi in s) == 3 * 33 - 50
    assert {e for e, *_ in shares[0]} == {1, 2}  # the rest of its epoch 1, and its epoch 2
    schedules[0].adopt(0, 25, shares[0])  # epoch 0 read 25: later epochs' shares at their ends
    schedules[1].adopt(1, 5, shares[1])  # 5 of its epoch 1 read: epoch 1's share there
    assert schedules[1].blocks[1][1][0] == 1 and schedules[1].blocks[2][-1][0] == 2
    again = deal(schedules[1].rest(40), [0])[0]
    trained = [cut(schedules[2].rest(0), 50)[0], cut(schedules[1].rest(0), 40)[0],
               schedules[0].rest(0), again]
    samples, epochs = slots.samples([segment for segments in trained for segment in segments])
    seen = sorted(zip(epochs.tolist(), samples.tolist(), strict=True))
    assert seen == [(e, s) for e in range(3) for s in range(100)]
    assert _read(slots, schedules[0].rest(0))[:25] == _read(slots, [(0, 0, 0, 25)])


def test_a_joiner_is_given_a_part_of_each_rest_and_nothing_is_trained_twice():
    """Worker 3 joins a 3-worker job: each giver gives the last third of the rest of each of
    its blocks from where it is (worker 0 25 samples into epoch 0, worker 1 at the end of
    its epoch 0, worker 2 5 into epoch 1); what they read before, what they keep and what
    the joiner walks hold every (epoch, sample) exactly once, and a giver's copy of its
    schedule (server 0's) cut at the same place gives the same pieces."""
    slots = Slots(100, 12, 3, seed=0)  # 3 slots of 34, 33, 33 samples an epoch
    schedules = {w: Schedule(slots, w, 3) for w in range(3)}
    copies = {w: Schedule(slots, w, 3) for w in range(3)}
    at = {0: (0, 25), 1: (0, 33), 2: (1, 5)}
    read = [cut(schedules[w].rest(0), schedules[w].start(e) + off)[0] for w, (e, off) in at.items()]
    given = {w: schedules[w].give(e, off, 4) for w, (e, off) in at.items()}
    assert given == {w: copies[w].give(e, off, 4) for w, (e, off) in at.items()}
    # worker 0: 9 of epoch 0's 34-25 left, 34 of epoch 1, 34 of epoch 2 -> 2 + 8 + 8
    assert [hi - lo for _, _, lo, hi in given[0]] == [2, 8, 8]
    assert [e for e, *_ in given[1]] == [1, 2] and [e for e, *_ in given[2]] == [1, 2]
    joiner = Schedule.empty(3)
    joiner.adopt(0, 0, [p for w in range(3) for p in given[w]])
    kept = [cut(schedules[w].rest(0), schedules[w].start(e) + off)[1] for w, (e, off) in at.items()]
    walked = [s for part in [*read, *kept, joiner.rest(0)] for s in part]
    samples, epochs = slots.samples(walked)
    seen = sorted(zip(epochs.tolist(), samples.tolist(), strict=True))
    assert seen == [(e, s) for e in range(3) for s in range(100)]


def test_server_0_answers_each_join_request_in_turn():
    """shoal join in an asynchronous job: server 0's desk admits a request whose proof
    checks, and refuses in one line a wrong proof, a request at the job's most workers and
    one while the job ends; a staleness bound that cannot take one more refuses too (what
    admitting raises); each ticket is answered once, in order."""
    import torch.distributed as dist

    from shoal.core.admission import ask
    from shoal.core.trust import Seal
    from shoal.core.waits import ELASTIC
    from shoal.errors import ShoalError
    from shoal.train.membership.server.members import JoinDesk

    store, seal = dist.HashStore(), Seal()
    desk = JoinDesk(store, seal, first=3, cap=4)
    keys = dist.PrefixStore(ELASTIC, store)

    def answers(live: int, ending: bool = False, admit=lambda joiner: 7) -> list[dict]:
        before = desk.handled
        desk.answer(live, ending, admit)
        return [json.loads(keys.get(f"join/{t}/answer")) for t in range(before + 1,
                                                                        desk.handled + 1)]

    ask(keys, seal, 1)
    ask(keys, Seal(), 2)  # another job's secret
    assert answers(3) == [{"epoch": 7, "joined": [3]},
                          {"refused": "its proof does not match this job's secret"}]
    ask(keys, seal, 3)
    assert answers(4) == [{"refused": "the job has 4 workers, its most (--max-workers 4); a "
                                      "worker may join once one is lost"}]
    ask(keys, seal, 4)
    assert answers(2, ending=True) == [
        {"refused": "the job is ending: no worker has work left to give it"}]

    def bound(joiner: int) -> int:
        raise ShoalError("--max-staleness 1 with 3 workers: ...")

    ask(keys, seal, 5)
    assert answers(2, admit=bound) == [{"refused": "--max-staleness 1 with 3 workers: ..."}]
    assert answers(2) == []  # nothing asked since


def test_a_sigterm_stop_line_says_how_to_go_on():
    """After SIGTERM the launcher says how to go on: --resume, except from a run of compute
    groups that lost a worker (its checkpoint does not resume yet: --init-from)."""

    lost = [{"left": [1], "why": {"1": "killed"}}]
    groups = {"strategy": "groups", "strategy_options": {"groups": 2}, "workers": 3}
    assert _changed_compute_groups({**groups, "membership_changes": lost})
    assert not _changed_compute_groups({**groups, "membership_changes": []})
    # 2 groups of one worker each, one lost: its checkpoint resumes
    assert not _changed_compute_groups({**groups, "workers": 1, "membership_changes": lost})
    assert not _changed_compute_groups({**groups, "strategy": "async-msgd",
                                        "membership_changes": lost})


def test_another_server_follows_what_server_0_tells_it_and_nobody_else(monkeypatch):
    """With several servers server 0 tells the others what they must know (on its pairs
    with them): a worker resting (a staleness bound stops waiting for it), a joiner to
    serve (a pusher from then on), a joiner's first pull taken (forgotten). A report from
    anyone else, or of a kind it does not know, fails in one line."""
    from shoal.core.processes import loopback_store
    from shoal.errors import ShoalError
    from shoal.ps import Admission, ShardServer
    from shoal.train.membership.server.followers import COORDINATOR, Follower

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    shard = ShardServer(loopback_store(30.0), 1, 3, None, torch.zeros(2), timeout=1.0,
                        admission=Admission((0, 1, 2), max_staleness=3), readers=(COORDINATOR,))
    follower = Follower(1, None, timeout=5.0)
    follower.shard = shard
    follower._ready.set()  # as run() does once the shard serves
    assert COORDINATOR in shard.ids and COORDINATOR not in shard.admission.pushers
    for _ in range(4):
        shard.ledger.book(0)
    assert shard.admission.blockers(0, shard.ledger, shard._active(0)) == [1]
    follower.on_report(COORDINATOR, {"kind": "rest", "client": 1, "resting": True})
    assert shard.admission.blockers(0, shard.ledger, shard._active(0)) == [2]
    follower.on_report(COORDINATOR, {"kind": "rest", "client": 2, "resting": True})
    assert shard.admission.blockers(0, shard.ledger, shard._active(0)) == []
    follower.on_report(COORDINATOR, {"kind": "rest", "client": 1, "resting": False})
    assert shard._active(0) == [1]
    shard.first_pulls[7] = torch.ones(2)
    follower.on_report(COORDINATOR, {"kind": "taken", "client": 7})
    assert 7 not in shard.first_pulls
    follower.on_report(COORDINATOR, {"kind": "serve", "client": 3, "connect_timeout": 1.0})
    try:
        assert 3 in shard.ids and shard.admission.pushers == (0, 1, 2, 3)
        with pytest.raises(ShoalError, match="takes reports from server 0 only, not from "
                                             "client 2"):
            follower.on_report(2, {"kind": "rest", "client": 0, "resting": True})
        with pytest.raises(ShoalError, match="unknown word from server 0: 'drop'"):
            follower.on_report(COORDINATOR, {"kind": "drop", "client": 0})
    finally:
        shard.close(timeout=5.0)


def test_a_lost_workers_count_is_the_least_of_the_servers_each_published_once_it_lost_it():
    """Server 1 publishes its count of each worker it lost in the job's store (its ``run``
    loop, while it serves); server 0 takes the least of its own and theirs, waiting for a
    server that has not lost the worker yet, and ends the job in one line when one never
    does."""
    import threading

    import torch.distributed as dist

    from shoal.errors import JobError
    from shoal.ps import ShardServer
    from shoal.train.membership.server.followers import Follower, Leader

    store = dist.HashStore()
    shard = ShardServer(None, 1, 2, None, torch.zeros(2), timeout=1.0)
    follower = Follower(1, store, timeout=5.0)
    serving = threading.Thread(target=follower.run, args=(shard,), daemon=True)
    serving.start()
    leader = Leader(None, store, servers=2, silence=0.5)
    shard.counted[1] = 48  # the last exchange of worker 1 that server 1 applied
    shard._lose(1, "killed")
    assert leader.counted(1, mine=64) == 48  # server 0 applied one more: it does not count
    assert leader.counted(1, mine=32) == 32
    with pytest.raises(JobError, match="server 1 did not lose worker 0 within 5.5 s of "
                                       "server 0; the job ends"):
        leader.counted(0, mine=16)
    shard._lose(0, "killed")  # every client gone: the follower's loop ends
    serving.join(timeout=10)
    assert not serving.is_alive() and store.get("elastic/lost/1/0") == b"0"
