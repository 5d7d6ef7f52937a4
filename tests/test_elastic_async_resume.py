"""--resume of an asynchronous --elastic run: every worker's schedule rebuilt from the
checkpoint (shoal.train.membership.resume) so that what was read before it and what each worker
trains after it hold every sample of every epoch exactly once, whoever was lost or had
joined; end to end with real processes (Gloo on CPU): a worker killed, the run stopped, and
resumed with the lost worker back."""

from __future__ import annotations

import io
import json

import pytest
import torch
import torch.distributed as dist

from shoal.config import TrainConfig
from shoal.train.membership.messages import Adopt, Give
from shoal.train.membership.resume import dealer_state, rebuild, uncounted
from shoal.train.membership.schedule import cut
from shoal.train.membership.server.dealer import Dealer

from conftest import (
    EPOCHS,
    TRAIN_ROWS,
    assert_each_sample_once,
    shoal,
    shoal_env,
    train_here,
    train_losing,
)

pytestmark = pytest.mark.timeout(300)


def _walk(schedule) -> list:
    return [s for block in schedule.blocks for s in block]


def _dealer_midway(tmp_path, late: bool = False) -> tuple[Dealer, dict]:
    """A 3-worker job's server 0 (100 samples, 3 epochs) after: worker 2 lost 50 samples
    in, its rest dealt (worker 0 took its share, worker 1 too); joiner 3 given its part by
    workers 0 and 1 and 10 samples into it; joiner 4 asked for and only worker 0 gave.
    ``late``: worker 1 had read none of that (its share not taken, its part not given)."""
    cfg = TrainConfig(out=str(tmp_path), epochs=3, batch_size=4, seed=0)
    dealer = Dealer(cfg, dist.HashStore(), 100, 3, 1)
    dealer.lost(2, {"counted": 50, "step": 13}, {0, 1}, lambda: "killed")
    dealer.take(0, Adopt(deal=1, epoch=0, offset=25))
    if not late:
        dealer.take(1, Adopt(deal=1, epoch=1, offset=5))
    dealer.admit(3, {0, 1}, 20, 0)
    dealer.take(0, Give(deal=2, epoch=0, offset=30))
    if late:
        return dealer, {3: 0}
    dealer.take(1, Give(deal=2, epoch=1, offset=6))
    dealer.given({0, 1, 3})  # deal 3: the pieces to the joiner
    dealer.take(3, Adopt(deal=3, epoch=0, offset=0))
    dealer.admit(4, {0, 1, 3}, 30, 0)  # deal 4
    dealer.take(0, Give(deal=4, epoch=0, offset=31))
    return dealer, {3: 10, 4: 0}  # live, no state in the file


def _payload(dealer: Dealer, counts: dict, positions: dict, epochs_recorded: int = 0) -> dict:
    """A checkpoint as server 0 writes it, read back as shoal reads one (tensors and plain
    data only)."""
    payload = {"progress": {"step": 40},
               "ranks": [None if w not in positions else {"elastic": positions[w]}
                         for w in range(3)],
               "coordinator": {"epoch": epochs_recorded,
                               "elastic": dealer_state(dealer, counts, dict(dealer.lost_at),
                                                       max(dealer.schedules) + 1)}}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("epochs, late", [(3, False), (4, False), (3, True)])
def test_a_resumed_schedule_trains_what_nobody_had_read_once(tmp_path, epochs, late):
    """What every worker had read before the checkpoint (the live ones up to their
    positions, the lost one and the joiners up to their counts) and what each of the 3
    resumed workers trains after it hold every (epoch, sample) exactly once; worker 2, lost
    before, is back with a part of the others' rest; --epochs grown by one: the new epoch
    too; worker 1 late: its share taken and its part kept at the resume. Server 0 and every
    worker rebuild the same schedules from the file."""
    dealer, counts = _dealer_midway(tmp_path, late)
    # Worker 0 at 32 of its block 0 (counted to 30), worker 1 at 10 of its block 1, which
    # had not read deal 4 (nothing for it) and would still give joiner 4 its part.
    positions = {0: {"epoch": 0, "read": 32, "at": 30}, 1: {"epoch": 1, "read": 10, "at": 43}}
    before = {w: _walk(s) for w, s in dealer.schedules.items()}
    payload = _payload(dealer, counts, positions)
    starts = rebuild(payload, 3, dealer.slots, epochs)
    again = rebuild(payload, 3, dealer.slots, epochs)  # the same wherever it is made
    assert {w: (s.schedule.blocks, s.epoch, s.offset) for w, s in again.items()} == \
        {w: (s.schedule.blocks, s.epoch, s.offset) for w, s in starts.items()}
    assert sorted(starts) == [0, 1, 2] and starts[2].back and not starts[0].back
    assert starts[2].position == starts[2].at == 50
    # worker 2's schedule up to its count is its head in its start
    assert cut(_walk(starts[2].schedule), 50)[0] == cut(before[2], 50)[0]
    read = [cut(before[3], counts[3])[0]] + [cut(_walk(s.schedule), s.position)[0]
                                       for s in starts.values()]
    # Each live worker's schedule up to its position is its own (as it had it).
    for w in (0, 1):
        assert cut(_walk(starts[w].schedule), starts[w].position)[0] == \
            cut(before[w], starts[w].position)[0]
    rest = [s.schedule.rest(s.position) for s in starts.values()]
    samples, of = dealer.slots.samples([seg for part in read + rest for seg in part])
    seen = sorted(zip(of.tolist(), samples.tolist(), strict=True))
    assert seen == [(e, s) for e in range(epochs) for s in range(100)]
    assert all(s.schedule.rest(s.position) for s in starts.values())  # everyone has work
    # Worker 0 read 2 samples past its count: its records' next lines once they count.
    [(epochs_of, trained)] = uncounted(dealer.slots, starts[0])
    assert trained.tolist() == dealer.slots.samples(cut(cut(before[0], 32)[0], 30)[1])[0].tolist()
    assert epochs_of.tolist() == [0, 0]


def test_a_worker_lost_and_not_yet_seen_so_when_the_file_was_written_is_back_at_its_count(
        tmp_path):
    """Worker 1 was live when the checkpoint was written but had sent no state for it (lost,
    and not seen so yet): its rest from its count is dealt, and it is back at that count,
    so what it had read before it is not read again."""
    dealer, counts = _dealer_midway(tmp_path)
    before = {w: _walk(s) for w, s in dealer.schedules.items()}
    payload = _payload(dealer, {**counts, 1: 40}, {0: {"epoch": 0, "read": 32, "at": 30}})
    starts = rebuild(payload, 3, dealer.slots, 3)
    assert starts[1].back and starts[1].position == starts[1].at == 40
    assert cut(_walk(starts[1].schedule), 40)[0] == cut(before[1], 40)[0]
    read = [cut(before[3], counts[3])[0]] + [cut(_walk(s.schedule), s.position)[0]
                                               for s in starts.values()]
    rest = [s.schedule.rest(s.position) for s in starts.values()]
    samples, of = dealer.slots.samples([seg for part in read + rest for seg in part])
    assert sorted(zip(of.tolist(), samples.tolist(), strict=True)) == \
        [(e, s) for e in range(3) for s in range(100)]


def test_a_worker_that_had_ended_is_given_nothing_while_others_go_on(tmp_path):
    """A worker whose trainer had ended (SIGTERM while it waited for its release: at the
    end of its last block) takes no share of what is left: the others do."""
    dealer, counts = _dealer_midway(tmp_path)
    ended = sum(hi - lo for *_, lo, hi in _walk(dealer.schedules[1]))
    positions = {0: {"epoch": 0, "read": 32, "at": 30}, 1: {"epoch": 3, "read": 0, "at": ended}}
    starts = rebuild(_payload(dealer, counts, positions), 3, dealer.slots, 3)
    assert starts[1].schedule.rest(starts[1].position) == []
    assert starts[1].schedule.blocks == [[tuple(s) for s in b] for b in dealer.schedules[1].blocks]


def test_a_checkpoint_of_one_kind_does_not_resume_as_the_other(tmp_path, capsys):
    from shoal.cli import main

    from conftest import one_error_line

    out = tmp_path / "run"
    train_here(out, "--workers", "2", "--epochs", "1", "--dataset", "digits", "--strategy",
               "async-sgd", "--stop-at-step", "5")
    capsys.readouterr()
    code = main(["train", "--out", str(out), "--workers", "2", "--epochs", "1", "--dataset",
                 "digits", "--strategy", "async-sgd", "--elastic", "--resume"])
    assert code == 2
    assert "--elastic resumes an asynchronous run only from a checkpoint of an --elastic " \
           "run" in one_error_line(capsys.readouterr().err)


def test_a_stopped_elastic_run_resumes_with_its_lost_worker_back(tmp_path):
    """Worker 1 of 3 is killed at its 20th step (its rest dealt to workers 0 and 2), the run
    stops at step 100 (--stop-at-step: a checkpoint); --resume starts 3 workers again:
    worker 1 is back with a part of the others' rest, worker 2 is killed at its first step
    (before its first exchange: what it had counted before the stop stays counted), the
    run ends, and every sample of every epoch was trained exactly once over both runs."""
    out, epochs = tmp_path / "run", 3
    flags = ["--strategy", "async-sgd", "--schedule", "constant", "--epochs", str(epochs)]
    res = train_losing(out, 2, "train:20", *flags, "--stop-at-step", "100", timeout=240)
    assert res.returncode == 0, res.stderr
    assert res.stray == []
    res = shoal("train", "--out", str(out), "--progress", "plain", "--model",
                "tests.fixtures_models:killed_at", "--dataset", "digits", "--workers", "3",
                *flags, "--elastic", "--record-samples", "--resume", timeout=240,
                env={**shoal_env(), "SHOAL_TEST_KILL_RANK": "3", "SHOAL_TEST_KILL_AT": "train:1"})
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and not summary["degraded"]
    assert summary["samples"] == epochs * TRAIN_ROWS  # the lost worker's counted ones too
    left, back, again = summary["membership_changes"]
    assert left["left"] == [1] and back["joined"] == [1] and again["left"] == [2]
    assert back["why"] == {"1": "back at --resume"} and back["samples_dealt_again"] > 0
    assert "worker 1 is back at --resume" in res.stderr
    assert_each_sample_once(out, epochs, TRAIN_ROWS)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # every epoch recorded once: those recorded before the stop are kept (epoch 2's step is
    # past 2 epochs' steps: the workers trained the lost one's rest too)
    assert [r["epoch"] for r in records if r["event"] == "epoch"] == list(range(1, epochs + 1))
    steps = [r["step"] for r in records if r["event"] == "epoch"]
    assert steps == sorted(set(steps)), steps  # a later resume cuts the records by step


def test_max_restarts_starts_an_elastic_asynchronous_job_again_from_its_checkpoint(tmp_path):
    """Server 0 is killed (kill -9) at its first test of the center (its first forward is
    the model's check at its start), once the checkpoints of steps 10 and 20 are written:
    shoal's launcher starts the whole job again from its last (--max-restarts), it ends,
    and every sample of every epoch was recorded exactly once."""
    out = tmp_path / "run"
    res = train_losing(out, 0, "eval:2", "--strategy", "async-easgd", "--schedule", "constant",
                       "--checkpoint-every", "10", "--max-restarts", "1", timeout=240,
                       once=tmp_path / "killed")
    assert res.returncode == 0, res.stderr
    assert res.stray == []
    summary = json.loads((out / "summary.json").read_text())
    [restart] = summary["restarts"]
    assert summary["completed"] and restart["resumed_from_step"] in (20, 30)
    assert "server 0 (rank 0): process killed by signal 9; restarting from the checkpoint at " \
           f"step {restart['resumed_from_step']}" in res.stderr
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)


def test_a_checkpoint_counts_the_reported_samples_of_a_worker_it_does_not_resume():
    """Epoch reports not recorded yet when a checkpoint is written: a saved worker's of the
    epochs its state had ended stay in the file (recorded after the resume), later ones leave
    it (it does that work again). A lost worker's stay nowhere: under --elastic its work is
    not done again, so their samples count at once (the 8-run soak's summary lacked 55,292 of
    1,149,600 samples without this; without --elastic the lost worker is resumed from its
    own state and reports that work again)."""
    from types import SimpleNamespace

    from shoal.train.records import pending_reports

    def report(epoch, step, samples):
        return SimpleNamespace(epoch=epoch, step=step, sums=[0.0, 0.0, samples])

    def state(epoch, step):
        return SimpleNamespace(step=step, own={"progress": {"epoch": epoch}})

    epochs = {5: {0: report(5, 40, 100), 1: report(5, 44, 90), 2: report(5, 47, 120)},
              6: {1: report(6, 52, 95), 2: report(6, 55, 110)}}
    saved = {0: state(5, 45), 1: state(5, 50)}  # worker 2 was lost
    kept, gone = pending_reports(epochs, saved, elastic=True)
    assert kept == {5: {0: epochs[5][0], 1: epochs[5][1]}}  # worker 1's epoch 6: after its state
    assert gone == 120 + 110
    assert pending_reports(epochs, saved, elastic=False) == (kept, 0)


def test_a_state_saved_at_an_epochs_last_step_before_its_report_reports_it_again():
    """A worker saves its state at its epoch's last step, then reports the epoch, both at
    that step. Resumed from that state, it is in the epoch still and may be dealt more of it:
    it reports the epoch again, with those samples. Its first report does not stay in the
    file, or the records would take it if it arrived first (found in a fresh clone's suite:
    a restart's summary counted 117 samples fewer than the records held)."""
    from types import SimpleNamespace

    from shoal.train.records import pending_reports

    first = SimpleNamespace(epoch=1, step=30, sums=[0.0, 0.0, 479])
    saved = {1: SimpleNamespace(step=30, own={"progress": {"epoch": 0}})}
    assert pending_reports({1: {1: first}}, saved, elastic=True) == ({}, 0)
    past = {1: SimpleNamespace(step=30, own={"progress": {"epoch": 1}})}
    assert pending_reports({1: {1: first}}, past, elastic=True) == ({1: {1: first}}, 0)


def test_a_worker_back_past_the_recorded_epochs_is_not_waited_for_after_the_next_resume(
        tmp_path):
    """Worker 2 is lost in block 2, while the records are still at epoch 0 (it had run
    ahead): at the first --resume it is back in block 2 and reports no epoch before epoch 3,
    so epochs 1 and 2 are recorded from workers 0 and 1 alone. The checkpoint after that
    keeps where it started: after a second --resume epoch 1 is still not due from it (a
    soak's records waited for such a report to the end of the run: 430 epochs lost)."""
    from types import SimpleNamespace

    from shoal.train.membership.server.members import AsyncMembers

    cfg = TrainConfig(out=str(tmp_path), epochs=3, batch_size=4, seed=0)

    def members() -> AsyncMembers:
        c = SimpleNamespace(comm=SimpleNamespace(attempt_store=dist.HashStore()), cfg=cfg,
                            data=SimpleNamespace(train=range(100)), workers=3, servers=1,
                            live={0, 1, 2}, finals={}, recorder=SimpleNamespace(changes=None),
                            counted_of=None, followers=None)
        return AsyncMembers(c, None)

    def saved(m: AsyncMembers, positions: dict, recorded: int) -> dict:
        reports = {w: SimpleNamespace(own={"elastic": p}) for w, p in positions.items()}
        payload = {"progress": {"step": 40}, "ranks": [
            None if w not in positions else {"elastic": positions[w]} for w in range(3)],
            "coordinator": {"epoch": recorded,
                            "elastic": m.checkpoint([{"counted": {}}], reports)[0]}}
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)

    first = members()
    lost_in = first.dealer.schedules[2].start(2) + 3  # 3 samples into its block 2
    first.dealer.lost(2, {"counted": lost_in, "step": 30}, {0, 1}, lambda: "killed")
    first.c.live = {0, 1}
    one = saved(first, {0: {"epoch": 0, "read": 20, "at": 20},
                        1: {"epoch": 0, "read": 18, "at": 18}}, recorded=0)
    second = members()
    second.resume(one)
    assert second.first_epoch[2] == 2 and second.due(1) == {0, 1} and 2 in second.due(3)
    two = saved(second, {0: {"epoch": 0, "read": 30, "at": 30},
                         1: {"epoch": 0, "read": 29, "at": 29},
                         2: {"epoch": 2, "read": 3, "at": 3}}, recorded=0)
    third = members()
    third.resume(two)
    assert third.due(1) == {0, 1} and third.due(2) == {0, 1} and third.due(3) == {0, 1, 2}


def test_a_restart_after_a_loss_cuts_the_records_the_killed_attempt_wrote_past_its_checkpoint(
        tmp_path):
    """Worker 2 is killed (its rest dealt to workers 0 and 1), then server 0 at its third
    test of the center: the launcher starts the job again from its last checkpoint,
    worker 2 back with part of the others' rest. Workers 0 and 1 had recorded the samples
    they counted after that checkpoint; those are trained again, part of them now by worker
    2. Before, their files kept those lines (a resumed worker wrote only past its file's
    end): hundreds of samples recorded twice (found by hand: 362 of a 400-epoch run resumed
    from a periodic checkpoint; 1,985 after a restart). Each worker's file is now cut to its
    count in the checkpoint."""
    out = tmp_path / "run"
    res = train_losing(out, 3, "train:10", "--strategy", "async-easgd", "--schedule",
                       "constant", "--checkpoint-every", "10", "--max-restarts", "1",
                       model="tests.fixtures_models:dies_at", once=tmp_path / "once",
                       more_env={"SHOAL_TEST_DIE_AT": "eval:3",
                                 "SHOAL_TEST_DIE_UNLESS": str(out / "checkpoint.pt")})
    assert res.returncode == 0, res.stderr
    assert "server 0 (rank 0): process killed by signal 9; restarting from the checkpoint" \
        in res.stderr and "worker 2 is back at --resume" in res.stderr, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and len(summary["restarts"]) == 1
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)
