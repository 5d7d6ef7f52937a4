"""The strategies through `shoal train`: they record what they sent (sync's gradients too),
the low-communication ones learn, and a stopped run resumes exactly (every worker's own
model, the center, outer momentum)."""

import pytest
import torch

from shoal.cli import main

from conftest import one_error_line, train_together

COMMON = ["--model", "lenet5", "--dataset", "digits", "--workers", "2", "--epochs", "10"]
STRATEGIES = ["local-sgd", "easgd", "eamsgd", "diloco"]


def rank_models(path):
    ranks = torch.load(path, map_location="cpu", weights_only=True)["ranks"]
    return [r["model"] for r in ranks]


#: sync's runs: flags, bytes a gradient value takes, extra bytes a step (from the second).
SYNC_RUNS = {
    "plain": ([], 4, 0),  # DDP's own all-reduce, no hook: float32 gradients
    "fp16": (["--compress", "fp16"], 2, 0),  # shoal's fp16 hook: half as many bytes
    "split-wait": (["--split-wait"], 4, 8),  # and one float64 a step to split the wait
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run the tests below read (a 10-epoch run per strategy, sync's 1-epoch runs, an
    EASGD run stopped at step 3), all of 2 workers, made once in one set of worker processes:
    name -> (its --out, its summary)."""
    flags = {s: [*COMMON, "--strategy", s, "--tau", "4"] for s in STRATEGIES}
    flags.update({name: ["--model", "mlp", "--dataset", "digits", "--workers", "2", "--epochs", "1",
                         "--strategy", "sync", *options]
                  for name, (options, _, _) in SYNC_RUNS.items()})
    flags["stopped"] = ["--strategy", "easgd", "--workers", "2", "--epochs", "1",
                        "--stop-at-step", "3"]  # with --tau 4, the default
    dirs = {name: tmp_path_factory.mktemp(name) for name in flags}
    summaries = train_together({dirs[name]: f for name, f in flags.items()}, workers=2)
    return {name: (dirs[name], summaries[dirs[name]]) for name in flags}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_learns_digits(runs, strategy):
    _, summary = runs[strategy]
    assert summary["strategy"] == strategy and summary["completed"]
    assert summary["test_accuracy"] >= 0.93, summary["test_accuracy"]
    # One packed message of all parameters every 4 steps of 32 samples (16 a worker), from
    # each worker; a little more for the epoch ends.
    params_bytes = 4 * summary["parameters"]
    assert summary["bytes_per_sample"] == pytest.approx(2 * params_bytes / (4 * 32), rel=0.15)
    assert 0 < summary["comm_fraction"] < 1


@pytest.mark.parametrize("run", SYNC_RUNS)
def test_sync_counts_the_gradients_it_sends(runs, run):
    _, bytes_per_value, extra_per_step = SYNC_RUNS[run]
    _, summary = runs[run]
    steps, workers = summary["steps"], 2
    grads = workers * steps * bytes_per_value * summary["parameters"]
    assert summary["bytes_sent"] == grads + workers * (steps - 1) * extra_per_step


@pytest.mark.parametrize("args, expected", [
    (["--strategy", "local-sgd", "--tau", "0"], "--tau must be at least 1, got 0"),
    (["--strategy", "easgd", "--alpha", "1.5"], "--alpha must be in [0, 1], got 1.5"),
    (["--strategy", "easgd", "--alpha", "0.5", "--workers", "8"],
     "--alpha 0.5 with 8 workers gives beta = 4.0; the center update needs alpha * workers <= 2"),
    (["--strategy", "eamsgd", "--momentum", "0"], "eamsgd needs --momentum > 0"),
    (["--strategy", "eamsgd", "--optimizer", "adam"], "eamsgd takes local steps with SGD, not Adam"),
    (["--strategy", "diloco", "--outer-momentum", "1"], "--outer-momentum must be in [0, 1)"),
    (["--strategy", "sync", "--tau", "4"], "strategy sync does not take --tau"),
])
def test_bad_strategy_options_are_one_line(tmp_path, capsys, args, expected):
    # In-process: the command's code path, minus an interpreter start-up.
    code = main(["train", "--out", str(tmp_path / "run"), "--workers", "2", "--epochs", "1", *args])
    assert code == 2
    line = one_error_line(capsys.readouterr().err)
    assert expected in line and "rank 0:" not in line, "caught before any worker started"
    assert not (tmp_path / "run").exists()


def test_resume_with_other_strategy_options_is_refused(runs, capsys):
    stopped, summary = runs["stopped"]
    assert summary["steps"] == 3 and not summary["completed"]
    code = main(["train", "--out", str(stopped), "--strategy", "easgd", "--workers", "2",
                 "--epochs", "1", "--resume", "--tau", "8"])
    assert code == 2
    line = one_error_line(capsys.readouterr().err)
    assert "checkpoint was made with --tau 4, this run has --tau 8" in line
