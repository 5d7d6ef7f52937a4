"""Resuming after a membership change (--elastic): the checkpoint keeps the epoch's rest as
it was dealt anew, so the resumed run trains every sample once, on the checkpoint's number
of workers or, for sync (replicas in sync), on another; --max-restarts after a change
starts the periodic strategies' workers left again (each resumes its own state) and all
of sync's. Real processes, Gloo on CPU."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import (
    EPOCHS,
    TRAIN_ROWS,
    assert_each_sample_once,
    shoal,
    shoal_env,
    step_workers,
    train_here,
    train_losing,
)

pytestmark = pytest.mark.timeout(600)


def _resume(out, workers: int, epochs: int, strategy: str = "easgd"):
    """The run in ``out`` resumed, in this process (no one is killed this time); it must
    succeed."""
    train_here(out, "--model", "tests.fixtures_models:killed_at", "--dataset", "digits",
               "--workers", str(workers), "--epochs", str(epochs), "--strategy", strategy,
               "--tau", "4", "--elastic", "--record-samples", "--resume")


def test_a_checkpoint_written_after_a_loss_inside_a_round_resumes_each_sample_once(tmp_path):
    # 3 workers x 16 rows (30 steps an epoch), EASGD every 4 steps; worker 2 killed in step
    # 10, so the two left go on with the epoch's rest dealt anew (32 rows a step); stopped
    # at step 22, two steps into a round (their work meets at step 24).
    out = tmp_path / "run"
    res = train_losing(out, 2, "train:10", "--strategy", "easgd", "--tau", "4",
                       "--stop-at-step", "22")
    assert res.returncode == 0, res.stderr
    assert "worker 2 left at step" in res.stderr
    # each worker holds its own model: on as many (on more, the others join:
    # test_elastic_join.py's test_resumed_on_more_workers_than_its_checkpoint_holds_the_others_join)
    _resume(out, 2, EPOCHS)
    # before: the resumed run read the epoch's own plan from step 22 (samples trained twice)
    # and the two steps of the round the checkpoint cut were never recorded
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)
    summary = json.loads((out / "summary.json").read_text())
    [change] = summary["membership_changes"]
    assert change["left"] == [2] and summary["workers"] == 2


def test_a_job_down_to_one_worker_resumes_on_one_and_records_each_sample_once(tmp_path):
    """2 workers, worker 1 killed; the one left is stopped inside a round, and its
    checkpoint resumes on 1 worker: a job of one worker has no meetings, and before, its
    ``--record-samples`` wrote nothing at all (every sample after the checkpoint missing
    from the records, the run trained them)."""
    out = tmp_path / "run"
    res = train_losing(out, 1, "train:10", "--strategy", "diloco", "--tau", "4",
                       "--stop-at-step", "22", workers=2)
    assert res.returncode == 0 and "worker 1 left at step" in res.stderr, res.stderr
    _resume(out, 1, EPOCHS, "diloco")
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)


# local-sgd: lost at step 30 and restarted on the 2 workers its checkpoint at step 20 holds
# (inside the epoch's rest dealt anew, inside a round); sync: lost in epoch 2 and restarted
# on all 3 from epoch 1's end, where the plan of epoch 1's rest is done (the next epoch is
# dealt afresh).
@pytest.mark.parametrize("strategy, die, flags, again", [
    ("local-sgd", "train:30", ["--checkpoint-every", "20"], 2), ("sync", "train:50", [], 3)])
def test_max_restarts_after_a_loss_goes_on_with_every_sample_once(tmp_path, strategy, die,
                                                                  flags, again):
    # worker 2 killed at step 10 (once); every other worker at its forward `die`, so the job
    # is lost and restarts from its checkpoint.
    out = tmp_path / "run"
    res = train_losing(out, 2, "train:10", "--strategy", strategy, "--max-restarts", "1",
                       *flags, model="tests.fixtures_models:dies_at", once=tmp_path / "once",
                       more_env={"SHOAL_TEST_DIE_AT": die,
                                 "SHOAL_TEST_DIE_UNLESS": str(out / "checkpoint.pt")})
    # before: "checkpoint holds 2 workers' state; strategy local-sgd must resume on as many,
    # not 3" (sync: another global batch), and the job failed
    assert res.returncode == 0, res.stderr
    assert "restarting from the checkpoint at step" in res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"] == again and len(summary["restarts"]) == 1
    assert summary["membership_changes"][0]["left"] == [2]
    assert max(step_workers(out).items())[1] == again
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)  # the lines after step 20 were cut


def test_drifting_workers_resume_on_more_or_fewer_from_an_epochs_end(tmp_path):
    """EASGD's workers each hold their own model: from the checkpoint at an epoch's end they
    resume on more (a new worker takes worker 0's state, as a joiner does) or fewer (a
    worker not started leaves its work in the center), every sample once."""
    out = tmp_path / "run"
    train_here(out, "--model", "tests.fixtures_models:killed_at", "--dataset", "digits",
               "--workers", "3", "--epochs", "1", "--strategy", "easgd", "--tau", "4",
               "--elastic", "--record-samples")  # nobody is killed; the first epoch, ended
    fewer = tmp_path / "fewer"
    shutil.copytree(out, fewer)
    for where, workers in ((out, 4), (fewer, 2)):
        _resume(where, workers, EPOCHS)
        assert_each_sample_once(where, EPOCHS, TRAIN_ROWS)
        summary = json.loads((where / "summary.json").read_text())
        [change] = summary["membership_changes"]
        assert change["step"] == 30 and change["workers"] == workers == summary["workers"]
        assert change.get("joined" if workers > 3 else "left") == [min(3, workers)]
        assert summary["test_accuracy"] > 0.8


@pytest.mark.parametrize("strategy, options, inside, starts", [
    ("sync", {}, True, 3), ("sync", {"compress": "powersgd"}, False, 2),
    ("local-sgd", {}, True, 2), ("local-sgd", {}, False, 3), ("diloco", {}, True, 2)])
def test_a_restart_starts_the_workers_the_checkpoint_can_go_on_on(tmp_path, strategy, options,
                                                                   inside, starts):
    """After a loss, a checkpoint of 2 workers of a 3-worker job: sync goes on on all 3 but
    with PowerSGD (each worker's error feedback), the periodic strategies on all 3 from an
    epoch's end and on the 2 inside an epoch."""
    from shoal.config import TrainConfig
    from shoal.train.checkpoint import Saved
    from shoal.train.job import _restarted, job_topology

    cfg = TrainConfig(model="mlp", dataset="digits", workers=3, strategy=strategy,
                      strategy_options=options, out=str(tmp_path)).validate()
    assert _restarted(cfg, job_topology(cfg, 3), Saved(20, 2, inside)).workers == starts


def test_a_joiner_started_at_resume_that_the_job_ends_before_is_said_and_stopped(tmp_path):
    """``--resume --workers 3`` of a hogwild checkpoint of 2 workers whose rest (a second of
    training) ends before the joiner the launcher started is ready (its model takes 60 s to
    build): the job ends 0 on its 2, the launcher says in one line that the joiner did not
    join, stops it at once (not waiting out its connection's timeouts) and leaves no process
    behind."""
    out = tmp_path / "run"
    args = ["--model", "tests.fixtures_models:mlp_late_in", "--dataset", "digits",
            "--strategy", "hogwild", "--elastic", "--epochs", "2"]
    train_here(out, *args, "--workers", "2", "--stop-at-step", "40")
    res = shoal("train", "--out", str(out), "--progress", "plain", *args, "--workers", "3",
                "--resume", timeout=120,
                env={**shoal_env(), "SHOAL_TEST_LATE_IN": "shoal worker 2"})
    assert res.returncode == 0, res.stderr
    assert "shoal: a worker started to join at --resume did not: the job ended before it " \
        "joined" in res.stderr.splitlines()
    assert res.stray == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and summary["workers"] == 2
    assert not summary.get("membership_changes")


@pytest.mark.parametrize("strategy, options", [
    ("async-easgd", []), ("local-sgd", ["--tau", "4"]),
    ("sync", ["--compress", "powersgd", "--powersgd-warmup", "2"])])
def test_resumed_on_fewer_workers_than_its_checkpoint_holds_the_others_leave(
        tmp_path, capsys, strategy, options):
    """A checkpoint that only its own workers can go on from (an asynchronous job's, one of
    local-sgd inside an epoch, PowerSGD's), resumed with --workers 1 of its 3: the 3 start
    again, workers 1 and 2 leave at their first meeting (their work counted) and the one
    left is dealt their rest, as a lost worker's. Before: refused in one line ("checkpoint
    holds 3 workers' state; ... resumes on as many"). Every sample once, the leaves in the
    summary. (A resume stopped again early, by --stop-at-step, may stop before the leavers'
    first meeting: they are then in its checkpoint, and leave at the next resume.)"""
    out = tmp_path / "run"
    flags = ["--model", "mlp", "--dataset", "digits", "--epochs", str(EPOCHS), "--strategy",
             strategy, *options, "--elastic", "--record-samples"]
    train_here(out, *flags, "--workers", "3", "--stop-at-step", "22", "--checkpoint-every",
               "11")
    summary = train_here(out, *flags, "--workers", "1", "--resume")
    err = capsys.readouterr().err
    assert "3 start again and 2 of them leave at their first meeting, the others dealt " \
        "their rest" in err, err
    gone = {int(w): why for c in summary["membership_changes"]
            for w, why in c.get("why", {}).items() if int(w) in c.get("left", [])}
    assert sorted(gone) == [1, 2] and set(gone.values()) == {
        f"worker {w} left as the --resume on fewer workers asked" for w in (1, 2)}
    assert summary["completed"] and summary["workers"] == 1
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)
    from shoal.train.checkpoint import saved_checkpoint  # the next resume's joins come after

    assert saved_checkpoint(out / "checkpoint.pt").changes == len(summary["membership_changes"])


def test_only_the_joins_after_the_checkpoints_changes_count_as_this_runs_joiners():
    """A synchronous job numbers its workers anew at a resume: a joiner started now may have
    the id an earlier run's joiner had (listed in the checkpoint's changes, which the
    summary repeats first). The launcher waits only for the joiners that joined this run;
    before, an earlier run's join of id 3 made it wait 30 s for a joiner 3 that never did."""
    from shoal.train.resize import joined_since

    earlier = [{"step": 10, "joined": [3], "workers": 4}, {"step": 20, "left": [3]}]
    summary = {"membership_changes": [*earlier, {"step": 30, "resumed": True},
                                      {"step": 41, "joined": [4], "workers": 4}]}
    assert joined_since(summary, len(earlier)) == {4}
    assert joined_since(summary, 0) == {3, 4}
    assert joined_since(None, 0) == set()
