"""``shoal train`` starts the server that forks its workers before it imports torch, only
where it will start processes here (shoal.cli.early)."""

from __future__ import annotations

import pytest

from shoal.cli.early import wants_workers


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
def test_only_a_train_that_starts_processes_starts_the_server_early(argv, wanted, monkeypatch):
    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert wants_workers(argv) is wanted


@pytest.mark.parametrize("variable", ["RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"])
def test_a_rank_of_an_outside_launcher_starts_no_server(variable, monkeypatch):
    """Under torchrun, srun or mpirun the command is itself a rank: it forks nothing."""
    monkeypatch.setenv(variable, "0")
    assert not wants_workers(["train", "--workers", "2"])
