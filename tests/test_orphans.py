"""No process of a shoal job outlives its launcher, whatever kills it and when; counts that
become processes are bounded before anything starts; SIGTERM during start-up stops all.

Real jobs (``shoal train`` synchronous and asynchronous, ``shoal run``) are caught in each
phase, detected from the process tree and the files the job writes rather than by sleeping:

- start-up: the moment the first worker process exists (it has not run a line of its own);
- rendezvous: rank 0 is stopped (SIGSTOP) once it has begun importing torch, and every
  other rank is connected to the job's store, waiting for it;
- training: ``metrics.jsonl`` (or, for ``shoal run``, a file the script writes) has a record;
- shutdown: the last rank's work is done and its interpreter holds in its exit.

Then the launcher gets ``kill -9``, and every process of the job (all carry the test's
marker in their environment: workers, servers, DataLoader processes, the multiprocessing
resource tracker) must be gone within seconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from conftest import (
    MPIRUN_TRIES,
    children_of,
    command_process,
    kill_job,
    listening_sockets,
    loads_torch,
    mpirun,
    mpirun_failed_to_start,
    needs_mpirun,
    one_error_line,
    popen,
    shoal_env,
    started_by,
    wait_gone,
)

#: Seconds the job's processes get to go once their launcher is killed.
GONE_S = 5.0
TINY = ["--model", "tests.fixtures_models:held_at_exit", "--dataset", "digits",
        "--progress", "none", "--log-every", "1", "--timeout", "60"]
JOBS = {
    "sync": ["train", "--workers", "2", *TINY],
    "async": ["train", "--strategy", "async-sgd", "--workers", "2", *TINY],
}
#: ``shoal run``'s script: join, then train forever (a file says it has begun), or, in the
#: shutdown phase, return at once with rank 1 holding in its interpreter's exit.
SCRIPT = textwrap.dedent("""
    import atexit, os, time
    import torch, torch.distributed as dist
    import shoal

    shoal.init()
    here = os.environ["SHOAL_TEST_DIR"]
    if os.environ["SHOAL_TEST_PHASE"] == "shutdown":
        if dist.get_rank() == 1:
            atexit.register(lambda: (open(os.path.join(here, "exiting"), "w").close(),
                                     time.sleep(120)))
    else:
        t = torch.ones(1)
        while True:
            dist.all_reduce(t)
            open(os.path.join(here, "training"), "w").close()
            time.sleep(0.01)
""")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _connected_to(pid: int, port: int) -> bool:
    """Whether ``pid`` holds a TCP connection to 127.0.0.1:``port``."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):  # 127.0.0.1 or ::ffff:127.0.0.1
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and fields[9] in inodes and fields[2].endswith(
                    f"0100007F:{port:04X}"):
                return True
    return False


class Job:
    """A job started as the test's own launcher would be (a new session, the test's marker
    in its environment); leaving the block kills whatever of it is left, by pid."""

    def __init__(self, args: list[str], tmp_path: Path, **env: str) -> None:
        self.marker = uuid.uuid4().hex
        self.dir = tmp_path
        self.log = tmp_path / "launcher.log"
        self.args, self.env, self.tries = args, {**shoal_env(self.marker), **env}, 1
        self._start()

    def _start(self) -> None:
        with open(self.log, "wb") as log:
            self.proc = popen(self.args, env=self.env, cwd=self.dir, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        kill_job(self.proc, self.marker)

    def workers(self) -> list[int]:
        """The launcher's worker (and server) processes, in the order they started."""
        return started_by(self.proc.pid)

    def wait_until(self, what: str, ready, timeout: float = 90.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = ready()
            if value:
                return value
            if self.proc.poll() is not None:
                if (mpirun_failed_to_start(self.args, self.log.read_text())
                        and self.tries < MPIRUN_TRIES):
                    self.tries += 1
                    self._start()
                    continue
                pytest.fail(f"the launcher ended before {what}:\n{self.log.read_text()}")
            time.sleep(0.005)
        pytest.fail(f"no {what} within {timeout:.0f} s:\n{self.log.read_text()}")

    def kill_launcher(self) -> None:
        """kill -9 the launcher; every other process of the job must be gone within
        :data:`GONE_S` seconds."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        left = wait_gone(self.marker, GONE_S)
        assert left == [], "outlived the launcher: " + "; ".join(
            f"{pid} (parent {Path(f'/proc/{pid}/stat').read_text().split(')')[1].split()[1]}): "
            f"{_cmdline(pid)[:120]}" for pid in left if Path(f"/proc/{pid}").exists())


def _hold_rendezvous(job: Job, ranks: int) -> None:
    """Stop rank 0 once it has reached the job's store (past its first line, which ties it to
    its parent), then wait until the other ranks are connected to the store, waiting for it."""
    first = job.wait_until("worker process", lambda: job.workers()[:1])[0]
    ports = job.wait_until("the job's store", lambda: [
        port for _, addr, port in listening_sockets([command_process(job.proc.pid)]) if addr == "127.0.0.1"])
    assert len(ports) == 1, ports  # the command serves the job's store, nothing else
    job.wait_until("rank 0 at the job's store", lambda: _connected_to(first, ports[0]))
    os.kill(first, signal.SIGSTOP)
    job.wait_until("rank waiting in the rendezvous", lambda: len(job.workers()) == ranks and all(
        _connected_to(pid, ports[0]) for pid in job.workers() if pid != first))


def _has_records(out: Path) -> bool:
    records = out / "metrics.jsonl"
    return records.exists() and records.stat().st_size > 0


def _command(kind: str, tmp_path: Path) -> tuple[list[str], int]:
    """The command line of a job of ``kind``, and its number of ranks."""
    if kind == "run":
        (tmp_path / "loop.py").write_text(SCRIPT)
        return [sys.executable, "-m", "shoal", "run", "--workers", "2", "loop.py"], 2
    return [sys.executable, "-m", "shoal", *JOBS[kind], "--out", "out"], 3 if kind == "async" else 2


# The start-up phase is a fresh interpreter's: its first worker imports torch (cold). The
# others' commands are forked from the warm interpreter (conftest.popen), as their workers are.
@pytest.mark.parametrize("phase", [pytest.param("start-up", marks=pytest.mark.cold),
                                   "rendezvous", "training", "shutdown"])
@pytest.mark.parametrize("kind", ["sync", "async", "run"])
def test_nothing_outlives_a_killed_launcher(tmp_path, kind, phase):
    cmd, ranks = _command(kind, tmp_path)
    if kind != "run":
        cmd += ["--epochs", "1" if phase == "shutdown" else "1000"]
    hold = tmp_path / "exiting"
    env = {"SHOAL_TEST_DIR": str(tmp_path), "SHOAL_TEST_PHASE": phase,
           "SHOAL_TEST_HOLD_RANK": str(ranks - 1), "SHOAL_TEST_HOLD_FILE": str(hold)}
    with Job(cmd, tmp_path, **env) as job:
        if phase == "start-up":
            job.wait_until("worker process", job.workers)
        elif phase == "rendezvous":
            _hold_rendezvous(job, ranks)
        elif phase == "training":
            if kind == "run":
                job.wait_until("training", (tmp_path / "training").exists)
            else:
                job.wait_until("training", lambda: _has_records(tmp_path / "out"))
        else:
            job.wait_until("rank holding in its exit", hold.exists)
        job.kill_launcher()


@needs_mpirun
@pytest.mark.parametrize("flags", [
    ["--elastic"],  # the rank keepers, and their workers with them
    ["--strategy", "auto", "--target-accuracy", "0.999", "--plan-candidates", "sync,local-sgd"],
], ids=["elastic", "auto"])
def test_nothing_outlives_a_killed_mpirun(tmp_path, flags):
    """A rank mpirun started dies with mpirun (prterun, which the wheel's mpirun becomes)
    killed with SIGKILL: before, the ranks trained on as orphans, rank 0 serving their store
    (without --elastic too), and ``--strategy auto``'s ranks, planning inside the job, did
    after the first fix (it guarded ``shoal train``'s ranks only)."""
    # auto plans for a tenth of sync's predicted time: 100 epochs, a few seconds' trials
    epochs = "100" if "auto" in flags else "1000"
    cmd = mpirun(2, *JOBS["sync"], "--out", "out", "--epochs", epochs, *flags)
    out = tmp_path / "out"
    with Job(cmd, tmp_path, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             SHOAL_TEST_PHASE="training") as job:
        job.wait_until("training", lambda: _has_records(out))
        if "auto" in flags:  # the winner training, silent (a print to mpirun's pipe would end
            plan = out / "plan" / "plan.json"  # an orphan: SIGPIPE)
            job.wait_until("the winner training", lambda: plan.exists() and (
                out / "metrics.jsonl").stat().st_mtime > plan.stat().st_mtime + 0.5)
        job.kill_launcher()


def test_fork_workers_die_with_a_killed_controller(tmp_path):
    """``shoal.fork``'s workers end with a controller killed while they start."""
    (tmp_path / "controller.py").write_text("import time, shoal\nshoal.fork(3)\ntime.sleep(120)\n")
    with Job([sys.executable, "controller.py"], tmp_path) as job:
        job.wait_until("worker process", job.workers)
        job.kill_launcher()


def test_loader_processes_go_with_their_worker(tmp_path):
    """A DataLoader's processes (forked by a worker) end with it when the launcher is killed."""
    cmd = [sys.executable, "-m", "shoal", *JOBS["sync"], "--dataset", "synthetic",
           "--synthetic-shape", "1x8x8", "--loader-workers", "1", "--epochs", "1000",
           "--out", "out"]
    with Job(cmd, tmp_path) as job:
        job.wait_until("training", lambda: _has_records(tmp_path / "out"))
        loaders = [kid for w in job.workers() for kid in children_of(w)]
        assert len(loaders) == 2, loaders
        job.kill_launcher()


@pytest.mark.cold  # the processes a fresh command starts first
def test_a_huge_server_count_starts_nothing(tmp_path):
    """``--servers 100000``: one line and status 2 before any worker or server starts. The
    only processes it starts are the three that ``shoal train`` starts first (multiprocessing's
    fork server, importing torch for the workers, its resource tracker, and the process the
    server forks to do the command's work, which refuses it), none of which starts another,
    all gone as soon as the command is."""
    cmd = [sys.executable, "-m", "shoal", "train", "--strategy", "async-sgd", "--servers",
           "100000", "--workers", "2", "--out", "out"]
    seen: set[int] = set()
    with Job(cmd, tmp_path) as job:
        deadline = time.monotonic() + 60
        while job.proc.poll() is None and time.monotonic() < deadline:
            kids = children_of(job.proc.pid)
            seen.update(kids)
            assert len(kids) <= 2, "it started processes"
            forked = [grandchild for kid in kids for grandchild in children_of(kid)]
            seen.update(forked)
            assert len(forked) <= 1, "it started processes"
            assert [pid for pid in forked if children_of(pid)] == [], "it started processes"
            time.sleep(0.002)
        assert job.proc.returncode == 2
        deadline = time.monotonic() + 5  # long enough to be reaped, short of any import
        while [pid for pid in seen if Path(f"/proc/{pid}").exists()]:
            assert time.monotonic() < deadline, "left behind"
            time.sleep(0.05)
        line = one_error_line(job.log.read_text())
        assert "--servers 100000" in line and "100002 processes" in line and "available" in line


LAUNCHER = textwrap.dedent("""
    import os, signal, sys, time
    import shoal.core.processes as processes
    from shoal.errors import Terminated

    start, started = processes.start_process, []

    def start_and_signal(*args, **kwargs):  # a SIGTERM arrives after the second start
        started.append(start(*args, **kwargs))
        if len(started) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return started[-1]

    processes.start_process = start_and_signal
    try:
        processes.spawn(4, time.sleep, (120,))
    except Terminated as exc:
        print("terminated:", exc)
    print("started:", " ".join(str(p.pid) for p in started), flush=True)
""")


def test_sigterm_during_start_up_stops_it(tmp_path):
    """SIGTERM while the workers are being started: none more starts, those started stop,
    and spawn says so (Terminated)."""
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    with Job([sys.executable, "launcher.py"], tmp_path) as job:
        job.proc.wait(timeout=60)
        out = job.log.read_text()
        assert "terminated: stopped by SIGTERM while starting the workers (2 of 4 started)" in out
        pids = [int(p) for p in out.split("started:")[-1].split()]
        assert len(pids) == 2 and not any(Path(f"/proc/{p}").exists() for p in pids)
        assert wait_gone(job.marker, GONE_S) == []  # the resource tracker ends after it


@pytest.mark.cold  # its workers import torch as they start
@pytest.mark.parametrize("started", [1, 2], ids=["while-starting", "while-importing"])
def test_sigterm_to_shoal_train_in_start_up_stops_every_process(tmp_path, started):
    """SIGTERM to ``shoal train`` while its workers start (one started), or once both are
    started but still importing torch (before they take SIGTERM as "checkpoint and stop"):
    it exits with 143 and one line, and none of its processes is left."""
    cmd = [sys.executable, "-m", "shoal", *JOBS["sync"], "--epochs", "1000", "--out", "out"]
    with Job(cmd, tmp_path) as job:
        job.wait_until(f"{started} worker processes", lambda: len(job.workers()) >= started)
        if started == 2:  # and both have begun to load torch (its library is mapped)
            job.wait_until("torch loading", lambda: all(loads_torch(p) for p in job.workers()))
        os.kill(job.proc.pid, signal.SIGTERM)
        job.proc.wait(timeout=30)
        # A stop, not a crash, whether the workers were still being started or importing.
        lines = [ln for ln in job.log.read_text().splitlines() if ln.startswith("shoal:")]
        assert job.proc.returncode == 143, job.log.read_text()
        assert len(lines) == 1 and "stopped by SIGTERM" in lines[0], lines
        assert wait_gone(job.marker, GONE_S) == []


def test_a_killed_command_process_ends_the_command_and_every_process(tmp_path):
    """kill -9 of the process ``shoal train`` forked from its server to do its work (the
    OOM killer's choice: it holds the records): the command exits with 137 and one line
    naming it, and none of the job's processes is left."""
    cmd = [sys.executable, "-m", "shoal", *JOBS["sync"], "--epochs", "1000", "--out", "out",
           "--log-every", "1"]
    with Job(cmd, tmp_path) as job:
        job.wait_until("training", lambda: _has_records(tmp_path / "out"))
        command = command_process(job.proc.pid)
        assert command != job.proc.pid and len(job.workers()) == 2
        os.kill(command, signal.SIGKILL)
        assert job.proc.wait(timeout=30) == 137
        lines = [ln for ln in job.log.read_text().splitlines() if ln.startswith("shoal:")]
        assert lines == [f"shoal: error: the command's process (pid {command}) was killed by "
                         "SIGKILL"], job.log.read_text()
        assert wait_gone(job.marker, GONE_S) == []


GUARDED = textwrap.dedent("""
    import subprocess, sys, time
    from shoal.core.guard import guarded_command

    child = subprocess.Popen(guarded_command([sys.executable, "-c", "import time; time.sleep(120)"]))
    print(child.pid, flush=True)
    time.sleep(120)
""")


def test_a_guarded_command_dies_with_its_parent(tmp_path):
    """What the sweep's and the emulated cluster's launchers start (guarded_command) ends
    with the process that started it, even by kill -9; and one whose parent is already gone
    when it starts never runs."""
    (tmp_path / "parent.py").write_text(GUARDED)
    with Job([sys.executable, "parent.py"], tmp_path) as job:
        job.wait_until("guarded child", lambda: job.log.read_text().strip())
        child = int(job.log.read_text().split()[0])
        assert Path(f"/proc/{child}").exists()
        job.kill_launcher()
    from shoal.core.guard import guarded_command

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    cmd = guarded_command(["sleep", "120"])
    cmd[cmd.index("--") - 1] = str(gone.pid)  # started by a parent that no longer exists
    res = subprocess.run(cmd, timeout=30)
    assert res.returncode == -signal.SIGKILL
