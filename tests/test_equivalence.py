"""Data parallelism must not change the arithmetic: N workers == 1 process, same global batch."""

import pytest

from conftest import checkpoint_params, max_param_diff, train_here

COMMON = ["--model", "lenet5", "--dataset", "digits", "--epochs", "1", "--stop-at-step", "20"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    train_here(out, *COMMON, "--global-batch-size", "24", "--workers", "1")
    return checkpoint_params(out / "checkpoint.pt")


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_equal_one_process(tmp_path, single, workers):
    summary = train_here(tmp_path, *COMMON, "--global-batch-size", "24", "--workers", str(workers))
    assert summary["workers"] == workers and summary["steps"] == 20
    assert max_param_diff(checkpoint_params(tmp_path / "checkpoint.pt"), single) < 1e-5


def test_uneven_shares_are_weighted_exactly(tmp_path):
    """25 samples on 2 workers (13 + 12): each rank's loss is weighted by its share."""
    train_here(tmp_path / "one", *COMMON, "--global-batch-size", "25", "--workers", "1")
    train_here(tmp_path / "two", *COMMON, "--global-batch-size", "25", "--workers", "2")
    diff = max_param_diff(checkpoint_params(tmp_path / "one" / "checkpoint.pt"),
                          checkpoint_params(tmp_path / "two" / "checkpoint.pt"))
    assert diff < 1e-5
