"""Bad input: one line naming the problem, a non-zero exit, no traceback, nothing damaged."""

import contextlib
import hashlib
import io

import numpy as np
import pytest

from shoal.cli import main

from conftest import one_error_line, shoal, train
from test_data import make_mnist


def fails(*args: str, code: int = 2) -> str:
    """``shoal ARGS`` run in this process (the command's own code path, minus an interpreter
    start-up): it must exit with ``code`` and print one error line."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        returned = main(list(args))
    assert returned == code, err.getvalue()
    return one_error_line(err.getvalue())


@pytest.mark.parametrize("args, message", [
    (["--model", "lenet7"], "unknown model 'lenet7'"),
    (["--dataset", "imagenet"], "unknown dataset 'imagenet'"),
    (["--strategy", "magic"], "unknown strategy 'magic'"),
    (["--workers", "0"], "--workers must be at least 1"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--workers", "two"], "invalid int value: 'two'"),
    (["--epochs", "-3"], "--epochs must be at least 1"),
    (["--lr", "nan"], "--lr must be a positive number"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--compress", "zip"], "invalid choice: 'zip'"),
    (["--dataset", "mnist"], "dataset mnist needs --data-dir"),
    (["--model", "lenet5", "--dataset", "synthetic", "--synthetic-shape", "1x2x2"],
     "needs images of at least 4x4"),
    (["--global-batch-size", "2", "--workers", "3"], "--global-batch-size 2 is smaller"),
    (["--config", "/nonexistent.yaml"], "config file /nonexistent.yaml does not exist"),
])
def test_bad_arguments(tmp_path, capsys, args, message):
    # In-process (the same code path as the command, minus the interpreter start-up).
    code = main(["train", "--out", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert message in one_error_line(err)
    assert not (tmp_path / "run").exists(), "nothing is written for a rejected command"


def test_bad_argument_from_the_real_command(tmp_path):
    res = shoal("train", "--model", "lenet7", "--out", str(tmp_path), timeout=90)
    assert res.returncode == 2
    assert "unknown model 'lenet7'" in one_error_line(res.stderr)


def test_missing_and_corrupt_data_files(tmp_path):
    assert "missing train-images-idx3-ubyte" in fails(
        "train", "--dataset", "mnist", "--data-dir", str(tmp_path), "--out", str(tmp_path / "r"))
    make_mnist(tmp_path)
    f = tmp_path / "t10k-images-idx3-ubyte"
    f.write_bytes(f.read_bytes()[:-100])
    line = fails("train", "--dataset", "mnist", "--data-dir", str(tmp_path),
                 "--out", str(tmp_path / "r"))
    assert "t10k-images-idx3-ubyte" in line and "holds" in line


def test_model_that_does_not_fit_the_data(tmp_path):
    path = tmp_path / "flat.npz"
    np.savez(path, x_train=np.zeros((8, 5), "float32"), y_train=np.arange(8) % 2,
             x_test=np.zeros((4, 5), "float32"), y_test=np.arange(4) % 2)
    assert "model lenet5 needs image input" in fails(
        "train", "--dataset", f"npz:{path}", "--model", "lenet5", "--out", str(tmp_path / "r"))


def test_config_file_with_unknown_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("epochs: 2\nlearning_rate: 0.1\n")
    assert "unknown configuration keys: learning_rate" in fails(
        "train", "--config", str(cfg), "--out", str(tmp_path / "r"))


def test_existing_run_is_not_overwritten_by_accident(tmp_path):
    train(tmp_path, "--epochs", "1", "--stop-at-step", "3")
    assert "already holds a run" in fails("train", "--out", str(tmp_path), "--epochs", "1")


def test_non_finite_loss_stops_and_keeps_the_good_checkpoint(tmp_path):
    train(tmp_path, "--epochs", "1", "--stop-at-step", "10", "--workers", "2")
    ckpt = tmp_path / "checkpoint.pt"
    before = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    line = fails("train", "--out", str(tmp_path), "--overwrite", "--lr", "1e3", "--workers", "2",
                 "--checkpoint-every", "5", "--log-every", "5")
    assert "training loss became nan" in line or "non-finite" in line
    assert hashlib.sha256(ckpt.read_bytes()).hexdigest() == before


def test_resume_problems(tmp_path):
    assert "no checkpoint at" in fails("train", "--out", str(tmp_path), "--resume")
    train(tmp_path, "--epochs", "1", "--stop-at-step", "3")
    assert "checkpoint was made with model='lenet5'" in fails(
        "train", "--out", str(tmp_path), "--resume", "--model", "mlp")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\x00garbage")
    assert "is not a readable checkpoint" in fails(
        "train", "--out", str(tmp_path), "--resume", str(bad))


def test_debug_flag_shows_traceback(tmp_path):
    res = shoal("train", "--model", "lenet7", "--out", str(tmp_path), "--debug")
    assert res.returncode == 2 and "Traceback" in res.stderr
