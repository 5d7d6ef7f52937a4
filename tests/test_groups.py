"""Compute groups (Omnivore) with real processes, and --momentum auto.

The in-process reference (one worker per group, against the paper's update in float64) is
in test_async_reference.py; here groups of several workers meet through their own process
groups, beside a real parameter server.
"""

import json

import pytest

from shoal.config import TrainConfig
from shoal.errors import ShoalError
from shoal.strategies.groups import ComputeGroups, GroupOptions, group_bounds
from shoal.train.optim import resolve_momentum

from conftest import checkpoint_params, max_param_diff, one_error_line, train_here

COMMON = ["--model", "mlp", "--dataset", "digits", "--epochs", "2", "--schedule", "constant"]


def test_one_group_is_sync(tmp_path):
    """g = 1: every worker in one group, the server's momentum step is SGD's: the run ends
    where sync (DDP and torch.optim.SGD) ends."""
    sync = train_here(tmp_path / "sync", *COMMON, "--workers", "2", "--strategy", "sync")
    one = train_here(tmp_path / "one", *COMMON, "--workers", "2", "--strategy", "groups",
                     "--groups", "1")
    diff = max_param_diff(checkpoint_params(tmp_path / "sync" / "checkpoint.pt"),
                          checkpoint_params(tmp_path / "one" / "checkpoint.pt"))
    assert diff < 1e-6, diff
    assert one["test_accuracy"] == pytest.approx(sync["test_accuracy"])
    # One push per global batch, by the group's leader: never stale.
    assert one["staleness"]["histogram"] == {"0": one["steps"]}


def test_two_groups_of_two_train_with_auto_momentum(tmp_path):
    out = tmp_path / "run"
    summary = train_here(out, "--model", "mlp", "--dataset", "digits", "--epochs", "4",
                         "--workers", "4", "--strategy", "groups", "--groups", "2",
                         "--momentum", "auto", "--lr", "0.1")
    assert summary["test_accuracy"] >= 0.93, summary["test_accuracy"]
    # Two groups push, once per global batch each: their steps, and no more.
    steps_per_epoch = -(-1437 // (16 * 4))
    assert summary["staleness"]["updates"] == 2 * 4 * steps_per_epoch
    assert summary["staleness"]["max"] >= 1  # the groups do not wait for each other
    auto = {"target": 0.9, "groups": 2, "implicit": 0.5, "explicit": 0.4}
    assert summary["momentum_auto"] == auto
    config = json.loads((out / "config.json").read_text())
    assert config["momentum"] == 0.4 and config["momentum_auto"] == auto


def test_bad_groups_are_one_line(tmp_path, capsys):
    from shoal.cli import main

    for args, message in ((["--groups", "3", "--workers", "2"], "a group needs a worker"),
                          (["--groups", "0"], "--groups must be at least 1"),
                          (["--groups", "3", "--workers", "4", "--max-staleness", "1"],
                           "must be at least 2 (groups - 1)"),
                          (["--momentum", "auto:1"], "--momentum must be a number in [0, 1)"),
                          (["--optimizer", "adam"], "the optimizer must be SGD")):
        assert main(["train", "--strategy", "groups", "--out", str(tmp_path / "r"), *args]) == 2
        assert message in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "r").exists()  # refused before any process started


def test_group_bounds_and_leaders():
    assert group_bounds(5, 2) == [(0, 3), (3, 5)]
    assert group_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    admission = ComputeGroups.admission(GroupOptions(groups=2, max_staleness=1), 5)
    assert admission.pushers == (0, 3) and admission.max_staleness == 1  # the leaders push
    assert ComputeGroups.asynchronous_groups(GroupOptions(groups=3), 6) == 3


@pytest.mark.parametrize("strategy, options, workers, explicit", [
    ("sync", {}, 4, 0.9),                  # synchronous: no implicit momentum
    ("easgd", {}, 4, 0.9),
    ("async-msgd", {}, 4, 0.15),           # 4 asynchronous workers: 1 - 1/4 = 0.75
    ("async-sgd", {}, 4, 0.0),             # its server applies no momentum
    ("hogwild", {}, 2, 0.4),
    ("groups", {"groups": 2}, 4, 0.4),
    ("groups", {"groups": 4}, 4, 0.15),
])
def test_momentum_auto_subtracts_the_implicit_momentum(strategy, options, workers, explicit):
    cfg = TrainConfig(strategy=strategy, strategy_options=options, momentum="auto").validate()
    resolved = resolve_momentum(cfg, workers)
    assert resolved.momentum == pytest.approx(explicit)
    assert resolved.momentum_auto["explicit"] == resolved.momentum
    low = resolve_momentum(TrainConfig(strategy="async-sgd", momentum="auto:0.5").validate(), 4)
    assert low.momentum == 0.0 and low.momentum_auto["target"] == 0.5  # never negative
    assert resolve_momentum(TrainConfig(momentum=0.3).validate(), 4).momentum == 0.3
    with pytest.raises(ShoalError, match="auto or auto:T"):
        TrainConfig(momentum="fast").validate()
