"""``shoal train --strategy auto`` under torchrun (two real ranks on loopback): the probe,
the plan's trials and the winner all run on the job's own processes."""

from __future__ import annotations

import json
import sys

import pytest

from shoal.core.group import mesh_not_formed
from shoal.emulate import can_emulate

from conftest import REPO, mpirun, mpirun_env, needs_mpirun, run

START = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
AUTO = ["-m", "shoal", "train", "--strategy", "auto", "--model", "mlp", "--dataset", "digits",
        "--target-accuracy", "0.9", "--progress", "none"]
TORCHRUN = [*START, "2", *AUTO]


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_auto_under_torchrun_plans_on_the_jobs_ranks_and_trains_the_winner_there(tmp_path):
    """A run whose tenth holds a trial (a launch that cost nothing: ``--plan-probe-since``
    in the future) stops after sync's probe, plans with trials that are fresh trainers on
    the two ranks torchrun started (no planning session starts), and the winner trains on
    from the probe's checkpoint on the same ranks to the run's end."""
    out = tmp_path / "auto"
    res = run([*TORCHRUN, "--epochs", "10", "--trial-epochs", "0.2", "--plan-probe-since", "4e9",
               "--plan-candidates", "sync,local-sgd", "--out", str(out)], timeout=280)
    assert res.returncode == 0, res.stderr
    assert "planning for a tenth" in res.stderr and "planned on the job's 2 ranks" in res.stderr
    assert not res.stray
    plan = json.loads((out / "plan" / "plan.json").read_text())
    labels = [t["label"] for t in plan["trials"]]
    assert any(t["speed_only"] and t["strategy"] == "sync" for t in plan["trials"])  # the probe
    assert any(t["strategy"] == "local-sgd" and t["curve"] for t in plan["trials"]), labels
    assert all(t["workers"] == 2 for t in plan["trials"])  # only the job's own layout
    assert not (out / "plan" / "trials" / "sessions").exists()  # no planning session started
    summary = json.loads((out / "summary.json").read_text())
    assert summary["plan"]["in_job"] and not summary["plan"]["skipped"]
    assert summary["completed"] and summary["steps"] == 10 * 45
    config = json.loads((out / "config.json").read_text())
    assert config["world_size"] == 2 and config["init_from"] == str(out / "checkpoint.pt")
    assert [r["epoch"] for r in _records(out) if r["event"] == "epoch"] == list(range(1, 11))


@pytest.mark.skipif(can_emulate() is not None, reason=f"cannot emulate: {can_emulate()}")
def test_auto_across_hosts_of_two_processes_tries_one_replica_a_host(tmp_path):
    """Inside a torchrun job of 2 emulated hosts of 2 processes each, the plan also tries
    local SGD one replica a host (``--host-sync``: each host's processes step together
    through its memory, local SGD between the hosts) beside local SGD over all 4 ranks;
    both trials train, and the winner trains the run on the same ranks. (A target no trial
    reaches: nothing is skipped for its cost; the budget bounds the grids.)"""
    out = tmp_path / "auto"
    res = run([sys.executable, "-m", "shoal.emulate", "--hosts", "2", "--nproc-per-node", "2",
               "--rate", "1gbit", "--", *AUTO, "--epochs", "1", "--trial-epochs", "0.5",
               "--plan-budget", "6s", "--plan-candidates", "local-sgd", "--batch-size", "16",
               "--threads-per-worker", "1", "--target-accuracy", "0.995", "--out", str(out)],
              timeout=280)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "planned on the job's 4 ranks" in res.stdout + res.stderr and not res.stray
    trials = json.loads((out / "plan" / "plan.json").read_text())["trials"]
    tried = {(t["strategy"], t["options"].get("host_sync", False)): t for t in trials
             if t["phase"] == "hardware"}
    assert {("sync", False), ("local-sgd", False), ("local-sgd", True)} <= set(tried), trials
    assert all(t["curve"] and not t["error"] and t["workers"] == 4 for t in tried.values())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["plan"]["in_job"] and summary["completed"], summary


def test_a_run_under_torchrun_that_cannot_pay_trains_sync_in_one_line(tmp_path):
    """A trial as long as the run (``--trial-epochs`` = ``--epochs``) never fits a tenth of
    it: sync goes on from the probe, and one line says so."""
    out = tmp_path / "auto"
    res = run([*TORCHRUN, "--epochs", "1", "--trial-epochs", "1", "--plan-probe-since", "4e9",
               "--out", str(out)], timeout=200)
    assert res.returncode == 0, res.stderr
    said = [line for line in res.stderr.splitlines() if "planning skipped" in line]
    assert len(said) == 1 and not res.stray
    summary = json.loads((out / "summary.json").read_text())
    assert summary["plan"]["skipped"] and summary["plan"]["in_job"] and summary["completed"]
    assert json.loads((out / "config.json").read_text())["strategy"] == "sync"


def test_auto_under_torchrun_tries_groups_and_asynchrony_on_the_jobs_ranks(tmp_path):
    """Inside a torchrun job of 3 hosts of the emulated cluster (1 Gbit/s links; where it
    cannot be made, 3 ranks on loopback), ``groups`` and Async EAMSGD are tried too: each
    trial lays the same ranks out anew (one serves, two train), and the job's own group
    comes back after each for the next trial and the winner, which trains the whole run. A
    target no trial reaches keeps the search from skipping any trial as costlier than the
    leader's time (what the walk measures depends on the machine's load; a tested run in
    such a layout is the next test's)."""
    out = tmp_path / "auto"
    start = ([sys.executable, "-m", "shoal.emulate", "--hosts", "3", "--rate", "1gbit", "--"]
             if can_emulate() is None else [*START, "3"])
    res = run([*start, *AUTO, "--epochs", "4", "--trial-epochs", "0.5", "--plan-budget",
               "60s", "--plan-candidates", "sync,groups,async-measgd", "--threads-per-worker",
               "1", "--target-accuracy", "0.995", "--out", str(out)], timeout=280)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "planned on the job's 3 ranks" in res.stdout + res.stderr and not res.stray
    trials = json.loads((out / "plan" / "plan.json").read_text())["trials"]
    laid_out = [t for t in trials if t["strategy"] != "sync"]
    assert {t["strategy"] for t in laid_out if t["speed_only"]} == {"groups", "async-measgd"}
    assert all(t["workers"] == 2 for t in laid_out)  # one of the 3 ranks serves
    assert all(t["workers"] == 3 for t in trials if t["strategy"] == "sync")
    assert not any(t.get("error") for t in trials), trials  # no momentum-0 EAMSGD trial
    summary = json.loads((out / "summary.json").read_text())
    assert summary["plan"]["in_job"] and summary["completed"]
    assert summary["workers"] == (3 if summary["strategy"] == "sync" else 2)
    assert [r["epoch"] for r in _records(out) if r["event"] == "epoch"] == [1, 2, 3, 4]
    # Where no trial reaches the target, the run says sync goes on (not that a trial is kept).
    fell_back = summary["plan"]["winner"].startswith("sync (no trial")
    assert ("sync goes on" in summary["plan"]["why"]) == fell_back, summary["plan"]
    assert "is kept" not in summary["plan"]["why"], summary["plan"]


@needs_mpirun
def test_auto_under_a_real_mpirun_plans_on_its_ranks_with_servers_too(tmp_path):
    """The same under OpenMPI's mpirun (3 ranks on loopback): planning inside the job reads
    the ranks from mpirun's variables, lays them out anew for ``groups`` and Async EAMSGD,
    and the winner trains the whole run; nothing outlives mpirun. (The target no trial
    reaches, as above: no trial is skipped for its cost.)"""
    out = tmp_path / "auto"
    res = run(mpirun(3, *AUTO[2:], "--epochs", "3", "--trial-epochs", "0.5", "--plan-budget",
                     "60s", "--plan-candidates", "sync,groups,async-measgd",
                     "--threads-per-worker", "1", "--target-accuracy", "0.995", "--out",
                     str(out)), timeout=280,
              env=mpirun_env())
    assert res.returncode == 0, res.stdout + res.stderr
    assert "planned on the job's 3 ranks" in res.stdout + res.stderr and not res.stray
    trials = json.loads((out / "plan" / "plan.json").read_text())["trials"]
    assert {t["strategy"] for t in trials if t["speed_only"]} >= {"groups", "async-measgd"}
    assert all(t["workers"] == 2 for t in trials if t["strategy"] != "sync")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["plan"]["in_job"] and summary["completed"]
    assert [r["epoch"] for r in _records(out) if r["event"] == "epoch"] == [1, 2, 3]


def test_a_job_lays_its_ranks_out_for_servers_and_gets_its_group_back(tmp_path):
    """``relaid`` (a trial or a winner of groups or an asynchronous strategy inside a job):
    a compute group of two workers with a server, a run that fails at its start on every
    rank (Async EAMSGD without momentum), and async-sgd, one after another on the same 3
    torchrun ranks; after each, all three meet in the job's own process group again."""
    for attempt in range(2):  # once more only if Gloo's mesh did not form as it started
        out = tmp_path / f"job{attempt}"
        out.mkdir()
        res = run([*START, "3", str(REPO / "tests" / "relaid_job.py"), str(out)], timeout=200)
        if res.returncode == 0 or not mesh_not_formed(res.stderr):
            break
    assert res.returncode == 0, res.stderr
    assert not res.stray
    seen = {s["strategy"]: s for s in json.loads((out / "seen.json").read_text())}
    assert all(s["ranks"] == 0 + 1 + 2 for s in seen.values())
    for strategy in ("groups", "async-sgd"):
        assert seen[strategy]["error"] is None and seen[strategy]["completed"]
        assert seen[strategy]["workers"] == 2 and seen[strategy]["accuracy"] > 0.8
        assert (out / strategy / "summary.json").is_file()
    assert "needs --momentum > 0" in seen["async-measgd"]["error"]


class _Session:
    """The job's ranks, never asked to train here."""

    def close(self):
        pass


def test_inside_a_job_servers_take_ranks_and_need_two_workers_beside_them(tmp_path):
    """Which candidates a plan inside a job tries (no launcher: the job's ranks): with
    servers, one of the job's ranks serves, so 3 ranks train 2 workers; 2 ranks would leave
    one worker, and ``--elastic`` keeps an asynchronous job's ranks in processes of their
    own: neither is tried. The synchronous strategies always are, on every rank."""
    from shoal.config import TrainConfig
    from shoal.plan.planner import Planner, PlanOptions

    def families(ranks, **changes):
        cfg = TrainConfig(model="mlp", dataset="digits", epochs=4, target_accuracy=0.9,
                          plan_candidates=("sync", "local-sgd", "groups", "async-measgd"),
                          progress="none", out=str(tmp_path), **changes).validate()
        planner = Planner(cfg, PlanOptions.of(cfg), None, tmp_path, ranks, show=False,
                          session=_Session())
        syncs, rest = planner.starts()
        assert [(c.strategy, c.workers) for c in syncs] == [("sync", ranks)]
        return {c.strategy: c.workers for c in rest}

    assert families(3) == {"local-sgd": 3, "groups": 2, "async-measgd": 2}
    assert families(2) == {"local-sgd": 2}
    assert families(3, elastic=True) == {"local-sgd": 3}


def test_a_job_of_several_hosts_of_several_processes_tries_one_replica_a_host(tmp_path):
    """Inside a job whose hosts run several processes each (2 hosts x 2 here), each periodic
    family is also tried one replica a host (``--host-sync``: synchronous inside a host, the
    strategy between hosts), walked from tau = 1 as the family is, in settings a run takes;
    ``groups`` has no such form, and a job of one host, or of one process a host, none."""
    from shoal.config import TrainConfig
    from shoal.plan.planner import Planner, PlanOptions

    cfg = TrainConfig(model="mlp", dataset="digits", epochs=4, target_accuracy=0.9,
                      plan_candidates=("sync", "local-sgd", "diloco", "groups"),
                      progress="none", out=str(tmp_path)).validate()

    def families(ranks, per_host):
        planner = Planner(cfg, PlanOptions.of(cfg), None, tmp_path, ranks, show=False,
                          session=_Session(), host_processes=per_host)
        return planner, planner.starts()[1]

    planner, rest = families(4, 2)
    assert [(c.strategy, c.options) for c in rest] == [
        ("local-sgd", (("tau", 1),)), ("diloco", (("tau", 1),)), ("groups", (("groups", 1),)),
        ("local-sgd", (("host_sync", True), ("tau", 1))),
        ("diloco", (("host_sync", True), ("tau", 1)))]
    walked = rest[-1].with_knob(16)
    assert dict(walked.options) == {"host_sync": True, "tau": 16}
    run = planner.config(walked, tmp_path / "trial").validate()
    assert run.strategy_options == {"host_sync": True, "tau": 16}
    for ranks, per_host in ((4, 4), (4, 1), (2, 2)):
        assert not any(dict(c.options).get("host_sync") for c in families(ranks, per_host)[1])
