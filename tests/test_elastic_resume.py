"""Resuming after a membership change (--elastic): the checkpoint keeps the epoch's rest as
it was dealt anew, so the resumed run trains every sample once, on the checkpoint's number
of workers or, for sync (replicas in sync), on another; --max-restarts after a change
starts the periodic strategies' workers left again (each resumes its own state) and all
of sync's. Real processes, Gloo on CPU."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import EPOCHS, TRAIN_ROWS, assert_each_sample_once, shoal, step_workers, train_losing

pytestmark = pytest.mark.timeout(600)


def test_a_checkpoint_written_after_a_loss_resumes_on_as_many_workers_and_on_more(tmp_path):
    # 3 workers x 16 rows (30 steps an epoch); worker 2 killed at step 10, so the two left
    # go on with the epoch's rest dealt anew (32 rows a step); stopped at step 20, inside it.
    out = tmp_path / "run"
    res = train_losing(out, 2, "train:10", "--strategy", "sync", "--stop-at-step", "20")
    assert res.returncode == 0, res.stderr
    assert "worker 2 left at step 9" in res.stderr
    more = tmp_path / "more"
    shutil.copytree(out, more)
    for where, workers in ((out, 2), (more, 3)):
        res = shoal("train", "--out", str(where), "--progress", "plain", "--model",
                    "tests.fixtures_models:killed_at", "--dataset", "digits", "--workers",
                    str(workers), "--epochs", str(EPOCHS), "--strategy", "sync", "--elastic",
                    "--record-samples", "--resume", timeout=300)
        assert res.returncode == 0, res.stderr
        # before: on 2 the resumed run read the epoch's own plan from step 20, training 432
        # samples twice; on 3 it was refused (another global batch)
        assert_each_sample_once(where, EPOCHS, TRAIN_ROWS)
        summary = json.loads((where / "summary.json").read_text())
        changes = summary["membership_changes"]
        assert changes[0]["left"] == [2] and changes[0]["step"] == 9
        assert summary["workers"] == workers == max(step_workers(where).items())[1]
    assert changes[1] == {"step": 20, "epoch": 1, "joined": [2],
                          "why": {"2": "started at --resume"}, "workers": 3,
                          "samples_dealt_again": 1437 - 9 * 48 - 11 * 32}
    assert "shoal: resumed on 3 workers (the checkpoint's run had 2)" in res.stderr


# local-sgd: the job is lost in epoch 2 and restarts from epoch 1's end, where the plan of
# epoch 1's rest is done (the next epoch is dealt afresh); sync: lost at step 30 and
# restarted from its checkpoint at step 20, inside the epoch's rest dealt anew.
@pytest.mark.parametrize("strategy, die, flags, again", [
    ("local-sgd", "train:50", [], 2), ("sync", "train:30", ["--checkpoint-every", "20"], 3)])
def test_max_restarts_after_a_loss_goes_on_with_every_sample_once(tmp_path, strategy, die,
                                                                  flags, again):
    # worker 2 killed at step 10 (once); every other worker at its forward `die`, so the job
    # is lost and restarts from its checkpoint: local-sgd on the 2 workers the checkpoint
    # holds, sync on all 3.
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
