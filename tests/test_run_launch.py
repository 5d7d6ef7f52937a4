"""Your own code on N local processes, no torchrun: ``shoal.launch(fn, workers=N)`` and
``shoal run --workers N SCRIPT``. Real processes, Gloo on CPU; a failing rank stops the job
within seconds, and nothing is left running."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import time
import uuid

import pytest
import torch

import shoal
from shoal.cli import main
from shoal.core.env import free_port

from conftest import marked_processes, one_error_line, run, shoal_env
from conftest import shoal as shoal_cli  # `python -m shoal ARGS`

pytestmark = pytest.mark.timeout(180)


@contextlib.contextmanager
def no_stray_workers():
    """Workers started inside carry a marker; none of them may outlive the block."""
    marker = uuid.uuid4().hex
    os.environ["SHOAL_TEST_MARKER"] = marker
    try:
        yield
    finally:
        del os.environ["SHOAL_TEST_MARKER"]
        assert marked_processes(marker) == [], "worker processes outlived shoal.launch"


# -- shoal.launch ------------------------------------------------------------------------------
def joined(scale: int) -> tuple[int, int, float, str]:
    comm = shoal.init()
    ones = torch.ones(3)
    comm.all_reduce(ones)
    return comm.rank, comm.world_size, ones[0].item(), f"{scale * (comm.rank + 1)}"


def test_launch_returns_every_ranks_value():
    with no_stray_workers():
        assert shoal.launch(joined, 10, workers=2) == [(0, 2, 2.0, "10"), (1, 2, 2.0, "20")]


def connects_late(here: str) -> bool:
    """Rank 1 takes 2 s past its process group's connections to say it joined; whether its
    file was there when ``shoal.init()`` returned."""
    import torch.distributed as dist

    said = os.path.join(here, "rank1")
    if os.environ["RANK"] == "1":
        join = dist.init_process_group

        def late(*args, **kwargs):
            join(*args, **kwargs)
            time.sleep(2)
            open(said, "w").close()

        dist.init_process_group = late
    shoal.init()
    return os.path.exists(said)


def test_init_returns_once_every_rank_has_joined_the_group(tmp_path):
    """A rank whose group was formed may return at once and end, cutting its connections: a
    rank still connecting to it failed to join (seen: "Gloo connectFullMesh failed ...
    Connection closed by peer"). shoal.init() returns once every rank's group is joined."""
    with no_stray_workers():
        assert shoal.launch(connects_late, str(tmp_path), workers=2) == [True, True]


def exits(codes: dict[int, int]) -> str:
    rank = int(os.environ["RANK"])
    if rank in codes:
        sys.exit(codes[rank])
    return "returned"


def test_sys_exit_zero_is_success_and_nonzero_a_failure():
    with no_stray_workers():
        assert shoal.launch(exits, {0: 0}, workers=2) == [None, "returned"]
        with pytest.raises(shoal.WorkerError, match="rank 1: worker process exited with code 3"):
            shoal.launch(exits, {1: 3}, workers=2)


def boom_on_rank1(stamp: str) -> None:
    comm = shoal.init()
    if comm.rank == 1:
        with open(stamp, "w") as f:
            f.write(str(time.time()))
        raise ValueError("boom")
    comm.barrier()  # the default timeout is 300 s: only the abort ends it sooner


def test_failing_rank_stops_a_rank_blocked_in_a_collective(tmp_path):
    stamp = tmp_path / "raised_at"
    start = time.monotonic()
    with no_stray_workers(), pytest.raises(shoal.WorkerError) as info:
        shoal.launch(boom_on_rank1, str(stamp), workers=2)
    assert str(info.value) == "rank 1: ValueError: boom"
    assert info.value.rank == 1 and "boom_on_rank1" in info.value.traceback
    assert time.time() - float(stamp.read_text()) < 10, "the other rank was not stopped in time"
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("workers", [0, -1, "2", 2.0, True])
def test_bad_worker_count_is_one_line(workers):
    with pytest.raises(shoal.ShoalError, match="workers=N with N >= 1"):
        shoal.launch(joined, 1, workers=workers)


STDIN_PROGRAM = """\
import torch, shoal

def rank_sum(offset):
    comm = shoal.init()
    t = torch.tensor([comm.rank + offset])
    comm.all_reduce(t)
    return t.item() * 10 + comm.rank

print("result", shoal.launch(rank_sum, 1, workers=2))
"""


def test_launch_from_a_program_on_stdin(tmp_path):
    """The function exists only in the piped program: it reaches the workers by value."""
    (tmp_path / "program.py").write_text(STDIN_PROGRAM)
    marker = uuid.uuid4().hex
    res = run(["sh", "-c", f"exec {shlex.quote(sys.executable)} - < program.py"],
              env=shoal_env(marker), cwd=tmp_path, timeout=90)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "result [30, 31]", res.stdout + res.stderr
    assert res.stray == []


# -- shoal run ---------------------------------------------------------------------------------
TRAIN_SCRIPT = """\
import argparse, json, sys
import torch
import shoal

parser = argparse.ArgumentParser()
parser.add_argument("--flag")
parser.add_argument("--out")
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
strategy = shoal.strategy("sync", model, optimizer)
comm = strategy.comm
for step in range(2):
    x = torch.randn(8, 4) * (comm.rank + 1)  # different data on each rank
    strategy.backward(strategy.module(x).pow(2).mean())
    strategy.step()
    strategy.zero_grad()
params = torch.cat([p.detach().flatten() for p in model.parameters()])
replicas = comm.gather_objects(params)
if comm.rank == 0:
    with open(args.out, "w") as f:
        json.dump({"argv": sys.argv, "flag": args.flag, "name": __name__, "world": comm.world_size,
                   "path0": sys.path[0], "equal": all(torch.equal(params, r) for r in replicas)}, f)
# no shoal.shutdown(): leaving the job is shoal's business
"""

NO_SHUTDOWN = """\
import sys
import torch, shoal
comm = shoal.init()
t = torch.ones(2)
comm.all_reduce(t)
sys.stdout.write(f"rank {comm.rank} sum {t[0].item()}\\n")  # one write: ranks share stdout
"""

FAILING_SCRIPT = """\
import sys, time
import shoal

comm = shoal.init()
if comm.rank == 1:
    with open(sys.argv[1], "w") as f:
        f.write(str(time.time()))
    raise ValueError("boom")
comm.barrier()  # the default timeout is 300 s: only the abort ends it sooner
"""


def test_run_a_script_with_its_arguments(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    out = tmp_path / "result.json"
    marker = uuid.uuid4().hex
    res = shoal_cli("run", "--workers", "2", str(script), "--flag", "x", "--out", str(out),
                    env=shoal_env(marker), timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(out.read_text())
    assert got["argv"] == [str(script), "--flag", "x", "--out", str(out)]
    assert (got["flag"], got["name"], got["world"]) == ("x", "__main__", 2)
    assert got["path0"] == str(tmp_path) and got["equal"]
    assert "terminate called" not in res.stderr and "Aborted" not in res.stderr, res.stderr
    assert res.stray == []


@pytest.mark.parametrize("form", ["script", "module", "script"])
def test_run_without_shutdown_ends_cleanly(tmp_path, form):
    """A script that never calls shoal.shutdown() leaves the job in order, every time (with
    the training script above, four runs: an exit that only sometimes ends in std::terminate
    shows up here)."""
    (tmp_path / "noshut.py").write_text(NO_SHUTDOWN)
    target = ["noshut.py"] if form == "script" else ["-m", "noshut"]
    res = run([sys.executable, "-m", "shoal", "run", "--workers", "2", *target], cwd=tmp_path,
              timeout=120)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["rank 0 sum 2.0", "rank 1 sum 2.0"], res.stdout
    assert "terminate called" not in res.stderr and "Aborted" not in res.stderr, res.stderr
    assert res.stray == []


@pytest.mark.parametrize("debug", [False, True])
def test_failing_script_is_one_line_and_stops_the_job(tmp_path, capfd, debug):
    # `shoal run` in this process (its own code path, minus an interpreter start-up; the
    # workers are real processes), stderr read at the descriptor: the workers' output too.
    script = tmp_path / "fail.py"
    script.write_text(FAILING_SCRIPT)
    stamp = tmp_path / "raised_at"
    flags = ["--debug"] if debug else []
    capfd.readouterr()
    with no_stray_workers():
        code = main(["run", *flags, "--workers", "2", str(script), str(stamp)])
    err = capfd.readouterr().err
    assert code == 1, err
    assert time.time() - float(stamp.read_text()) < 10, "the job was not stopped in time"
    if debug:
        assert "traceback on rank 1" in err and 'raise ValueError("boom")' in err
    else:
        line = one_error_line(err)
        assert line.startswith("shoal: error: rank 1: ValueError: boom"), line


@pytest.mark.parametrize("target, message", [
    (["missing.py"], "no such file: missing.py"),
    (["-m", "no_such_module_here"], "no module named 'no_such_module_here'"),
    ([], "give a SCRIPT or -m MODULE to run (see shoal run --help)"),
])
def test_missing_script_is_one_line(capsys, target, message):
    # In-process: refused before any worker starts; one prefix, not "shoal: error: shoal run:"
    assert main(["run", "--workers", "2", *target]) == 2
    assert one_error_line(capsys.readouterr().err) == f"shoal: error: {message}"


# -- a plain script under torchrun's variables: atexit and excepthook ----------------------------
def two_ranks(tmp_path, program: str, *args: str) -> tuple[list[int], str]:
    """Start ``program`` twice with torchrun's variables (ranks 0 and 1) and wait for both."""
    (tmp_path / "job.py").write_text(program)
    python = shlex.quote(sys.executable)
    common = f"WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={free_port()}"
    rest = " ".join(shlex.quote(a) for a in args)
    line = (f"{common} RANK=0 LOCAL_RANK=0 {python} job.py {rest} & r0=$!; "
            f"{common} RANK=1 LOCAL_RANK=1 {python} job.py {rest} & r1=$!; "
            "wait $r0; c0=$?; wait $r1; c1=$?; echo codes $c0 $c1")
    marker = uuid.uuid4().hex
    res = run(["sh", "-c", line], env=shoal_env(marker), cwd=tmp_path, timeout=120)
    assert res.stray == []
    codes = res.stdout.strip().splitlines()[-1].split()[1:]
    return [int(c) for c in codes], res.stdout + res.stderr


def test_torchrun_style_script_without_shutdown_exits_cleanly(tmp_path):
    codes, output = two_ranks(tmp_path, NO_SHUTDOWN)
    assert codes == [0, 0], output
    assert "terminate called" not in output and "Aborted" not in output, output


def test_uncaught_exception_under_torchrun_stops_the_other_rank(tmp_path):
    stamp = tmp_path / "raised_at"
    codes, output = two_ranks(tmp_path, FAILING_SCRIPT, str(stamp))
    assert codes[1] == 1 and codes[0] != 0, output
    assert time.time() - float(stamp.read_text()) < 10, output
    assert "ValueError: boom" in output


SIGTERM_IN_RENDEZVOUS = """
import os, signal, sys, time
import shoal
from shoal.errors import Terminated


def rank(launcher):
    from shoal.core.env import rank_environment
    from shoal.core.group import all_joined, job_store
    from shoal.core.stop import stop_on_sigterm

    env = rank_environment()
    store = job_store(env, 60)
    if env.rank == 1:
        time.sleep(60)  # never says it connected (the launcher's SIGTERM ends it)
    stop_on_sigterm()  # as shoal train's workers take SIGTERM
    os.kill(launcher, signal.SIGTERM)  # as Slurm's notice reaches the launcher
    all_joined(store, env, 60, what="connected")  # SIGTERM ends the wait: Terminated


if __name__ == "__main__":
    try:
        shoal.launch(rank, os.getpid(), workers=2)
    except Terminated as exc:
        print("stop:", exc)
        sys.exit(143)
    except Exception as exc:
        print("failure:", type(exc).__name__, exc)
        sys.exit(2)
"""


def test_a_rank_that_sigterm_stops_in_the_rendezvous_makes_the_job_a_stop(tmp_path):
    """SIGTERM to the launcher while rank 0 waits for rank 1 to say it connected (as
    ``shoal.init`` does after the group forms): rank 0's wait ends with ``Terminated``, and
    the job is a stop (``shoal.launch`` raises ``Terminated``: the command's status 143), as
    when a rank was still importing; not a failure of rank 0 (``shoal train`` failed with
    status 2 so, now and then, when the SIGTERM found a rank in that wait)."""
    script = tmp_path / "job.py"
    script.write_text(SIGTERM_IN_RENDEZVOUS)
    res = run([sys.executable, str(script)], timeout=60, env=shoal_env(uuid.uuid4().hex))
    assert res.returncode == 143, res.stdout + res.stderr
    assert res.stdout.startswith("stop: stopped by SIGTERM"), res.stdout
    assert not res.stray
