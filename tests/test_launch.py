import logging

import pytest

from shoal.core.env import detect_environment
from shoal.core.launchers import expand_hostlist
from shoal.core.processes import spawn
from shoal.errors import ShoalError, WorkerError


def test_plain_process_is_not_in_a_job():
    assert detect_environment({}) is None


def test_torchrun_variables():
    env = detect_environment({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                              "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n1",
                              "MASTER_PORT": "1234", "TORCHELASTIC_RUN_ID": "x"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 8, 1, 2)
    assert (env.master_addr, env.master_port, env.launcher) == ("n1", 1234, "torchrun")


def test_slurm_variables_take_master_from_the_node_list():
    env = detect_environment({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                              "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_ID": "4242",
                              "SLURM_JOB_NODELIST": "gpu[07-08]"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert env.master_addr == "gpu07" and env.launcher == "slurm"
    assert env.master_port == 10000 + 4242


@pytest.mark.parametrize("node, per_node, here", [
    ("1", "2(x2)", 2), ("0", "3,2(x2),1", 3), ("2", "3,2(x2),1", 2), ("3", "3,2(x2),1", 1),
    ("7", "3,2(x2),1", 1), ("0", "garbled", 1)])
def test_slurm_tasks_on_this_node_come_from_the_steps_tasks_per_node(node, per_node, here):
    """``srun -N 2 -n 4`` sets no SLURM_NTASKS_PER_NODE, only SLURM_STEP_TASKS_PER_NODE
    ``2(x2)`` (as a real srun across two emulated nodes showed): each node's ranks are its
    entry, so that they share its cores; before, each took 1 and so every core."""
    env = detect_environment({"SLURM_PROCID": "2", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0",
                              "SLURM_NODEID": node, "SLURM_STEP_TASKS_PER_NODE": per_node,
                              "SLURM_JOB_NODELIST": "n[1-4]"})
    assert env.local_world_size == here


def test_single_task_slurm_allocation_spawns_locally():
    assert detect_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None


def test_openmpi_and_mpich_variables():
    ompi = detect_environment({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2",
                               "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                               "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "h0"})
    assert (ompi.rank, ompi.world_size, ompi.local_world_size, ompi.launcher) == (2, 4, 2, "mpi")
    mpich = detect_environment({"PMI_SIZE": "2", "PMI_RANK": "1", "MASTER_ADDR": "h0"})
    assert (mpich.rank, mpich.world_size) == (1, 2)


def test_mpiexec_inside_a_slurm_allocation_is_told_from_srun():
    """``salloc -N 2 -n 4 mpiexec.hydra -bootstrap slurm -n 4``: each rank has its MPI rank
    and its node's proxy's SLURM_PROCID (as a real one across two emulated nodes gave them).
    Before, Slurm's were read first: ranks 0 and 1 both took rank 0. Every rank must decide
    alike: rank 0, whose ids agree (0 and 0), is the MPI job's too (a first fix let it take
    srun's port while the others took MPI's, and the job hung). ``srun --mpi=pmi2`` gives
    PMI variables that agree with srun's on every rank: srun's job."""
    node = {"PMI_SIZE": "4", "MPI_LOCALNRANKS": "2", "SLURM_NTASKS": "4",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
            "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "7", "MASTER_ADDR": "node1"}
    ranks = [detect_environment({**node, "PMI_RANK": str(r), "MPI_LOCALRANKID": str(r % 2),
                                 "SLURM_PROCID": str(r // 2), "SLURM_NODEID": str(r // 2)})
             for r in range(4)]
    assert [(e.rank, e.world_size, e.local_world_size, e.launcher) for e in ranks] == \
        [(r, 4, 2, "mpi") for r in range(4)]
    assert len({e.master_port for e in ranks}) == 1
    srun = [detect_environment({**node, "SLURM_STEP_NUM_TASKS": "4", "PMI_RANK": str(r),
                                "SLURM_PROCID": str(r), "SLURM_NODEID": str(r // 2),
                                "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}) for r in range(4)]
    assert [(e.rank, e.world_size, e.local_world_size, e.launcher) for e in srun] == \
        [(r, 4, 2, "slurm") for r in range(4)]


def test_mpi_without_master_addr_is_a_clear_error():
    with pytest.raises(ShoalError, match="MASTER_ADDR"):
        detect_environment({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"})


def test_bad_rank_variable_is_named():
    with pytest.raises(ShoalError, match="RANK"):
        detect_environment({"RANK": "x", "WORLD_SIZE": "2"})


@pytest.mark.parametrize("nodelist, hosts", [
    ("node1", ["node1"]),
    ("a[1-3]", ["a1", "a2", "a3"]),
    ("gpu[01-03,7],login1", ["gpu01", "gpu02", "gpu03", "gpu7", "login1"]),
    ("r[8-10]-ib", ["r8-ib", "r9-ib", "r10-ib"]),
])
def test_expand_hostlist(nodelist, hosts):
    assert expand_hostlist(nodelist) == hosts


# -- spawn: a rank that crashes after finishing is a warning, before finishing an error ------
def _value_then_abort_at_exit(value: int) -> int:
    import atexit
    import os
    import signal

    # As torch's C++ teardown sometimes does at interpreter exit (std::terminate, signal 6).
    atexit.register(os.kill, os.getpid(), signal.SIGABRT)
    return value


def _abort_on_rank_1() -> int:
    import os
    import signal

    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGABRT)
    return 0


def test_crash_after_finishing_keeps_the_results(caplog):
    assert spawn(2, _value_then_abort_at_exit, (7,)) == [7, 7]
    err = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "rank 1 finished its work, then its process died while exiting (killed by signal 6)" in err


def test_crash_before_finishing_is_an_error():
    with pytest.raises(WorkerError, match="rank 1: worker process killed by signal 6"):
        spawn(2, _abort_on_rank_1)


# -- each strategy's layout of a job: its Topology ---------------------------------------------
def _topology(strategy, workers, **options):
    from shoal.strategies import get_strategy, make_options

    cls = get_strategy(strategy)
    return cls.topology(make_options(cls, options), workers)


def test_every_rank_of_a_synchronous_job_is_a_worker_of_one_group():
    t = _topology("local-sgd", 4)
    assert (t.servers, t.workers, t.world_size, t.groups) == (0, 4, 4, ((0, 4),))
    assert [str(t.role(r)) for r in range(4)] == [f"worker {r}" for r in range(4)]
    assert not t.detached and not t.shares_gpus


def test_an_asynchronous_job_puts_its_servers_first():
    t = _topology("async-sgd", 3, servers=2)
    assert (t.servers, t.world_size, t.detached, t.shares_gpus) == (2, 5, True, True)
    assert [str(t.role(r)) for r in range(5)] == ["server 0", "server 1", "worker 0",
                                                  "worker 1", "worker 2"]
    assert t.groups == ((0, 1), (1, 2), (2, 3))  # each worker alone
    with pytest.raises(ShoalError, match="rank 5 is outside a job of 5 processes"):
        t.role(5)
    assert _topology("hogwild", 2).shared_memory and not _topology("async-easgd", 2).shared_memory


def test_compute_groups_are_the_groups_of_the_topology():
    t = _topology("groups", 5, groups=2)
    assert t.groups == ((0, 3), (3, 5)) and t.group(4) == (3, 5) and not t.shares_gpus
    assert _topology("groups", 3, groups=3).shares_gpus  # groups of one meet in no NCCL group


def test_a_worker_s_place_on_two_hosts_of_torchrun():
    """Two hosts of 3 ranks, one server: the server is rank 0 on the first host; the workers
    are ranks 0..4 of the workers, two on the first host and three on the second."""
    from shoal.core.env import Environment

    t = _topology("async-sgd", 5)
    places = [t.place(Environment(rank=r, world_size=6, local_rank=r % 3, local_world_size=3))
              for r in range(6)]
    assert [(p.rank, p.world_size, p.local_rank, p.local_world_size) for p in places] == [
        (0, 5, 0, 1),  # server 0 speaks for the 5 workers (the records)
        (0, 5, 0, 2), (1, 5, 1, 2), (2, 5, 0, 3), (3, 5, 1, 3), (4, 5, 2, 3)]


@pytest.mark.parametrize("workers, world, message", [
    (3, 3, "--workers 3 and --servers 1 contradict the launcher's world size 3 (torchrun)"),
    (None, 1, "--servers 1 needs at least 2 ranks; the launcher started 1"),
])
def test_an_outside_launcher_s_world_must_fit_the_topology(workers, world, message):
    from shoal.config import TrainConfig
    from shoal.core.env import Environment
    from shoal.train.launch import outside_topology

    cfg = TrainConfig(strategy="async-sgd", workers=workers)
    with pytest.raises(ShoalError) as exc:
        outside_topology(cfg, Environment(rank=0, world_size=world, launcher="torchrun"))
    assert str(exc.value).startswith(message)
    assert outside_topology(TrainConfig(strategy="async-sgd"),
                            Environment(rank=0, world_size=4)).workers == 3
