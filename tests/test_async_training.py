"""The asynchronous strategies through `shoal train`, with real server and worker processes:
each learns digits, --servers 2 shards the center, the staleness bound holds, a killed worker
is lost without losing the run, a killed server ends it cleanly and --resume finishes it."""

import json

import pytest
import torch

from shoal.cli import main

from conftest import one_error_line, shoal, shoal_env, train_here

COMMON = ["--model", "mlp", "--dataset", "digits", "--workers", "2", "--epochs", "4"]
STRATEGY_ARGS = {
    "async-sgd": [],
    "async-msgd": ["--momentum", "0.5"],
    "async-easgd": ["--tau", "4"],
    "async-measgd": ["--tau", "4", "--momentum", "0.5"],
    "hogwild": ["--momentum", "0"],  # the paper's update
    "hogwild-easgd": ["--tau", "4"],
}


def epoch_records(out):
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r.get("event") == "epoch"]


@pytest.mark.parametrize("strategy", list(STRATEGY_ARGS))
def test_learns_digits(tmp_path, strategy):
    summary = train_here(tmp_path, *COMMON, "--strategy", strategy, *STRATEGY_ARGS[strategy])
    assert summary["strategy"] == strategy and summary["completed"] and not summary["degraded"]
    assert summary["test_accuracy"] >= 0.93, summary["test_accuracy"]
    assert summary["workers"] == 2 and summary["servers"] == 1
    assert [r["epoch"] for r in epoch_records(tmp_path)] == [1, 2, 3, 4]
    saved = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert len(saved["ranks"]) == 2 and len(saved["servers"]) == 1
    if strategy != "hogwild":  # every exchange went through the server and was counted
        assert summary["staleness"]["updates"] > 0 and summary["bytes_sent"] > 0
        assert 0 < summary["comm_fraction"] < 1


def test_two_servers_shard_the_center_within_the_staleness_bound(tmp_path):
    summary = train_here(tmp_path, "--model", "mlp", "--dataset", "digits", "--workers", "3",
                         "--epochs", "4", "--strategy", "async-sgd", "--servers", "2",
                         "--max-staleness", "2")
    assert summary["servers"] == 2 and summary["test_accuracy"] >= 0.93
    saved = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=True)
    shards = [s["center"] for s in saved["servers"]]
    assert len(shards) == 2 and sum(s.numel() for s in shards) == summary["parameters"]
    assert abs(shards[0].numel() - shards[1].numel()) <= 1  # contiguous halves
    hist = {int(k): v for k, v in summary["staleness"]["histogram"].items()}
    assert sum(hist.values()) == summary["staleness"]["updates"] > 0
    assert max(hist) <= 2, hist  # no update applied staler than --max-staleness


@pytest.mark.parametrize("args, expected", [
    (["--strategy", "async-sgd", "--workers", "3", "--max-staleness", "1"],
     "--max-staleness 1"),
    (["--strategy", "sync", "--servers", "2"], "strategy sync does not take --servers"),
    (["--strategy", "async-sgd", "--servers", "0"], "--servers"),
    (["--strategy", "async-sgd", "--order", "round-robin"], "--order"),
])
def test_bad_async_options_are_one_line(tmp_path, capsys, args, expected):
    code = main(["train", "--out", str(tmp_path / "run"), "--workers", "2", "--epochs", "1", *args])
    assert code == 2
    assert expected in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def _killed(rank, at):
    env = shoal_env()
    env.update(SHOAL_TEST_KILL_RANK=str(rank), SHOAL_TEST_KILL_AT=at)
    return env


def test_a_killed_worker_is_lost_not_the_run(tmp_path):
    # Rank 2 is worker 1 (rank 0 is the server): it kills itself (SIGKILL) at its 60th
    # step, in epoch 2 (45 steps an epoch).
    res = shoal("train", "--out", str(tmp_path), "--progress", "plain", "--model",
                "tests.fixtures_models:killed_at", "--dataset", "digits", "--workers", "2",
                "--epochs", "3", "--strategy", "async-easgd", "--tau", "2",
                env=_killed(2, "train:60"), timeout=120)
    assert res.returncode == 3, res.stderr
    assert "completed without worker 1" in res.stderr and "Traceback" not in res.stderr
    assert res.stray == []
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["completed"] and summary["degraded"]
    [lost] = summary["lost_workers"]
    assert lost["worker"] == 1 and lost["exit_status"] == "killed by signal 9"
    assert 45 < lost["step"] < 60  # its last exchange reached the server before step 60
    # 1437 training rows, global batch 32: worker 1 reads 44 x 16 + 14 = 718 an epoch.
    assert lost["samples_trained"] + lost["samples_not_trained"] == 3 * 718
    assert lost["samples_trained"] == 718 + 16 * (lost["step"] - 45)  # epoch 1, then 16 a step
    assert [r["epoch"] for r in epoch_records(tmp_path)] == [1, 2, 3]
    saved = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert saved["progress"]["epoch"] == 3


def test_a_killed_server_ends_the_job_and_resume_finishes_it(tmp_path):
    # The server (rank 0) kills itself at its evaluation of epoch 2 (the first forward is
    # build_model's check, then two batches of 256 test rows an evaluation), after epoch
    # 1's checkpoint.
    args = ["--model", "tests.fixtures_models:killed_at", "--dataset", "digits", "--workers", "2",
            "--epochs", "4", "--strategy", "async-sgd"]
    res = shoal("train", "--out", str(tmp_path), "--progress", "plain", *args,
                env=_killed(0, "eval:4"), timeout=120)
    assert res.returncode == 1
    line = one_error_line(res.stderr)
    assert "rank 0" in line and "signal 9" in line, line
    assert res.stray == []
    saved = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert saved["progress"]["epoch"] == 1  # the last checkpoint, intact
    # The resume runs in this process (the command's own code path, minus an interpreter
    # start-up); its workers are real processes all the same.
    summary = train_here(tmp_path, *args, "--resume")
    assert summary["completed"] and summary["steps"] == 4 * 45
    assert [r["epoch"] for r in epoch_records(tmp_path)] == [1, 2, 3, 4]
    assert summary["test_accuracy"] > 0.85
