"""``shoal train`` starts the server that forks its workers before it imports torch, only
where it will start processes here (shoal.cli.early)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shoal.cli.early import wants_workers

from conftest import shoal_env

#: What torchrun, srun and OpenMPI's and MPICH's mpirun tell each rank they start.
LAUNCHERS = {
    "torchrun": {"RANK": "0", "WORLD_SIZE": "2"},
    "srun": {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "127.0.0.1"},
    "openmpi": {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1"},
    "mpich": {"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
}


@pytest.fixture
def no_launcher(monkeypatch):
    """No outside launcher's variable in this process's environment."""
    for name in {name for variables in LAUNCHERS.values() for name in variables}:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(("argv", "wanted"), [
    (["train", "--workers", "2"], True),
    (["train", "--workers=4", "--strategy", "easgd"], True),
    (["train", "--workers", "2", "--workers", "1"], False),  # the last one counts, as argparse
    (["train"], False),  # one worker on a CPU
    (["train", "--workers", "1"], False),
    (["train", "--workers", "1", "--max-restarts", "2"], True),  # restarts run in a process
    (["train", "--config", "job.yaml"], True),  # may say more workers
    (["train", "--workers", "2", "--help"], False),
    (["run", "--workers", "2", "x.py"], False),
    ([], False),
])
def test_only_a_train_that_starts_processes_starts_the_server_early(argv, wanted, no_launcher):
    assert wants_workers(argv) is wanted


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_a_rank_of_an_outside_launcher_starts_no_server(launcher, no_launcher):
    """Under torchrun, srun or mpirun the command is itself a rank: it forks nothing. Which
    variables say so is ``shoal train``'s own reading (shoal.core.env)."""
    for name, value in LAUNCHERS[launcher].items():
        no_launcher.setenv(name, value)
    assert not wants_workers(["train", "--workers", "2"])


def test_deciding_imports_no_torch():
    """What decides (the arguments, shoal.core.env's reading of the launchers' variables)
    imports no torch: else the server would start no sooner than before."""
    code = "import sys, shoal.cli.early; print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=shoal_env(), timeout=120)
    assert res.stdout.strip() == "False", res.stdout + res.stderr
