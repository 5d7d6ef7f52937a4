"""What a run leaves behind, and the options a DDP user expects, on real worker processes."""

import json

import pytest
import yaml

from shoal.cli import main
from shoal.core.timeline import CATEGORIES as TIME_CATEGORIES

from conftest import checkpoint_params, max_param_diff, train_here, train_together

SUMMARY_KEYS = {"test_accuracy", "test_loss", "train_loss", "epochs", "steps", "workers",
                "strategy", "wall_time_s", "samples_per_s", "comm_fraction", "bytes_per_sample"}


def test_demo_reaches_95_percent_on_digits(tmp_path):
    """The README's `make demo` job."""
    summary = train_here(tmp_path, "--model", "lenet5", "--dataset", "digits", "--workers", "2",
                         "--epochs", "10")
    assert summary["test_accuracy"] >= 0.95
    assert summary.keys() >= SUMMARY_KEYS
    assert summary["workers"] == 2 and summary["epochs"] == 10 and summary["completed"]
    assert summary["steps"] == 10 * 45  # 1437 samples, global batch 2 x 16
    assert summary["samples"] == 10 * 1437
    assert 0 < summary["comm_fraction"] < 1
    # each rank all-reduces all gradients (21,386 float32 values) per 16 samples it reads
    assert summary["bytes_per_sample"] == pytest.approx(21386 * 4 / 16, rel=0.01)

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    epochs = [r for r in records if r["event"] == "epoch"]
    steps = [r for r in records if r["event"] == "step"]
    assert [r["epoch"] for r in epochs] == list(range(1, 11))
    assert epochs[-1]["test_accuracy"] == summary["test_accuracy"]
    for r in steps + epochs:
        assert set(r["time_s"]) == set(TIME_CATEGORIES)
        assert r["samples_per_s"] > 0 and r["lr"] >= 0
    assert steps[0]["step"] == 10 and {"loss", "accuracy"} <= steps[0].keys()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model"] == "lenet5" and config["world_size"] == 2
    assert (tmp_path / "checkpoint.pt").stat().st_size > 0


COMPRESS_BASE = ["--workers", "2", "--epochs", "1", "--stop-at-step", "20", "--log-every", "5"]
COMPRESSIONS = ["fp16", "bf16", "powersgd"]
ADAM = ["--optimizer", "adam", "--lr", "0.002", "--schedule", "step", "--lr-milestones", "2",
        "--warmup-epochs", "0.5", "--epochs", "3", "--workers", "2", "--log-every", "5"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uncompressed run every compression is compared with, each compression's run and
    the Adam run: made once, in one set of 2 worker processes."""
    flags = {"none": COMPRESS_BASE, "adam": ADAM,
             **{c: [*COMPRESS_BASE, "--compress", c, "--powersgd-warmup", "5"] for c in COMPRESSIONS}}
    dirs = {name: tmp_path_factory.mktemp(name) for name in flags}
    summaries = train_together({dirs[name]: f for name, f in flags.items()}, workers=2)
    return {name: (dirs[name], summaries[dirs[name]]) for name in flags}


@pytest.mark.parametrize("compress", COMPRESSIONS)
def test_ddp_compression_hooks(runs, compress):
    plain_dir, plain = runs["none"]
    packed_dir, packed = runs[compress]
    ratio = packed["bytes_per_sample"] / plain["bytes_per_sample"]
    if compress == "powersgd":
        assert ratio < 0.6  # rank-1 factors after 5 plain steps
    else:
        assert ratio == pytest.approx(0.5, rel=0.01)
    diff = max_param_diff(checkpoint_params(plain_dir / "checkpoint.pt"),
                          checkpoint_params(packed_dir / "checkpoint.pt"))
    assert 0 < diff < (0.5 if compress == "powersgd" else 0.05)


def test_config_file_and_flags(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": "mlp", "epochs": 1, "batch-size": 50, "lr": 0.1,
                                   "bucket_mb": 1}))
    summary = train_here(tmp_path / "out", "--config", str(cfg), "--lr", "0.2", "--stop-at-step", "3")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert summary["model"] == "mlp" and config["batch_size"] == 50
    assert config["lr"] == 0.2  # the flag wins over the file
    assert config["strategy_options"] == {"bucket_mb": 1}


def test_plain_progress_lines_and_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "resnet50" in out and "npz:PATH" in out and "sync" in out


def test_adam_with_warmup_and_step_schedule(runs):
    out, summary = runs["adam"]
    lrs = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").open()]
    assert lrs[0] == pytest.approx(0.002 * 5 / 22)  # step 5 of a 22-step warm-up
    assert max(lrs) == pytest.approx(0.002) and lrs[-1] == pytest.approx(0.0002)
    assert summary["test_accuracy"] > 0.8


def test_augmentation_flips_and_shifts():
    import torch

    from shoal.data.augment import flip_and_crop

    x = torch.arange(2 * 1 * 8 * 8, dtype=torch.float32).view(2, 1, 8, 8)
    gen = torch.Generator().manual_seed(0)
    flips = [flip_and_crop(x, gen, pad=0)[0] for _ in range(20)]
    assert any(torch.equal(o, x[0].flip(2)) for o in flips)
    assert any(torch.equal(o, x[0]) for o in flips)
    crops = [flip_and_crop(x, gen) for _ in range(20)]  # 1-pixel shifts for 8x8 images
    assert all(o.shape == x.shape for o in crops)
    shifted = [o[0] for o in crops if not torch.equal(o[0], x[0])
               and not torch.equal(o[0], x[0].flip(2))]
    assert shifted and all((o == 0).any() for o in shifted)  # zero padding came in
