"""--fragments, --overlap-steps and --outer-precision through `shoal train`: bad values are one
line before any worker starts, the strategies learn with them, the bytes shrink as the
precision says, and a run stopped with an exchange in flight resumes exactly."""

import pytest

from shoal.cli import main

from conftest import checkpoint_params, max_param_diff, one_error_line, train_here, train_together

COMMON = ["--model", "mlp", "--dataset", "digits", "--workers", "2", "--batch-size", "32"]
STREAM = ["--tau", "4", "--fragments", "2", "--overlap-steps", "1"]
#: run -> flags; trained together in one set of workers
RUNS = {
    "diloco-fp32": ["--strategy", "diloco", "--epochs", "3", "--tau", "4"],
    "diloco-int4-stream": ["--strategy", "diloco", "--epochs", "3", *STREAM,
                           "--outer-precision", "int4"],
    "local-sgd-int8-stream": ["--strategy", "local-sgd", "--epochs", "3", *STREAM,
                              "--outer-precision", "int8"],
    "eamsgd-bf16-stream": ["--strategy", "eamsgd", "--epochs", "3", *STREAM,
                           "--outer-precision", "bf16"],
    "easgd-fp8": ["--strategy", "easgd", "--epochs", "3", "--outer-precision", "fp8"],
}
RESUMED = ["--strategy", "diloco", "--epochs", "2", *STREAM, "--outer-precision", "int4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    dirs = {name: tmp_path_factory.mktemp(name) for name in RUNS}
    summaries = train_together({dirs[n]: [*COMMON, *f] for n, f in RUNS.items()}, workers=2)
    return {name: summaries[dirs[name]] for name in RUNS}


@pytest.mark.parametrize("name", list(RUNS))
def test_learns_digits(runs, name):
    assert runs[name]["completed"] and runs[name]["test_accuracy"] >= 0.9, runs[name]


def test_int4_sends_seven_times_fewer_bytes(runs):
    """The exchanges' bytes (all but the start's float32 broadcast of the model, from each
    worker), and the most bytes a worker has in flight: a fragment's, 4 bits a value."""
    plain, small = runs["diloco-fp32"], runs["diloco-int4-stream"]
    assert plain["steps"] == small["steps"]
    start = 2 * 4 * plain["parameters"]
    assert (plain["bytes_sent"] - start) / (small["bytes_sent"] - start) >= 7, \
        (plain["bytes_sent"], small["bytes_sent"])
    assert plain["peak_bytes_in_flight"] == 4 * plain["parameters"]
    assert small["peak_bytes_in_flight"] < 0.6 * plain["parameters"]
    assert small["test_accuracy"] >= plain["test_accuracy"] - 0.02


@pytest.mark.parametrize("pattern", [[], ["--fragment-pattern", "strided"]],
                         ids=["sequential", "strided"])
def test_stopped_with_an_exchange_in_flight_resumes_exactly(tmp_path, pattern):
    """Step 5 starts fragment 1's exchange (tau 4, 2 fragments, 1 step of overlap): the
    checkpoint keeps its result and every rank's error-feedback residual. Strided, the MLP's
    three layers go to fragments 0, 1, 0, and the flat vectors saved are laid out so."""
    whole = train_here(tmp_path / "whole", *COMMON, *RESUMED, *pattern)
    first = train_here(tmp_path / "parts", *COMMON, *RESUMED, *pattern, "--stop-at-step", "5")
    assert first["steps"] == 5 and not first["completed"]
    second = train_here(tmp_path / "parts", *COMMON, *RESUMED, *pattern, "--resume")
    assert second["completed"] and second["steps"] == whole["steps"]
    assert max_param_diff(checkpoint_params(tmp_path / "parts" / "checkpoint.pt"),
                          checkpoint_params(tmp_path / "whole" / "checkpoint.pt")) == 0
    assert second["test_accuracy"] == whole["test_accuracy"]


def test_resume_with_the_other_pattern_is_one_line(tmp_path, capsys):
    """A checkpoint's fragments were cut one way (no flag: sequential, the only pattern of
    checkpoints written before there were two): resuming it cut the other way is refused."""
    first = train_here(tmp_path / "run", *COMMON, *RESUMED, "--stop-at-step", "5")
    assert first["steps"] == 5
    saved = (tmp_path / "run" / "checkpoint.pt").read_bytes()
    capsys.readouterr()
    code = main(["train", "--out", str(tmp_path / "run"), *COMMON, *RESUMED, "--resume",
                 "--fragment-pattern", "strided"])
    assert code == 2
    line = one_error_line(capsys.readouterr().err)
    assert ("checkpoint was made with --fragment-pattern sequential, this run has "
            "--fragment-pattern strided") in line
    assert (tmp_path / "run" / "checkpoint.pt").read_bytes() == saved


@pytest.mark.parametrize("args, expected", [
    (["--strategy", "diloco", "--fragments", "0"], "--fragments must be at least 1, got 0"),
    (["--strategy", "diloco", "--tau", "64", "--fragments", "64"],
     "--fragments must be between 1 and the model's"),
    (["--strategy", "local-sgd", "--tau", "4", "--fragments", "2", "--overlap-steps", "2"],
     "--overlap-steps must be less than tau / fragments = 4/2, got 2"),
    (["--strategy", "easgd", "--tau", "2", "--fragments", "3"],
     "--fragments 3 is more than --tau 2"),
    (["--strategy", "diloco", "--tau", "auto", "--overlap-steps", "1"],
     "--fragments and --overlap-steps need a fixed --tau, not auto"),
    (["--strategy", "diloco", "--outer-precision", "fp16"], "--outer-precision"),
    (["--strategy", "diloco", "--error-feedback", "maybe"], "--error-feedback"),
    (["--strategy", "diloco", "--mix-alpha", "1.5"], "--mix-alpha must be in [0, 1], got 1.5"),
    (["--strategy", "diloco", "--fragment-pattern", "diagonal"], "--fragment-pattern"),
    (["--strategy", "local-sgd", "--tau", "8", "--fragments", "4", "--fragment-pattern",
      "strided"], "--fragments must be between 1 and the model's 3 layers (--fragment-pattern "
                  "strided), got 4"),
    (["--strategy", "sync", "--fragments", "2"], "strategy sync does not take --fragments"),
])
def test_bad_streaming_flags_are_one_line(tmp_path, capsys, args, expected):
    code = main(["train", "--out", str(tmp_path / "run"), "--model", "mlp", "--workers", "2",
                 "--epochs", "1", *args])
    assert code == 2
    line = one_error_line(capsys.readouterr().err)
    assert expected in line and "rank 0:" not in line, "caught before any worker started"
    assert not (tmp_path / "run").exists()


def test_summary_gives_each_workers_exposed_comm_and_wait(runs):
    """Every worker's own share of its step time blocked on exchanges (comm) and on slower
    ranks (wait); the run's shares are their means."""
    s = runs["diloco-int4-stream"]
    assert len(s["comm_fraction_by_rank"]) == len(s["wait_fraction_by_rank"]) == 2
    assert all(0 < f < 1 for f in s["comm_fraction_by_rank"]), s["comm_fraction_by_rank"]
    assert sum(s["comm_fraction_by_rank"]) / 2 == pytest.approx(s["comm_fraction"], rel=0.1)
