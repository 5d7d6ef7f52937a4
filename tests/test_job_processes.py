"""Every process of a job is essential and its loss named in one line, or survived; and
nothing a job started outlives it, a user's own processes included (issue 55, parts 2-3).

Real jobs, caught in a phase from the outside (the process tree and the files the job
writes), one of their helper processes killed with ``kill -9``:

- start-up: the first worker process exists;
- training: ``metrics.jsonl`` has a record;
- shutdown: rank 1's work is done and its interpreter holds in its exit (released by a
  file once the kill is made).

The fork server that forks a job's processes holds every worker (they die with it): a job
ends with one line naming it, exit 1 and its files cleaned, ``--elastic`` too; at shutdown,
when the work is done, it is a warning. multiprocessing's resource tracker holds nothing:
the job goes on, exit 0. Under torchrun ``--elastic`` the keeper forks one rank's worker
itself (the job goes on without it), the keeper is the rank torchrun watches (torchrun ends
the job, naming the rank); each keeper and its rank's worker shows its role in ``ps``.
And a user script's children (``Popen``, a double fork with ``setsid``) end with ``shoal
run``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import children_of, kill_job, marked_processes, popen, shoal_env, wait_gone

pytestmark = pytest.mark.timeout(240)

#: How the server shows in its command line (multiprocessing's, or its name in ps).
SERVER = "forkserver"
SERVER_LOST = "the server that forks the job's processes (pid {pid}) was lost"
TRAIN = ["train", "--model", "tests.fixtures_models:held_at_exit", "--dataset", "digits",
         "--progress", "none", "--log-every", "1", "--timeout", "60", "--out", "out"]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _ended(pid: int) -> bool:
    """Whether ``pid`` has ended: gone, or a zombie its parent has not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def _rank_of(pid: int) -> str | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((v[5:].decode() for v in env if v.startswith(b"RANK=")), None)


class Job:
    """A ``shoal`` command (or torchrun) started in ``tmp_path`` with the test's marker; rank
    1 holds in its exit until :meth:`kill` releases it. Leaving the block kills whatever of
    it is left, by pid."""

    def __init__(self, tmp_path: Path, args: list[str]) -> None:
        self.dir, self.marker = tmp_path, uuid.uuid4().hex
        self.release = tmp_path / "release"
        env = {**shoal_env(self.marker), "SHOAL_TEST_HOLD_RANK": "1",
               "SHOAL_TEST_HOLD_FILE": str(tmp_path / "exiting"),
               "SHOAL_TEST_RELEASE_FILE": str(self.release)}
        self.log = tmp_path / "log"
        self.watch: Callable[[], None] = lambda: None  # called as each wait polls
        with open(self.log, "wb") as log:
            self.proc = popen([sys.executable, "-m", *args], env=env, cwd=tmp_path,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.touch()
        kill_job(self.proc, self.marker)

    def wait_until(self, what: str, ready: Callable[[], object], timeout: float = 120.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.watch()
            value = ready()
            if value:
                return value
            if self.proc.poll() is not None:
                pytest.fail(f"the job ended before {what}:\n{self.log.read_text()}")
            time.sleep(0.005)
        pytest.fail(f"no {what} within {timeout:.0f} s:\n{self.log.read_text()}")

    def reach(self, phase: str, workers: Callable[[], bool]) -> None:
        if phase == "start-up":
            self.wait_until("a worker process", workers)
        elif phase == "training":
            records = self.dir / "out" / "metrics.jsonl"
            self.wait_until("a record", lambda: records.exists() and records.stat().st_size)
        else:  # rank 1 holds in its exit; rank 0, whose work ends later (the summary), ended
            self.wait_until("rank 1 in its exit and rank 0 ended", lambda: (
                self.dir / "exiting").exists() and not any(
                    _rank_of(pid) == "0" and not _ended(pid)
                    for pid in marked_processes(self.marker)))

    def kill(self, *pids: int) -> None:
        """kill -9 ``pids``, release rank 1's hold once they have ended (a held rank 1 is
        still holding when the kill lands: a process the server forked has its SIGKILL by
        the time the server is a zombie), wait for the job to end."""
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not all(_ended(pid) for pid in pids):
            assert time.monotonic() < deadline, f"{pids} did not end after kill -9"
            time.sleep(0.005)
        self.release.touch()
        try:
            self.code = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end:\n{self.log.read_text()}")
        self.output = self.log.read_text()
        assert wait_gone(self.marker, 10.0) == [], "processes outlived the job"

    def shoal_lines(self) -> list[str]:
        return [line for line in self.output.splitlines() if line.startswith("shoal:")]


def _server(parent: int) -> int | None:
    """The fork server ``parent`` (a ``shoal`` command, a keeper) started."""
    return next((pid for pid in children_of(parent) if SERVER.encode() in _cmdline(pid)), None)


def _tracker(parent: int) -> int | None:
    """multiprocessing's resource tracker ``parent`` started: its other child."""
    return next((pid for pid in children_of(parent) if SERVER.encode() not in _cmdline(pid)),
                None)


def _forked(command: int) -> list[int]:
    """The processes the server of ``command`` forked (its work process, then workers)."""
    server = _server(command)
    return children_of(server) if server else []


def _left_no_join_file(job: Job) -> None:
    assert not (job.dir / "out" / ".shoal-join").exists() or \
        not any((job.dir / "out" / ".shoal-join").iterdir())


def _killed_in(tmp_path: Path, phase: str, elastic: bool, epochs: str,
               find: Callable[[int], int | None]) -> tuple[Job, int]:
    """A 2-worker ``shoal train`` whose process ``find`` gives (from the command's pid) is
    killed in ``phase``: the ended job and that pid."""
    with Job(tmp_path, ["shoal", *TRAIN, "--workers", "2", "--epochs", epochs,
                        *(["--elastic"] if elastic else [])]) as job:
        job.reach(phase, lambda: len(_forked(job.proc.pid)) > 1)
        pid = find(job.proc.pid)
        assert pid is not None
        job.kill(pid)
    return job, pid


#: A start-up phase is a fresh interpreter's (its server imports torch): run cold. The other
#: phases' commands are forked from the warm interpreter (conftest.popen).
START_UP = pytest.param("start-up", False, marks=pytest.mark.cold)


@pytest.mark.parametrize(("phase", "elastic"), [START_UP, ("training", False),
                                                ("shutdown", False), ("training", True)])
def test_a_lost_fork_server_is_named_in_one_line(tmp_path, phase, elastic):
    job, server = _killed_in(tmp_path, phase, elastic, "1" if phase == "shutdown" else "200",
                             _server)
    lost = SERVER_LOST.format(pid=server)
    if phase == "shutdown":  # the work was done: its results stand
        assert job.code == 0, job.output
        assert job.shoal_lines() == [f"shoal: warning: {lost} as the workers exited; their "
                                     "work was done"], job.output
        assert (tmp_path / "out" / "summary.json").exists()
    else:
        assert job.code == 1, job.output
        lines = job.shoal_lines()
        assert len(lines) == 1 and lines[0].startswith(f"shoal: error: {lost}"), job.output
        assert "Traceback" not in job.output
        assert not (tmp_path / "out" / "summary.json").exists()
    _left_no_join_file(job)


def test_a_killed_work_process_is_named_and_its_join_file_taken_away(tmp_path):
    """The command's work process (the job's store, the records) killed while an
    ``--elastic`` job trains: the command names it, exit 137, and removes the file a
    ``shoal join`` would find the job by, which that process could not."""
    with Job(tmp_path, ["shoal", *TRAIN, "--workers", "2", "--epochs", "200",
                        "--elastic"]) as job:
        job.reach("training", lambda: False)
        assert (tmp_path / "out" / ".shoal-join").exists()
        work = min(_forked(job.proc.pid))  # the server's first child
        job.kill(work)
    assert job.code == 137, job.output
    assert (f"shoal: error: the command's process (pid {work}) was killed by SIGKILL"
            in job.shoal_lines()), job.output
    # The workers' store connections reset as they end: torch's C++ warnings (native stack
    # frames) are not shown without --debug.
    assert "frame #" not in job.output and "TCPStore" not in job.output, job.output
    assert not (tmp_path / "out" / ".shoal-join").exists()


@pytest.mark.parametrize(("phase", "elastic"), [START_UP, ("training", True),
                                                ("shutdown", False)])
def test_a_lost_resource_tracker_is_survived(tmp_path, phase, elastic):
    job, _ = _killed_in(tmp_path, phase, elastic, "1" if phase == "shutdown" else "3", _tracker)
    assert job.code == 0, job.output
    assert (tmp_path / "out" / "summary.json").exists()
    assert "Traceback" not in job.output and "error" not in job.output, job.output
    _left_no_join_file(job)


def _keeper(job: Job, rank: str = "1") -> int | None:
    """Rank ``rank``'s keeper: torchrun's process of that rank."""
    return next((pid for pid in children_of(job.proc.pid) if _rank_of(pid) == rank), None)


def _keepers(job: Job) -> list[int] | None:
    """Ranks 0's and 1's keepers, once both are there."""
    keepers = [_keeper(job, rank) for rank in "01"]
    return [pid for pid in keepers if pid is not None] if all(keepers) else None


def _torchrun(tmp_path: Path, epochs: str, elastic: bool) -> Job:
    return Job(tmp_path, ["torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "shoal", *TRAIN, "--epochs", epochs,
                          *(["--elastic"] if elastic else [])])


@pytest.mark.cold  # the keepers are torchrun's children (forked warm, the interpreter's)
@pytest.mark.parametrize(("phase", "elastic"), [("start-up", True), ("training", True),
                                                ("training", False)])
def test_under_torchrun_a_lost_keeper_ends_the_job(tmp_path, phase, elastic):
    """Rank 1's keeper killed (the process torchrun watches: torchrun ends the job and names
    the rank, at start-up or mid-training; plain, the rank itself trains in it); nothing of
    the job outlives torchrun."""
    with _torchrun(tmp_path, "200", elastic) as job:
        keeper = job.wait_until("rank 1's keeper", lambda: _keeper(job))
        # plain, a rank trains in torchrun's process itself: no work forked
        job.reach(phase, lambda: bool(children_of(keeper)) or not elastic)
        job.kill(keeper)
    # torchrun's own report names the rank and the signal
    assert job.code != 0
    assert "rank      : 1 (local_rank: 1)\n  exitcode  : -9" in job.output, job.output
    assert "BrokenPipeError" not in job.output
    # rank 0 ends on torchrun's SIGTERM: torchrun never has to kill it after its grace
    assert "Unable to shutdown process" not in job.output, job.output


class Names:
    """Each process of a job (its launcher's descendants) as ``ps`` and ``top`` show it:
    ``(command line, name)``, looked at while the job runs (:meth:`look`, polled)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.last = pid, 0.0
        self.seen: set[tuple[str, str]] = set()

    def look(self, every: float = 0.05) -> None:
        if time.monotonic() - self.last < every:
            return
        self.last = time.monotonic()
        todo = children_of(self.pid)
        while todo:
            pid = todo.pop()
            todo += children_of(pid)
            with contextlib.suppress(OSError):
                name = Path(f"/proc/{pid}/comm").read_text().strip()
                line = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0")
                self.seen.add((line.replace(b"\0", b" ").decode(errors="replace"), name))


@pytest.fixture(scope="class")
def lost(tmp_path_factory):
    """:class:`TestUnderTorchrunAKeepersWorker`'s job, ended: its folder, the job, each
    keeper's children while it trained, the names its processes showed."""
    tmp_path = tmp_path_factory.mktemp("torchrun")
    with _torchrun(tmp_path, "3", elastic=True) as job:
        names = Names(job.proc.pid)
        job.watch = names.look
        keepers = job.wait_until("both keepers", lambda: _keepers(job))
        job.reach("training", lambda: False)
        children = [children_of(keeper) for keeper in keepers]
        names.look(every=0)
        assert len(children[1]) == 1, children
        job.kill(children[1][0])
    return tmp_path, job, children, names.seen


@pytest.mark.cold  # the keepers are torchrun's children (forked warm, the interpreter's)
class TestUnderTorchrunAKeepersWorker:
    """One torchrun ``--elastic`` job: each rank's process (its keeper) forks its worker
    itself (no fork server, no resource tracker of its own); while it trains, rank 1's
    worker is killed: the job goes on without it, nothing of it outlives torchrun. Each
    process is named by its role meanwhile."""

    def test_a_lost_worker_loses_its_rank_and_the_job_goes_on(self, lost):
        tmp_path, job, _, _ = lost
        assert job.code == 0, job.output
        summary = json.loads((tmp_path / "out" / "summary.json").read_text())
        # rank 0 lost nothing: the one change is rank 1's loss
        assert summary["completed"] and summary["workers"] == 1, summary
        assert [change["left"] for change in summary["membership_changes"]] == [[1]], summary
        assert ("shoal: rank 1 killed by signal 9; the job goes on without it (--elastic)"
                in job.output), job.output
        _left_no_join_file(job)

    def test_a_keeper_forks_its_worker_itself(self, lost):
        children = lost[2]
        assert [len(c) for c in children] == [1, 1], children  # no server, no tracker
        assert not any(SERVER.encode() in _cmdline(pid) for c in children for pid in c)

    def test_a_keeper_and_its_rank_are_named(self, lost):
        _, job, _, seen = lost
        assert job.code == 0, job.output
        for title in ("shoal keeper 0", "shoal keeper 1", "shoal worker 0", "shoal worker 1"):
            assert (title, title) in seen, seen


USER_SCRIPT = textwrap.dedent("""
    import os, subprocess, time
    import shoal

    shoal.init()
    rank, here = os.environ["RANK"], os.environ["SHOAL_TEST_DIR"]
    child = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(here, f"popen{rank}"), "w") as f:
        f.write(str(child.pid))
    if os.fork() == 0:  # a daemon of the user's: a double fork, a session of its own
        os.setsid()
        if os.fork() == 0:
            with open(os.path.join(here, f"detached{rank}"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(300)
        os._exit(0)
    while not os.path.exists(os.path.join(here, f"detached{rank}")):
        time.sleep(0.01)
""")


def test_a_user_scripts_children_end_with_shoal_run(tmp_path):
    (tmp_path / "user.py").write_text(USER_SCRIPT)
    marker = uuid.uuid4().hex
    env = {**shoal_env(marker), "SHOAL_TEST_DIR": str(tmp_path)}
    pids: list[int] = []
    try:
        res = subprocess.run([sys.executable, "-m", "shoal", "run", "--workers", "2", "user.py"],
                             env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=120, start_new_session=True)
        assert res.returncode == 0, res.stderr
        pids = [int((tmp_path / f"{kind}{rank}").read_text())
                for kind in ("popen", "detached") for rank in (0, 1)]
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()
                 and not Path(f"/proc/{pid}/stat").read_text().split(")")[1].startswith(" Z")]
        assert alive == [], f"outlived shoal run: {alive}"
        assert wait_gone(marker, 5.0) == []  # the resource tracker too
    finally:
        for pid in pids + wait_gone(marker, 0.0):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
