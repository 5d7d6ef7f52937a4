"""Data parallelism must not change the arithmetic: N workers == 1 process, same global batch."""

import pytest

from conftest import checkpoint_params, max_param_diff, train_here, train_together

COMMON = ["--model", "lenet5", "--dataset", "digits", "--epochs", "1", "--stop-at-step", "20"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    train_here(out, *COMMON, "--global-batch-size", "24", "--workers", "1")
    return checkpoint_params(out / "checkpoint.pt")


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """The 2-worker runs of global batch 24 and 25, made in one set of worker processes."""
    runs = {tmp_path_factory.mktemp(f"two-{batch}"): [*COMMON, "--global-batch-size", str(batch),
                                                      "--workers", "2"] for batch in (24, 25)}
    return dict(zip((24, 25), train_together(runs, workers=2).items(), strict=True))


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_equal_one_process(tmp_path, single, two_workers, workers):
    if workers == 2:
        out, summary = two_workers[24]
    else:
        out = tmp_path
        summary = train_here(out, *COMMON, "--global-batch-size", "24", "--workers", str(workers))
    assert summary["workers"] == workers and summary["steps"] == 20
    assert max_param_diff(checkpoint_params(out / "checkpoint.pt"), single) < 1e-5


def test_uneven_shares_are_weighted_exactly(tmp_path, two_workers):
    """25 samples on 2 workers (13 + 12): each rank's loss is weighted by its share."""
    train_here(tmp_path / "one", *COMMON, "--global-batch-size", "25", "--workers", "1")
    two, _ = two_workers[25]
    diff = max_param_diff(checkpoint_params(tmp_path / "one" / "checkpoint.pt"),
                          checkpoint_params(two / "checkpoint.pt"))
    assert diff < 1e-5
