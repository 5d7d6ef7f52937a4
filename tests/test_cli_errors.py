"""Bad input: one line naming the problem, a non-zero exit, no traceback, nothing damaged."""

import contextlib
import hashlib
import io

import numpy as np
import pytest

from shoal.cli import main

from conftest import one_error_line, shoal, train_here
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
    # every float option of every strategy must be finite (nan passes `x <= 0` checks)
    (["--bucket-mb", "nan"], "--bucket-mb must be a finite number, got nan"),
    (["--bucket-mb", "inf"], "--bucket-mb must be a finite number, got inf"),
    (["--strategy", "diloco", "--outer-lr", "inf"], "--outer-lr must be a finite number"),
    # numbers that no seed, timedelta or Gloo timeout can hold
    (["--seed", "100000000000000000000000"], "--seed must be from 0 to 4294967295"),
    (["--seed", "-1"], "--seed must be from 0 to 4294967295"),
    (["--timeout", "1e18"], "--timeout must be at most 604800 seconds (a week)"),
    (["--heartbeat-timeout", "1e18"], "--heartbeat-timeout must be at most 604800 seconds"),
    (["--epochs", "1" + "0" * 400], "--epochs must be at most"),
    (["--lr-milestones", "nan"], "--lr-milestones must be finite"),
    # float settings multiply float32 tensors: beyond float32, torch raises an overflow
    (["--lr", "1e39"], "--lr must be at most 3.4e+38 in magnitude (float32), got 1e+39"),
    (["--weight-decay", "1e300"], "--weight-decay must be at most 3.4e+38"),
    (["--warmup-epochs", "1e308"], "--warmup-epochs must be at most 3.4e+38"),
    (["--strategy", "diloco", "--outer-lr", "1e39"], "--outer-lr must be at most 3.4e+38"),
    (["--lr", "1e38", "--scale-lr", "--workers", "4"], "--scale-lr with 4 workers is beyond"),
    (["--out", ""], "--out must name a directory"),
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
    train_here(tmp_path, "--epochs", "1", "--stop-at-step", "3")
    assert "already holds a run" in fails("train", "--out", str(tmp_path), "--epochs", "1")


def test_non_finite_loss_stops_and_keeps_the_good_checkpoint(tmp_path):
    train_here(tmp_path, "--epochs", "1", "--stop-at-step", "10", "--workers", "2")
    ckpt = tmp_path / "checkpoint.pt"
    before = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    line = fails("train", "--out", str(tmp_path), "--overwrite", "--lr", "1e3", "--workers", "2",
                 "--checkpoint-every", "5", "--log-every", "5")
    assert "training loss became nan" in line or "non-finite" in line
    assert hashlib.sha256(ckpt.read_bytes()).hexdigest() == before


def test_resume_problems(tmp_path):
    assert "no checkpoint at" in fails("train", "--out", str(tmp_path), "--resume")
    train_here(tmp_path, "--epochs", "1", "--stop-at-step", "3")
    assert "checkpoint was made with --model 'lenet5'" in fails(
        "train", "--out", str(tmp_path), "--resume", "--model", "mlp")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\x00garbage")
    assert "is not a readable checkpoint" in fails(
        "train", "--out", str(tmp_path), "--resume", str(bad))


def test_debug_flag_shows_traceback(tmp_path, capsys):
    assert main(["train", "--model", "lenet7", "--out", str(tmp_path), "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ("epochs: ten", "epochs must be an integer, got 'ten'"),
    ("batch_size: 16.5", "batch_size must be an integer, got 16.5"),
    ("epochs: 1.5", "epochs must be an integer, got 1.5"),  # was: 2 epochs, silently
    ("epochs: true", "epochs must be an integer, got True"),
    ("augment: 1", "augment must be true or false, got 1"),
    ("lr: fast", "lr must be a number, got 'fast'"),
    ("model: 5", "model must be a string, got 5"),
    ("lr-milestones: [30, x]", "lr_milestones must be a list of numbers, got [30, 'x']"),
    ("synthetic_shape: 3", "synthetic_shape must be a list of integers, got 3"),
    ("strategy_options: 3", "strategy_options must be a mapping"),
    ("bucket_mb: big", "bucket_mb must be a number, got 'big'"),
    ("strategy: local-sgd\ntau: 2.5", "tau must be an integer, auto or auto:N, got 2.5"),
    ("strategy: easgd\nstrategy_options: {overlap: 2}", "overlap must be true or false, got 2"),
    ("bucket_mb: .nan", "bucket_mb must be a finite number, got nan"),
    # the ranges of the flags, naming the file's key
    ("seed: 100000000000000000000000", "seed must be from 0 to 4294967295"),
    ("timeout: 1.0e+18", "timeout must be at most 604800 seconds (a week)"),
    ("heartbeat-timeout: 0", "heartbeat_timeout must be a positive number, got 0"),
    ('data_dir: "\\0"', r"data_dir must not contain a NUL character, got '\x00'"),
    ("strategy: diloco\nstrategy_options: {outer-lr: -1}", "outer_lr must be positive"),
])
def test_config_file_values_are_type_checked(tmp_path, capsys, text, message):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text + "\n")
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "r")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"config file {cfg}: {message}" in line
    assert not (tmp_path / "r").exists()


def test_config_file_numbers_as_the_flags_read_them(tmp_path):
    from shoal.cli import build_parser, config_from_args

    cfg = tmp_path / "c.json"
    # JSON and YAML numbers; YAML 1.1 reads 1e-3 (no dot) as a string, shoal as the number
    cfg.write_text('{"lr": 1, "weight_decay": 0, "lr_milestones": [3, 4.5], "epochs": 3}')
    args = build_parser().parse_args(["train", "--config", str(cfg)])
    c = config_from_args(args)
    assert (c.lr, c.weight_decay, c.lr_milestones, c.epochs) == (1.0, 0.0, (3.0, 4.5), 3)
    assert isinstance(c.lr, float)
    yml = tmp_path / "c.yaml"
    yml.write_text("lr: 1e-3\nsynthetic-shape: [1, 8, 8]\nprofile: '2:3'\nworkers: null\n")
    c = config_from_args(build_parser().parse_args(["train", "--config", str(yml)]))
    assert (c.lr, c.synthetic_shape, c.profile, c.workers) == (1e-3, (1, 8, 8), (2, 3), None)


def test_every_setting_is_a_flag_and_the_help_names_what_the_registries_hold(monkeypatch):
    import dataclasses

    from torch import nn

    from shoal.cli import build_parser
    from shoal.config import TrainConfig
    from shoal.data import dataset_names
    from shoal.models import MODELS

    monkeypatch.setitem(MODELS, "my-net", lambda shape, classes: nn.Flatten())
    monkeypatch.setenv("COLUMNS", "10000")  # no line break inside a name (fashion-mnist)
    parser = build_parser()
    sub = next(a for a in parser._actions if getattr(a, "choices", None) and "train" in a.choices)
    train = sub.choices["train"]
    flags = {o for a in train._actions for o in a.option_strings}
    settings = {f.name for f in dataclasses.fields(TrainConfig)
                if f.metadata.get("flag", True)} - {"strategy_options"}
    assert {"--" + s.replace("_", "-") for s in settings} <= flags
    help_text = train.format_help()
    assert all(name in help_text for name in [*MODELS, *dataset_names()])


def test_every_strategy_float_option_must_be_finite():
    import dataclasses

    from shoal.errors import ShoalError
    from shoal.strategies import Strategy, make_options

    @dataclasses.dataclass
    class Options:
        rate: float = 0.5
        steps: int = 2

    class NewStrategy(Strategy):  # a strategy with no checks of its own
        name = "new"

    NewStrategy.Options = Options
    assert make_options(NewStrategy, {"rate": 2}).rate == 2.0
    for values, message in (({"rate": float("nan")}, "--rate must be a finite number, got nan"),
                            ({"rate": "x"}, "--rate must be a number, got 'x'"),
                            ({"steps": 1.5}, "--steps must be an integer, got 1.5")):
        with pytest.raises(ShoalError) as info:
            make_options(NewStrategy, values)
        assert str(info.value) == message


@pytest.mark.parametrize("body, message", [
    ("def make(shape, n):\n    import sys\n    sys.exit(3)\n", "called sys.exit(3)"),
    ("import sys\nsys.exit(4)\ndef make(shape, n): pass\n", "called sys.exit(4)"),
    ("raise ValueError('broken module')\n", "ValueError: broken module"),
])
def test_model_factory_that_exits(tmp_path, capsys, body, message):
    name = f"exiting_{abs(hash(body))}"
    (tmp_path / f"{name}.py").write_text(body)
    spec = f"{tmp_path / name}.py:make"
    assert main(["train", "--model", spec, "--out", str(tmp_path / "r")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"model '{spec}'" in line and message in line


FULL_DISK = """
import resource, signal, sys
from shoal.cli import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writing past the limit: EFBIG, not a signal
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
sys.exit(main(sys.argv[1:]))
"""


def test_full_disk_while_checkpointing_keeps_the_previous_checkpoint(tmp_path):
    import subprocess
    import sys

    from conftest import shoal_env

    out = tmp_path / "run"
    args = ["train", "--model", "mlp", "--out", str(out), "--progress", "none"]
    assert main([*args, "--epochs", "1", "--stop-at-step", "3"]) == 0
    ckpt = out / "checkpoint.pt"
    assert ckpt.stat().st_size > 64 * 1024  # so that the next one cannot be written
    before = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    # The real torch.save under a file-size limit (what a full disk looks like to a writer).
    res = subprocess.run([sys.executable, "-c", FULL_DISK, *args, "--resume", "--epochs", "1"],
                         capture_output=True, text=True, timeout=120, env=shoal_env())
    assert res.returncode == 2, res.stderr
    line = one_error_line(res.stderr)
    assert f"no space left on device writing {ckpt}" in line
    assert "the previous checkpoint is kept" in line
    assert hashlib.sha256(ckpt.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "config.json",
                                                      "metrics.jsonl"]


def test_error_naming_a_path_with_a_line_break_stays_one_line(tmp_path, capsys):
    odd = tmp_path / "a\nb"
    assert main(["train", "--dataset", "mnist", "--data-dir", str(odd),
                 "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a\\nb is not a directory" in one_error_line(err)


def test_version_help_and_a_mistyped_command_answer_without_importing_torch():
    """``shoal --version``, ``--help`` and a mistyped subcommand answer at once: only the
    subcommand a command line names has its flags built (train's import torch)."""
    import subprocess
    import sys

    code = ("import sys\nfrom shoal.cli import main\n"
            "for argv in (['--version'], ['--help'], ['list', '--help'], ['join', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print(main(['trian', '--workers', '2']), 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.splitlines()[-1] == "2 False", done.stdout + done.stderr
    assert "invalid choice: 'trian'" in done.stderr
    assert "shoal join [-h]" in done.stdout and "train a model data-parallel" in done.stdout
    assert fails("train", "--workers", "0").endswith("--workers must be at least 1, got 0")


def test_a_reader_that_leaves_early_ends_the_command_quietly():
    """``shoal list | head -1``: the pipe's reader gone, the command ends (status 1) with no
    error line about a broken pipe, as cat or ls do."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "shoal", "list"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the command writes a line
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 1 and err == ""
