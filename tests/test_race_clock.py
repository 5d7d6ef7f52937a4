"""Time to accuracy compares like with like: every strategy's clock starts when all its
workers can train, and an asynchronous run tests its center at the workers' sample counts.

A race (``shoal bench --epochs``, :func:`shoal.sweep.measure.measure_race`) reads each run's
``elapsed_s`` and test accuracy. An asynchronous run's clock used to start with server 0,
before a slow worker had even started, and its center was tested only once the slowest
worker finished an epoch: the straggler's start-up and pace were in its time to accuracy.
"""

import json

import pytest

from shoal.sweep.measure import measure_race

from conftest import train_here

SLOW = 5.0  # seconds one worker's start-up takes: several times the run's training time
DIGITS = ["--dataset", "digits", "--workers", "2", "--epochs", "1"]


def records(out, event):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r["event"] == event]


@pytest.mark.parametrize("strategy, slow_rank", [("sync", "1"), ("async-sgd", "2")])
def test_the_clock_starts_when_every_worker_can_train(tmp_path, monkeypatch, strategy,
                                                      slow_rank):
    """Worker 1 starts SLOW seconds late: no record's time, nor the training time, holds it.
    (An asynchronous run's server 0 counted it, from its own start; sync's ranks already met
    before its clock, in DDP's first broadcast, and now meet at a barrier of their own.)"""
    monkeypatch.setenv("SHOAL_TEST_SLOW_RANK", slow_rank)
    monkeypatch.setenv("SHOAL_TEST_SLOW_START", str(SLOW))
    summary = train_here(tmp_path, *DIGITS, "--strategy", strategy, "--model",
                         "tests.fixtures_models:slow_start")
    times = [r["elapsed_s"] for r in records(tmp_path, "epoch") + records(tmp_path, "step")]
    assert times and max(times) < SLOW, times
    assert summary["train_time_s"] < SLOW, summary["train_time_s"]


@pytest.mark.parametrize("strategy", ["async-sgd", "hogwild", "async-easgd"])
def test_an_asynchronous_center_is_tested_by_the_workers_samples(tmp_path, strategy):
    """--eval-every-steps 10: the center is tested each time the workers' own samples add
    up to 10 more global batches (320 samples), inside the epoch, not at its end only; the
    race's curve holds those tests, in time order."""
    train_here(tmp_path, *DIGITS, "--strategy", strategy, "--eval-every-steps", "10")
    evals = records(tmp_path, "eval")
    samples = [r["samples"] for r in evals]
    assert len(evals) >= 3 and samples == sorted(samples), samples
    # Each test at the first count past its multiple of 320 (a worker reports every 5 of
    # its steps, 80 samples), before the epoch's 1437 samples were done.
    assert [s // 320 for s in samples] == list(range(1, len(samples) + 1)), samples
    assert all(s % 320 < 160 for s in samples) and samples[0] < 1437, samples
    assert all(r["step"] == r["samples"] // 32 and 0 <= r["test_accuracy"] <= 1 for r in evals)
    race = measure_race(tmp_path, 0.5)
    times = [t for t, _ in race["curve"]]
    assert len(race["curve"]) == len(evals) + 1 and times == sorted(times)
    epoch = records(tmp_path, "epoch")[-1]
    assert (epoch["elapsed_s"], epoch["test_accuracy"]) in race["curve"]
