"""shoal's strategies in a Ray Train ``train_func`` (shoal.integrations.ray), on a local Ray.

One driver (tests/ray_job.py, a subprocess with a timeout) starts one Ray of 2 CPUs, on the
loopback interface only, and runs two ``TorchTrainer`` runs of one run name: 2 workers train
each strategy, then the README's example (examples/ray_diloco.py: streamed int4 DiLoCo)
checkpoints through ``ray.train.report``; 1 worker goes on from that checkpoint. Meanwhile
shoal's own loop (``shoal.launch``, 2 workers) trains the same cases here. Each Ray run's
parameters equal shoal's own loop with the same strategy, seed and data order, bit for bit;
the resumed one equals shoal's own loop resumed from the same checkpoint on one process.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

import shoal
from shoal.errors import ShoalError

from conftest import REPO, kill_job, needs, shoal_env, wait_gone

needs("ray")

import ray_job  # noqa: E402 - after the skip: it names the cases both sides train

DRIVER_TIMEOUT = 540  # seconds; 76 to 154 s on 2 cores that other test runs share (2026-12-06)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ray")
    temp = Path(tempfile.mkdtemp(prefix="shoalray-", dir="/tmp"))  # short: Ray's socket paths
    marker = uuid.uuid4().hex  # in the environment of the driver and of every Ray process
    env = {**shoal_env(marker), "RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_V2_ENABLED": "1",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # the node's address: the loopback one
           "OMP_NUM_THREADS": "1",
           # Ray Train's actors for spot preemption, metrics and its state's reconciliation:
           # a process each per run, a quarter of the test's CPU, none of it what is tested.
           "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_METRICS_ENABLED": "0",
           "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0"}
    with open(out / "driver.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "ray_job.py"), str(out),
                                 str(temp)], env=env, cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        shoal.launch(ray_job.reference, str(out / "reference"), workers=2)  # meanwhile
        try:
            proc.wait(timeout=DRIVER_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the Ray driver ran past {DRIVER_TIMEOUT} s:\n"
                        + (out / "driver.log").read_text()[-6000:])
        left = wait_gone(marker, timeout=15)  # ray.shutdown() ends them; the last may be exiting
    finally:
        kill_job(proc, marker)  # whatever happened: the driver's session and every Ray process
        shutil.rmtree(temp, ignore_errors=True)
    assert proc.returncode == 0, (out / "driver.log").read_text()[-6000:]
    return {"out": out, "result": json.loads((out / "result.json").read_text()), "left": left,
            "listening": json.loads((out / "listening.json").read_text())}


def load(path: Path | str) -> dict:
    return torch.load(path, weights_only=True)


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=0, rtol=0, msg=f"{what}: {key}")


@pytest.mark.parametrize("index, case", list(enumerate(ray_job.CASES)))
def test_each_strategy_equals_shoal_s_own_loop(runs, index, case):
    for rank in range(2):
        got = load(runs["out"] / "cases" / str(index) / f"rank{rank}.pt")
        own = load(runs["out"] / "reference" / str(index) / f"rank{rank}.pt")
        assert got["steps"] == own["steps"] == 45  # 1437 rows, 32 a step
        assert_same(got["model"], own["model"], f"{case}, rank {rank}'s model")
        assert_same(got["eval"], own["eval"], f"{case}, rank {rank}'s evaluated model")


def test_the_example_checkpoints_what_shoal_s_own_loop_trains(runs):
    from shoal.integrations.ray import OWN, SHARED

    last = Path(runs["result"]["first"][-1]["path"])
    shared = load(last / SHARED)
    assert (shared["workers"], shared["epochs"]) == (2, ray_job.EXAMPLE_EPOCHS)
    own = load(runs["out"] / "reference" / str(len(ray_job.CASES)) / "rank0.pt")
    assert_same(shared["shared"]["model"], own["eval"], "DiLoCo's global model")
    for rank in range(2):
        own = load(runs["out"] / "reference" / str(len(ray_job.CASES)) / f"rank{rank}.pt")
        saved = load(last / OWN.format(rank))["own"]
        assert_same(saved["model"], own["model"], f"rank {rank}'s model")
        assert saved["strategy"]["steps"] == own["steps"] == 2 * 45


def test_the_example_learns(runs):
    # Streamed int4 DiLoCo, 2 workers, 2 epochs of 45 steps (chance: 10 %).
    accuracy = [c["metrics"]["accuracy"] for c in runs["result"]["first"]]
    assert [c["metrics"]["epoch"] for c in runs["result"]["first"]] == [1, 2]
    assert accuracy[-1] > 0.6, accuracy


def test_a_checkpoint_resumes_on_another_number_of_workers(runs):
    from shoal.integrations.ray import OWN, SHARED

    second = runs["result"]["second"]
    assert [(c["metrics"]["epoch"], c["metrics"]["workers"]) for c in second] == [(3, 1)]
    assert second[0]["metrics"]["accuracy"] > 0.6
    # Rank 0 took its own part back (model, inner and outer optimizers, residual); rank 1's
    # inner state was left, its work already in the global model.
    assert runs["result"]["reference"] == {"first": 2, "loaded_equals_saved": True}
    last = Path(second[-1]["path"])
    assert load(last / SHARED)["workers"] == 1 and not (last / OWN.format(1)).exists()
    own = load(runs["out"] / "resumed_reference.pt")
    saved = load(last / OWN.format(0))["own"]
    assert saved["strategy"]["steps"] == own["steps"] == 2 * 45 + 90  # then 1437 rows, 16 a step
    assert_same(saved["model"], own["model"], "the resumed worker's model")
    assert_same(load(last / SHARED)["shared"]["model"], own["eval"], "the resumed global model")


def test_ray_is_gone_when_the_driver_ends(runs):
    assert runs["left"] == []


def test_ray_listens_on_the_loopback_interface_only(runs):
    sockets, store = runs["listening"]["sockets"], runs["listening"]["master_port"]
    assert any(s["process"].startswith("ray::RayTrainWorker") for s in sockets), sockets
    assert any("gcs_server" in s["process"] for s in sockets), sockets
    # All but the store of the process group Ray initialised (torch's TCPStore binds every
    # interface, whatever MASTER_ADDR says: the same under torchrun).
    assert [s for s in sockets if not s["loopback"] and s["port"] != store] == []


@pytest.mark.parametrize("name, options, message", [
    ("async-sgd", {}, "strategy async-sgd needs shoal to lay out its processes"),
    ("groups", {}, "strategy groups needs shoal to lay out its processes"),
    ("diloco", {"rho": 1}, "does not take --rho"),
    ("diloco", {}, "runs inside a Ray Train train_func"),
])
def test_what_cannot_run_is_one_line(name, options, message):
    from shoal.integrations import ray as shoal_ray

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ShoalError, match=message):
        shoal_ray.strategy(name, model, optimizer, **options)


def alone(name: str, rank: int = 0, world: int = 1, **options) -> shoal.Strategy:
    """A strategy of the example's model as rank ``rank`` of ``world``, with no process group
    (no Ray, no peers: its collectives return their input)."""
    from shoal.core.comm import Comm
    from shoal.core.place import Environment

    _, model, optimizer = ray_job.build()
    comm = Comm(Environment(rank=rank, world_size=world, local_rank=rank, local_world_size=world),
                torch.device("cpu"))
    return shoal.strategy(name, model, optimizer, comm, **options)


def test_on_as_many_workers_a_run_goes_on_exactly(tmp_path):
    from shoal.integrations import ray as shoal_ray

    rows = ray_job.build()[0].train.get_batch(torch.arange(160))  # 10 steps an epoch

    def fit(strategy: shoal.Strategy, epoch: int) -> None:
        for x, y in strategy.batches(rows, batch_size=16, epoch=epoch):
            strategy.backward(torch.nn.functional.cross_entropy(strategy.module(x), y))
            strategy.step()
            strategy.zero_grad()

    first = alone(*ray_job.EXAMPLE[:1], **ray_job.EXAMPLE[1])
    fit(first, 0)
    shoal_ray.save(first, tmp_path, epochs=1)
    again = alone(*ray_job.EXAMPLE[:1], **ray_job.EXAMPLE[1])
    assert shoal_ray.load(again, tmp_path) == 1
    fit(first, 1)
    fit(again, 1)
    assert again.steps == first.steps == 20
    assert_same(again.model.state_dict(), first.model.state_dict(), "the model")
    assert_same(again.eval_module.state_dict(), first.eval_module.state_dict(), "the global model")


def test_a_new_rank_takes_rank_0_s_part_without_its_residual(runs):
    from shoal.integrations import ray as shoal_ray

    checkpoint = Path(runs["result"]["first"][-1]["path"])  # of 2 workers
    third = alone(*ray_job.EXAMPLE[:1], rank=2, world=3, **ray_job.EXAMPLE[1])
    assert shoal_ray.load(third, checkpoint) == ray_job.EXAMPLE_EPOCHS
    rank0 = load(checkpoint / shoal_ray.OWN.format(0))["own"]
    assert_same(third.model.state_dict(), rank0["model"], "the new rank's model")
    assert_same(third.optimizer.state_dict()["state"][0], rank0["optimizer"]["state"][0],
                "the new rank's inner momentum")
    state = third.state_dict()
    assert state["steps"] == rank0["strategy"]["steps"]
    torch.testing.assert_close(state["theta"], rank0["strategy"]["theta"], atol=0, rtol=0)
    assert rank0["strategy"]["exchanges"]["residual"] is not None
    assert not state["exchanges"]["residual"].any()  # what int4 dropped is rank 0's to send


def test_a_checkpoint_goes_after_an_epoch_s_batches(tmp_path):
    from shoal.integrations import ray as shoal_ray

    strategy = alone("diloco", tau=8)
    data = ray_job.build()[0]
    for _ in strategy.batches(data.train, batch_size=16):
        with pytest.raises(ShoalError, match="after an epoch's batches"):
            shoal_ray.save(strategy, tmp_path, epochs=0)
        break


@pytest.mark.parametrize("name, options, message", [
    ("local-sgd", {"tau": 8}, "made with strategy diloco, this run has local-sgd"),
    ("diloco", {**ray_job.EXAMPLE[1], "tau": 4}, "made with --tau 8, this run has --tau 4"),
    ("diloco", {"tau": 8}, "made with --outer-precision int4, this run has --outer-precision fp32"),
])
def test_another_strategy_or_options_is_refused(tmp_path, name, options, message):
    from shoal.integrations import ray as shoal_ray

    shoal_ray.save(alone(*ray_job.EXAMPLE[:1], **ray_job.EXAMPLE[1]), tmp_path, epochs=0)
    with pytest.raises(ShoalError, match=message):
        shoal_ray.load(alone(name, **options), tmp_path)
    with pytest.raises(ShoalError, match="holds no checkpoint of shoal.integrations.ray"):
        shoal_ray.load(alone(name, **options), tmp_path / "elsewhere")
