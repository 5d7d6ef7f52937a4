"""--elastic under torchrun, mpirun and Slurm: each process the launcher started keeps its
rank's worker in a child (shoal.core.keeper), so a worker killed (kill -9) is not a failure
the launcher sees: the others go on, as under shoal's launcher, and the launcher exits 0;
every worker lost is one line and a failure. Real torchrun (--standalone), OpenMPI's mpirun,
MPICH's mpiexec (Hydra) and Slurm's srun where .ci/cluster-tools could set them up (a
one-node Slurm on this machine), and Slurm's tasks started with srun's variables. Gloo on
CPU."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from shoal.core.env import free_port

from conftest import (
    EPOCHS,
    MPIEXEC_HYDRA,
    REPO,
    TRAIN_ROWS,
    assert_each_sample_once,
    assert_went_on_without,
    launcher_variables,
    mpirun,
    mpirun_env,
    needs_mpich,
    needs_mpirun,
    needs_slurm,
    popen,
    run,
    shoal_env,
    slurm_ready,  # noqa: F401  (needs_slurm's condition reads it)
    wait_gone,
)

pytestmark = pytest.mark.timeout(240)


KILLED = ["train", "--dataset", "digits", "--epochs", str(EPOCHS), "--schedule", "constant",
          "--elastic", "--model", "tests.fixtures_models:killed_at", "--progress", "plain"]


def _kill_env(kill: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment in which rank(s) ``kill`` kill themselves at their 20th forward."""
    return {**(env or shoal_env(uuid.uuid4().hex)), "SHOAL_TEST_KILL_RANK": kill,
            "SHOAL_TEST_KILL_AT": "train:20"}


def _torchrun(tmp_path, procs: int, kill: str, *args: str,
              more: dict[str, str] | None = None):
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(procs), "-m", "shoal", *KILLED,
                "--out", str(tmp_path / "run"), *args], env={**_kill_env(kill), **(more or {})},
               timeout=200)


def _went_on_without_rank_2(out) -> None:
    assert_went_on_without(out, 2, 2)


def test_a_killed_worker_leaves_and_the_others_train_its_share_under_torchrun(tmp_path):
    # Rank 2 of 3 kills itself (SIGKILL) at its 20th training forward, mid-epoch 1.
    res = _torchrun(tmp_path, 3, "2", "--record-samples")
    assert res.returncode == 0, res.stderr
    assert res.stray == []
    assert "shoal: rank 2 killed by signal 9; the job goes on without it (--elastic)" \
        in res.stderr
    _went_on_without_rank_2(tmp_path / "run")


@pytest.mark.parametrize("in_exchange", [False, True])
def test_a_compute_groups_leader_lost_under_torchrun(tmp_path, in_exchange):
    """groups on 3 workers (ranks 1-3, server 0 first; groups 0-1 and 2): worker 0, a
    leader, is killed, and server 0 says so (torchrun says nothing of how a rank ended):
    worker 1 takes its place. Killed as its exchange starts, worker 1 leaves instead, and
    its reason stands in the summary (written before its pairs break, since server 0 reads
    it at once)."""
    res = _torchrun(tmp_path, 4, "1", "--strategy", "groups", "--groups", "2",
                    "--record-samples",
                    more={"SHOAL_TEST_KILL_IN_EXCHANGE": "1"} if in_exchange else None)
    assert res.returncode == 0, res.stderr
    assert res.stray == []
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["completed"] and summary["workers"] == (1 if in_exchange else 2)
    why = {c["left"][0]: c["why"][str(c["left"][0])] for c in summary["membership_changes"]}
    assert why == {0: "worker 0 killed by signal 9", **({1: (
        "worker 1 left: its compute group (workers 0-1) lost its leader (worker 0) in its "
        "exchange")} if in_exchange else {})}
    assert summary["membership_changes"][0].get("group_led_by") == (None if in_exchange else 1)
    assert_each_sample_once(tmp_path / "run", EPOCHS, TRAIN_ROWS)


def _launched(launcher: str, out) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a 3-rank job of KILLED (rank 2 killed) under a
    real ``launcher``: OpenMPI's mpirun (no launcher serves the store there: rank 0's keeper
    does, and stays until the keeper of the killed rank saw the job end; before, that keeper
    found the store gone: exit 1), MPICH's mpiexec (its ranks have PMI_RANK and PMI_SIZE),
    or srun with --kill-on-bad-exit (a task that fails ends the step)."""
    args = [*KILLED, "--record-samples", "--out", str(out)]
    if launcher == "mpirun":
        return mpirun(3, *args), _kill_env("2", mpirun_env())
    if launcher == "mpich":
        return [MPIEXEC_HYDRA, "-n", "3", "-genv", "MASTER_ADDR", "127.0.0.1", "-genv",
                "MASTER_PORT", str(free_port()), sys.executable, "-m", "shoal", *args], \
            _kill_env("2")
    return ["srun", "--ntasks", "3", "--overcommit", "--kill-on-bad-exit=1", "--immediate=30",
            "--chdir", str(REPO), sys.executable, "-m", "shoal", *args], \
        {**_kill_env("2"), "MASTER_PORT": str(free_port())}


@pytest.mark.parametrize("launcher", [pytest.param("mpirun", marks=needs_mpirun),
                                      pytest.param("mpich", marks=needs_mpich),
                                      pytest.param("srun", marks=needs_slurm)])
def test_a_killed_worker_leaves_and_the_others_train_its_share_under_a_real_launcher(
        tmp_path, launcher):
    """Rank 2's worker killed mid-epoch: its process (the keeper) exits 0, so the launcher
    sees no failed task and exits 0; the others trained its share."""
    out = tmp_path / "run"
    cmd, env = _launched(launcher, out)
    res = run(cmd, timeout=200, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stray == []
    assert "shoal: rank 2 killed by signal 9; the job goes on without it (--elastic)" \
        in res.stdout + res.stderr
    _went_on_without_rank_2(out)


@needs_slurm
def test_hogwild_runs_under_a_real_srun_of_one_node(tmp_path):
    """``srun -n 3`` on one node sets no SLURM_NTASKS_PER_NODE: its ranks read their node's
    count from SLURM_STEP_TASKS_PER_NODE. Before, each thought itself alone on its host and
    hogwild (one host's shared memory) was refused as spanning several."""
    out = tmp_path / "run"
    res = run(["srun", "--ntasks", "3", "--overcommit", "--kill-on-bad-exit=1", "--immediate=30",
               "--chdir", str(REPO), sys.executable, "-m", "shoal", "train", "--dataset",
               "digits", "--epochs", "2", "--strategy", "hogwild", "--progress", "plain",
               "--out", str(out)], timeout=120,
              env={**shoal_env(uuid.uuid4().hex), "MASTER_PORT": str(free_port())})
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and summary["workers"] == 2  # and its server


def test_a_killed_worker_leaves_and_the_others_train_its_share_under_slurm(tmp_path):
    """Three tasks with exactly the variables srun gives them (where no Slurm is): each task
    exits 0, rank 2's too (its keeper outlived its killed worker), so srun would see no
    failed task."""
    out, port, procs = tmp_path / "run", free_port(), []
    env = _kill_env("2")
    try:
        for rank in range(3):
            task = {**env, **launcher_variables("slurm", rank, 3, port)}
            procs.append(popen([sys.executable, "-m", "shoal", *KILLED, "--record-samples",
                                "--timeout", "60", "--out", str(out)], task, cwd=REPO,
                               stderr=subprocess.PIPE, text=True))
        errors = [p.communicate(timeout=150)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    assert "the job goes on without it (--elastic)" in errors[2]
    assert wait_gone(env["SHOAL_TEST_MARKER"], 5.0) == []
    _went_on_without_rank_2(out)


def test_every_worker_lost_under_torchrun_fails_the_job_in_one_line(tmp_path):
    res = _torchrun(tmp_path, 2, "0,1")
    assert res.returncode != 0
    assert res.stray == []
    assert "every worker was lost (rank 0 killed by signal 9; rank 1 killed by signal 9)" \
        in res.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


def test_the_join_secret_of_a_torchrun_job_is_checked_in_one_line(monkeypatch):
    from shoal.errors import ShoalError
    from shoal.train.membership.jobfile import JOIN_SECRET_VAR, join_secret

    monkeypatch.delenv(JOIN_SECRET_VAR, raising=False)
    assert join_secret() is None  # no secret: the job takes no joiners
    for bad in ("", "not hex", "ab" * 15):
        monkeypatch.setenv(JOIN_SECRET_VAR, bad)
        with pytest.raises(ShoalError, match=f"{JOIN_SECRET_VAR} must be a secret of at least 32"):
            join_secret()
    monkeypatch.setenv(JOIN_SECRET_VAR, "AB" * 16 + "\n")
    assert join_secret() == "ab" * 16


def test_a_joiner_gives_up_on_a_store_gone_within_its_connect_timeout(monkeypatch):
    # The job ended between shoal join reading its job file and the worker connecting: a
    # TCPStore client would retry for its whole timeout (the job's --timeout, 5 minutes).
    import socket
    import time

    from shoal.errors import ShoalError
    from shoal.train import join as joiner

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(joiner, "CONNECT_TIMEOUT", 1.0)
    began = time.monotonic()
    with pytest.raises(ShoalError, match=f"the job's store at 127.0.0.1:{port} does not answer"):
        joiner._store({"address": "127.0.0.1", "port": port, "key": "ab" * 32}, timeout=300.0)
    assert time.monotonic() - began < 30  # not the 300 s asked for the calls


def test_a_job_document_in_the_store_is_trusted_only_under_the_joiners_secret(monkeypatch):
    """A torchrun job's rank 0 signs the document it puts in the job's store with the join
    secret (``shoal join --store``): read back under the same secret it gives the job; under
    another, unsigned, not shoal's, absent, or without a secret: one line each."""
    import torch.distributed as dist

    from shoal.config import TrainConfig
    from shoal.errors import ShoalError
    from shoal.train.join import _address
    from shoal.train.membership.jobfile import (
        JOIN_SECRET_VAR,
        STORE_KEY,
        publish_in_store,
        read_job_in_store,
        withdraw_from_store,
    )

    store, secret = dist.HashStore(), "5a" * 32
    cfg = TrainConfig(dataset="digits", elastic=True, max_workers=4)
    monkeypatch.setenv(JOIN_SECRET_VAR, secret)
    with pytest.raises(ShoalError, match="holds no shoal job that takes joiners"):
        read_job_in_store(store, "10.0.0.1", 29500)
    publish_in_store(store, cfg, "10.0.0.1", 29500, secret, 3, attempt=2)
    job = read_job_in_store(store, "node0", 41000)
    assert (job["address"], job["port"], job["key"], job["attempt"], job["workers"],
            job["max_workers"]) == ("node0", 41000, secret, 2, 3, 4)
    assert job["config"].dataset == "digits" and job["config"].elastic
    monkeypatch.setenv(JOIN_SECRET_VAR, "a5" * 32)
    with pytest.raises(ShoalError, match=f"is not signed with the secret in {JOIN_SECRET_VAR}"):
        read_job_in_store(store, "node0", 41000)
    signed = json.loads(store.get(STORE_KEY))
    forged = json.dumps({**json.loads(signed["job"]), "workers": 1})
    store.set(STORE_KEY, json.dumps({"job": forged, "tag": signed["tag"]}))
    monkeypatch.setenv(JOIN_SECRET_VAR, secret)
    with pytest.raises(ShoalError, match="is not signed with the secret"):
        read_job_in_store(store, "node0", 41000)
    store.set(STORE_KEY, "not json")
    with pytest.raises(ShoalError, match="the job document in the store at node0:41000 is not "
                                         "shoal's"):
        read_job_in_store(store, "node0", 41000)
    monkeypatch.delenv(JOIN_SECRET_VAR)
    with pytest.raises(ShoalError, match="shoal join --store needs the job's secret"):
        read_job_in_store(store, "node0", 41000)
    withdraw_from_store(store)
    assert not store.check([STORE_KEY])
    assert _address("[::1]:29500") == ("::1", 29500)
    for bad in ("node0", "node0:x", ":29500", "node0:70000"):
        with pytest.raises(ShoalError, match="is not HOST:PORT"):
            _address(bad)


@pytest.mark.parametrize("args", [[], ["runs/x", "--store", "node0:29500"]])
def test_shoal_join_takes_out_or_a_store_in_one_line(capsys, args):
    from shoal.cli import main

    from conftest import one_error_line

    assert main(["join", *args]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        "shoal: error: shoal join takes the job's --out, or --store HOST:PORT (a torchrun, "
        "srun or mpirun job's, from a host that does not see its --out), not both")
