"""`shoal bench` and `shoal report` produce their files from short runs; bad input is one line."""

import csv
import json
import sys

import pytest

from shoal.cli import main
from shoal.errors import ShoalError
from shoal.report import load_run, summary_table
from shoal.sweep.measure import accuracy_at, add_efficiency, add_speedup, measure_race
from shoal.sweep.reference import Workload, parse_workload
from shoal.sweep.spec import REFERENCE, StrategySpec, parse_strategies
from shoal.sweep.tables import markdown_table

from conftest import one_error_line

PNG = b"\x89PNG\r\n\x1a\n"


def test_bench_and_report_write_their_files(tmp_path):
    # The commands run in this process (their own code path, minus an interpreter start-up);
    # the bench's runs are real `shoal train` processes and DDP workers all the same.
    out = tmp_path / "bench"
    assert main(["bench", "--models", "mlp", "--workers", "2", "--scaling", "weak",
                 "--steps", "4", "--warmup", "2", "--repeats", "1", "--batch-size", "8",
                 "--synthetic-shape", "1x8x8", "--strategies", "sync:bucket_mb=1",
                 "--out", str(out)]) == 0
    rows = list(csv.DictReader((out / "bench.csv").open()))
    got = {(r["strategy"], int(r["workers"])) for r in rows}
    assert got == {("sync:bucket_mb=1", 2), (REFERENCE, 2)}
    for r in rows:
        assert float(r["samples_per_s"]) > 0
        assert float(r["samples_per_s_min"]) <= float(r["samples_per_s"]) <= float(r["samples_per_s_max"])
        assert r["efficiency"] == ""  # no one-worker row to compare with (see test_efficiency...)
        assert int(r["global_batch"]) == 8 * int(r["workers"])  # weak scaling
    sync2 = next(r for r in rows if r["strategy"].startswith("sync") and r["workers"] == "2")
    assert 0 < float(sync2["comm_fraction"]) < 1
    table = (out / "bench.md").read_text()
    assert "| mlp | sync:bucket_mb=1 | weak | 2 |" in table and REFERENCE in table
    assert (out / "bench.png").read_bytes().startswith(PNG)

    # The bench's runs (stopped after a few steps) next to a finished one with test records.
    runs = sorted(p for p in (out / "runs").iterdir() if "ddp-reference" not in p.name)
    assert len(runs) == 1
    done = tmp_path / "finished"
    assert main(["train", "--model", "mlp", "--epochs", "1", "--log-every", "10",
                 "--progress", "none", "--out", str(done)]) == 0
    run = load_run(done)
    assert run["epochs"][-1]["test_accuracy"] > 0.5
    assert run["steps"][0]["samples"] == 10 * 16  # step 10 at a global batch of 16
    assert main(["report", *map(str, runs), str(done), "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "report.png").read_bytes().startswith(PNG)
    md = (tmp_path / "report" / "report.md").read_text()
    assert all(p.name in md for p in runs) and "samples/s" in md
    assert any(line.startswith("| finished | mlp | sync | 1 |") for line in md.splitlines())


def test_race_measures_time_to_accuracy(tmp_path):
    # A race of one asynchronous point (its records are the coordinator's): the server runs
    # beside the workers, so the point counts 3 processes (3 hosts on an emulated cluster).
    out = tmp_path / "race"
    assert main(["bench", "--dataset", "digits", "--models", "mlp", "--workers", "2",
                 "--scaling", "weak", "--batch-size", "16", "--lr", "0.1", "--epochs", "2",
                 "--target-accuracy", "0.5", "--repeats", "1", "--quiet",
                 "--strategies", "async-easgd:tau=2,momentum=0.5", "--out", str(out)]) == 0
    (row,) = list(csv.DictReader((out / "bench.csv").open()))
    assert row["strategy"] == "async-easgd:momentum=0.5,tau=2" and row["processes"] == "3"
    config = json.loads((out / "runs" / "mlp-async-easgd_momentum0.5_tau2-weak-w2-t1-r0"
                         / "config.json").read_text())
    assert config["momentum"] == 0.5 and config["epochs"] == 2  # the strategy's own setting
    result = measure_race(out / "runs" / "mlp-async-easgd_momentum0.5_tau2-weak-w2-t1-r0", 0.5)
    assert len(result["curve"]) == 2 and result["final_accuracy"] == result["curve"][-1][1]
    assert float(row["time_to_target"]) == result["time_to_target"] <= result["curve"][-1][0]
    assert float(row["budget_s"]) == result["curve"][-1][0]  # the quickest point's end
    assert float(row["accuracy_at_budget"]) == result["final_accuracy"] > 0.5
    assert row["reached"] == "1" and float(row["speedup"]) == 1.0
    assert "| mlp | async-easgd:momentum=0.5,tau=2 | 2 | 3 | 32 |" in (out / "bench.md").read_text()
    assert (out / "bench.png").read_bytes().startswith(PNG)


def test_race_arithmetic():
    curve = [(1.0, 0.5), (2.0, 0.8), (3.0, 0.9)]
    assert [accuracy_at(curve, t) for t in (0.5, 1.0, 2.5, 9.0)] == [None, 0.5, 0.8, 0.9]
    rows = [{"model": "m", "scaling": "weak", "threads_label": "1", "workers": 2,
             "strategy": s, "time_to_target": t} for s, t in
            (("sync", 4.0), ("easgd", 1.0), ("async-sgd", float("inf")), ("auto", None))]
    add_speedup(rows)
    assert [r["speedup"] for r in rows] == [1.0, 4.0, None, None]
    assert {r["baseline"] for r in rows} == {"sync"}


def test_parse_strategies():
    specs = parse_strategies("sync,sync:bucket_mb=1,compress=fp16", common="bucket-mb=5")
    assert specs == [StrategySpec("sync", (("bucket_mb", "5"),)),
                     StrategySpec("sync", (("bucket_mb", "1"), ("compress", "fp16")))]
    assert specs[1].label == "sync:bucket_mb=1,compress=fp16"
    assert specs[1].flags() == ["--strategy", "sync", "--bucket-mb", "1", "--compress", "fp16"]
    assert parse_strategies("async-sgd:momentum=0")[0].flags() == [
        "--strategy", "async-sgd", "--momentum", "0"]  # a run setting of its own
    for bad, message in (("nosuch", "unknown strategy"), ("sync:tau=4", "does not take"),
                         ("bucket_mb=1", "before any strategy"), ("", "empty"),
                         (REFERENCE, "added by shoal bench")):
        with pytest.raises(ShoalError, match=message):
            parse_strategies(bad)


def test_efficiency_and_tables():
    rows = [{"model": "m", "strategy": "sync", "scaling": "weak", "threads_label": "1",
             "threads": 1, "workers": w, "global_batch": 8 * w, "samples_per_s": s,
             "samples_per_s_min": s, "samples_per_s_max": s, "comm_fraction": c,
             "wait_fraction": 0.0, "bytes_per_sample": 1000.0 * (w - 1)}
            for w, s, c in ((1, 100.0, 0.0), (2, 150.0, 0.3))]
    add_efficiency(rows)
    assert [r["efficiency"] for r in rows] == [1.0, 0.75]
    row = "| m | sync | weak | 2 | 1 | 16 | 150 | 150–150 | 0.75 | 30% | 0% | 1,000 |"
    assert row in markdown_table(rows)
    run = {"summary": {"label": "r", "model": "m", "test_accuracy": 0.5, "comm_fraction": None}}
    assert "| r | m |" in summary_table([run]) and "50.00%" in summary_table([run])


def test_reference_under_torchrun_trains_the_workload_it_is_given():
    """The emulated reference runs from flags: every field must survive them (it once lost
    --lr and --momentum, training the default learning rate instead of the sweep's)."""
    changed = {"model": "mlp", "shape": (1, 8, 8), "classes": 3, "batch": 5, "steps": 7,
               "warmup": 2, "lr": 0.125, "momentum": 0.0}
    assert set(changed) == set(vars(Workload())), "a new Workload field: add it here"
    assert all(vars(Workload())[k] != v for k, v in changed.items())
    w = Workload(**changed)
    got, flags = parse_workload([*w.flags(), "--out", "r.json"])
    assert got == w and flags.out == "r.json"


def error_of(capsys, *args: str) -> str:
    """Run the CLI in this process; it must fail with one ``shoal: error:`` line."""
    assert main(list(args)) == 2
    return one_error_line(capsys.readouterr().err)


def test_errors_are_one_line(tmp_path, capsys):
    assert "does not take option 'tau'" in error_of(capsys, "bench", "--strategies", "sync:tau=4")
    assert "--workers" in error_of(capsys, "bench", "--workers", "0")
    assert "--scaling" in error_of(capsys, "bench", "--scaling", "diagonal")
    assert "100 mbit" in error_of(capsys, "bench", "--emulate-bandwidth", "100 mbit")
    assert "give --epochs too" in error_of(capsys, "bench", "--target-accuracy", "0.9")
    assert "in (0, 1]" in error_of(capsys, "bench", "--epochs", "2", "--target-accuracy", "95")
    assert "hogwild shares memory on one host" in error_of(
        capsys, "bench", "--emulate-bandwidth", "1gbit", "--strategies", "hogwild")
    assert "not a run directory" in error_of(capsys, "report", str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    assert "no metrics.jsonl" in error_of(capsys, "report", str(tmp_path / "empty"))


def test_without_matplotlib_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"event": "step", "step": 1, "loss": 1.0}) + "\n")
    assert "'matplotlib' package" in error_of(capsys, "report", str(run))
    assert "'matplotlib' package" in error_of(capsys, "bench", "--out", str(tmp_path / "b"))
    assert not (tmp_path / "b").exists()  # refused before running anything
