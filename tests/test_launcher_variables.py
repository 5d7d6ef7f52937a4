"""Each launcher's variables, exactly as it sets them for one of its processes, read into
that process's place in the job; a partial set is completed the way its launcher means it
or refused in one line, never a job of one (issue 58).

Where each set comes from (the launchers' own code):
torchrun: ``torch.distributed.elastic.agent.server.local_elastic_agent`` (every worker);
Slurm: srun's task environment; OpenMPI, MPICH/Hydra, Intel MPI, MVAPICH2: their mpirun;
Lightning: ``_SubprocessScriptLauncher._call_children_scripts`` (lightning 2.6) sets
``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` =
devices x nodes, and its DDP strategy takes rank ``NODE_RANK x devices + LOCAL_RANK``;
Accelerate: ``accelerate launch --multi_gpu`` runs torchrun and adds its ``ACCELERATE_*``
settings, ``--mpirun_hostfile`` runs mpirun with ``MASTER_ADDR``/``MASTER_PORT``
(accelerate 1.16, ``utils/launch.py``); Ray Train: ``_set_torch_distributed_env_vars``
(ray 2.x, ``ray/train/torch/config.py``) before the training function.
"""

from __future__ import annotations

import pytest

import shoal
from shoal.core.env import detect_environment
from shoal.errors import ShoalError

from conftest import one_error_line

STORE = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
TORCHRUN = {**STORE, "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "5", "ROLE_WORLD_SIZE": "8",
            "ROLE_NAME": "default", "TORCHELASTIC_RESTART_COUNT": "2",
            "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "none",
            "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1"}
ACCELERATE = {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO",
              "ACCELERATE_DYNAMO_MODE": "default", "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False"}
MVAPICH2 = {"MV2_COMM_WORLD_RANK": "5", "MV2_COMM_WORLD_SIZE": "8",
            "MV2_COMM_WORLD_LOCAL_RANK": "1", "MV2_COMM_WORLD_LOCAL_SIZE": "4"}

#: launcher convention -> (its variables for one process, that process's
#: (rank, world size, local rank, local world size, store address, store port, launcher)).
CONVENTIONS = {
    "torchrun": (TORCHRUN, (5, 8, 1, 4, "10.0.0.1", 29400, "torchrun")),
    "slurm": ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
               "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_ID": "77",
               "SLURM_STEP_NUM_TASKS": "8", "SLURM_JOB_NODELIST": "n[1-2]"},
              (5, 8, 1, 4, "n1", 10077, "slurm")),
    "openmpi": ({**STORE, "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
                 "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                 "OMPI_COMM_WORLD_NODE_RANK": "1"}, (5, 8, 1, 4, "10.0.0.1", 29400, "mpi")),
    "mpich": ({**STORE, "PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1",
               "MPI_LOCALNRANKS": "4", "PMI_FD": "9"}, (5, 8, 1, 4, "10.0.0.1", 29400, "mpi")),
    "lightning": ({**STORE, "WORLD_SIZE": "4", "LOCAL_RANK": "3", "NODE_RANK": "0"},
                  (3, 4, 3, 4, "10.0.0.1", 29400, "lightning")),
    # Across nodes the devices of a node must be given: Lightning does not export them.
    "lightning, node 1 of 2": ({**STORE, "WORLD_SIZE": "8", "LOCAL_RANK": "1", "NODE_RANK": "1",
                                "LOCAL_WORLD_SIZE": "4"},
                               (5, 8, 1, 4, "10.0.0.1", 29400, "lightning")),
    "lightning, node from GROUP_RANK": ({**STORE, "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                         "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "4"},
                                        (5, 8, 1, 4, "10.0.0.1", 29400, "lightning")),
    "accelerate launch --multi_gpu": ({**TORCHRUN, **ACCELERATE},
                                      (5, 8, 1, 4, "10.0.0.1", 29400, "torchrun")),
    "accelerate launch --mpirun_hostfile (MVAPICH2)": (
        {**STORE, **ACCELERATE, **MVAPICH2, "ACCELERATE_USE_CPU": "True"},
        (5, 8, 1, 4, "10.0.0.1", 29400, "mpi")),
    "ray train": ({**STORE, "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                   "LOCAL_WORLD_SIZE": "4", "NODE_RANK": "1", "ACCELERATE_TORCH_DEVICE": "cpu"},
                  (5, 8, 1, 4, "10.0.0.1", 29400, "torchrun")),
}


def place(env):
    return (env.rank, env.world_size, env.local_rank, env.local_world_size, env.master_addr,
            env.master_port, env.launcher)


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_each_launcher_s_variables_give_this_process_its_place(convention):
    variables, expected = CONVENTIONS[convention]
    assert place(detect_environment(variables)) == expected


def test_torchrun_s_agent_store_and_attempt_are_kept():
    env = detect_environment(TORCHRUN)
    assert env.agent_store and env.attempt == 2


def test_lightning_s_ranks_on_one_node_are_its_local_ranks():
    ranks = [detect_environment({**STORE, "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                                 "NODE_RANK": "0"}) for r in range(2)]
    assert [(e.rank, e.world_size, e.local_world_size) for e in ranks] == [(0, 2, 2), (1, 2, 2)]


@pytest.mark.parametrize("variables", [
    {}, {"WORLD_SIZE": "1"}, {**STORE, "WORLD_SIZE": "1", "LOCAL_RANK": "0", "NODE_RANK": "0"},
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, {**STORE, "PMI_RANK": "0", "PMI_SIZE": "1"},
    {**STORE, "ACCELERATE_USE_CPU": "True"},  # accelerate launch --cpu: one process
], ids=["nothing", "world of one", "lightning, one device", "one slurm task", "one mpi rank",
        "accelerate launch --cpu"])
def test_a_process_on_its_own_is_no_job(variables):
    assert detect_environment(variables) is None


@pytest.mark.parametrize("variables, message", [
    ({**STORE, "WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but not this process's rank"),
    ({"RANK": "1"}, "RANK=1 is set but WORLD_SIZE is not"),
    ({"LOCAL_RANK": "1", "NODE_RANK": "0"}, "LOCAL_RANK=1 is set but no WORLD_SIZE"),
    ({**STORE, "WORLD_SIZE": "4", "LOCAL_RANK": "1", "NODE_RANK": "1"},
     "NODE_RANK=1, LOCAL_RANK=1, WORLD_SIZE=4 and no RANK (Lightning's launcher)"),
    ({**STORE, "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3"},
     "LOCAL_RANK=1, LOCAL_WORLD_SIZE=3 and WORLD_SIZE=4 (Lightning's launcher) are not"),
    ({**STORE, "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
     "LOCAL_RANK=2, LOCAL_WORLD_SIZE=2 and WORLD_SIZE=4"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "torchrun's variables put this process at rank 2 of a job of 2"),
    ({**STORE, "OMPI_COMM_WORLD_RANK": "-1", "OMPI_COMM_WORLD_SIZE": "2"},
     "mpi's variables put this process at rank -1"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 is not a number of processes"),
    ({**STORE, "WORLD_SIZE": "two", "LOCAL_RANK": "0"},
     "environment variable WORLD_SIZE='two' is not an integer"),
], ids=["world without rank", "rank without world", "local rank without world",
        "lightning node 1 without its devices", "lightning uneven nodes",
        "lightning local rank past its node", "rank past the world", "negative rank",
        "empty world", "not a number"])
def test_a_partial_or_impossible_set_is_one_clear_error(variables, message):
    with pytest.raises(ShoalError) as exc:
        detect_environment(variables)
    assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


@pytest.fixture
def partial_launcher(monkeypatch):
    """This process inside a launcher's partial environment: a job of 2, no rank."""
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**STORE, "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)


def test_shoal_init_refuses_a_partial_environment(partial_launcher):
    """Before issue 58 this was a job of one: every collective returned its input."""
    with pytest.raises(ShoalError, match="WORLD_SIZE=2 is set but not this process's rank"):
        shoal.init(device="cpu")


def test_shoal_train_refuses_it_in_one_line(partial_launcher, tmp_path, capsys):
    from shoal.cli import main

    assert main(["train", "--out", str(tmp_path), "--model", "lenet5", "--dataset", "digits"]) != 0
    assert "WORLD_SIZE=2 is set but not this process's rank" in one_error_line(capsys.readouterr().err)
