"""Where the time goes: the time split, the Chrome trace, the profiler window, TensorBoard."""

import json
import sys
from collections import defaultdict

import pytest

from shoal.cli import main
from shoal.config import TrainConfig, parse_step_window
from shoal.core.timeline import CATEGORIES as TIME_CATEGORIES
from shoal.core.timeline import Timeline, chrome_trace
from shoal.errors import ShoalError

from conftest import one_error_line, train_here

#: The span names a synchronous (DDP) run must show in each rank's lane.
SYNC_SPANS = {"step", "data", "compute", "allreduce", "optim"}


def check_chrome_trace(trace: dict) -> list[dict]:
    """The Chrome trace event format's JSON object form; returns the complete ("X") events."""
    assert isinstance(trace["traceEvents"], list)
    spans = []
    for e in trace["traceEvents"]:
        assert e["ph"] in ("X", "M"), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and isinstance(e["name"], str)
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
            assert e["dur"] >= 0 and e["cat"]
            spans.append(e)
        else:
            assert e["name"] in ("process_name", "process_sort_index", "thread_name")
            assert isinstance(e["args"], dict)
    return spans


def test_two_rank_trace_and_breakdown(tmp_path):
    summary = train_here(tmp_path, "--workers", "2", "--epochs", "1", "--stop-at-step", "25",
                         "--log-every", "5", "--trace", "--split-wait")
    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = check_chrome_trace(trace)
    lanes = {e["pid"] for e in spans}
    assert lanes == {0, 1}  # one lane per rank
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    per_rank = defaultdict(set)
    for e in spans:
        per_rank[e["pid"]].add(e["name"])
    for rank in (0, 1):
        assert per_rank[rank] >= SYNC_SPANS, per_rank[rank]
        steps = [e for e in spans if e["pid"] == rank and e["name"] == "step"]
        assert len(steps) == 25
    # The lanes share one clock: both ranks' first steps begin within a second of each other.
    first = [min(e["ts"] for e in spans if e["pid"] == r and e["name"] == "step") for r in (0, 1)]
    assert abs(first[0] - first[1]) < 1e6

    # The exclusive categories add up to the step time: per rank in the trace, and on average
    # (summary.json's time_s is the mean over ranks) to the mean of the ranks' step spans.
    step_total = defaultdict(float)
    for e in spans:
        if e["name"] == "step":
            step_total[e["pid"]] += e["dur"]
    split = summary["time_s"]
    assert set(split) == set(TIME_CATEGORIES)
    mean_step_s = sum(step_total.values()) / 2 / 1e6
    assert sum(split.values()) == pytest.approx(mean_step_s, rel=0.05)
    assert summary["comm_fraction"] == pytest.approx(split["comm"] / sum(split.values()), rel=1e-3)
    assert sum(summary["time_fraction"].values()) == pytest.approx(1.0, abs=1e-3)
    assert summary["comm_fraction"] > 0 and summary["wait_fraction"] >= 0
    # Each step one of the two ranks finished backward first and waited for the other.
    waits = [e for e in spans if e["cat"] == "wait"]
    assert waits and {e["name"] for e in waits} == {"wait for slowest rank"}
    for r in [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]:
        assert set(r["time_s"]) == set(TIME_CATEGORIES)


def test_one_worker_breakdown_adds_up_to_step_time(tmp_path):
    summary = train_here(tmp_path, "--model", "mlp", "--epochs", "1", "--stop-at-step", "40",
                         "--trace", "--profile", "3:4")
    assert sum(summary["time_s"].values()) == pytest.approx(summary["train_time_s"], rel=0.05)
    assert summary["comm_fraction"] == 0
    spans = check_chrome_trace(json.loads((tmp_path / "trace.json").read_text()))
    assert {e["pid"] for e in spans} == {0}
    assert {"step", "data", "compute", "optim"} <= {e["name"] for e in spans}
    profile = json.loads((tmp_path / "profile" / "rank0.json").read_text())
    assert profile["traceEvents"]  # torch.profiler's own Chrome trace


def test_timeline_reassign_and_chrome_events():
    tl = Timeline(keep_events=True)
    with tl.span("other", "step"):
        with tl.span("compute"):
            start = tl.now()
            end = start + 0.004
            event = tl.record("comm", "allreduce", start, end)
        tl.reassign(0.001, "comm", "wait", event, "wait for slowest rank")
    assert tl.totals["wait"] == pytest.approx(0.001)
    assert tl.totals["comm"] == pytest.approx(0.003)
    assert sum(tl.totals.values()) == pytest.approx(sum(e.end - e.start for e in tl.events
                                                        if e.name == "step"))
    spans = check_chrome_trace(chrome_trace([tl.chrome_events(3)]))
    assert {e["name"] for e in spans} == {"step", "compute", "allreduce", "wait for slowest rank"}
    assert {e["pid"] for e in spans} == {3}
    wait = next(e for e in spans if e["cat"] == "wait")
    comm = next(e for e in spans if e["cat"] == "comm")
    assert wait["ts"] + wait["dur"] == pytest.approx(comm["ts"], abs=0.01)


def test_profile_window_parsing():
    assert parse_step_window("20:25") == (20, 25)
    assert parse_step_window(7) == (7, 7)
    assert TrainConfig(profile=[3, 4]).validate().profile == (3, 4)
    for bad in ("5:2", "0:3", "a:b", "1:2:3"):
        with pytest.raises(ShoalError, match="--profile"):
            parse_step_window(bad)


def test_bad_flags_are_one_line(tmp_path, capsys, monkeypatch):
    assert main(["train", "--out", str(tmp_path), "--profile", "9:3"]) == 2
    assert "--profile must be FIRST:LAST" in one_error_line(capsys.readouterr().err)
    # As on a machine without the optional tensorboard package:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    assert main(["train", "--out", str(tmp_path), "--tensorboard"]) == 2
    assert "'tensorboard' package" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="the optional tensorboard package is not installed")
    train_here(tmp_path, "--model", "mlp", "--stop-at-step", "5", "--log-every", "5", "--tensorboard")
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
