"""``shoal run`` is never worse than torchrun when a rank ends early, fails, or exits while
another rank waits in a plain ``torch.distributed`` collective: the job ends with a non-zero
status and one line naming the rank and what it did (issue 55). Real processes, Gloo on CPU;
the timeouts only guard against a hang, nothing here is timed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from conftest import marked_processes, one_error_line, popen, run, shoal_env, wait_gone

pytestmark = pytest.mark.timeout(240)

#: Rank 1 ends as ``{end}`` says while rank 0 waits in its own all_reduce, which shoal does
#: not count: only rank 1's end can make it fail before Gloo's own timeout (30 minutes).
ENDS_EARLY = """\
import os, sys, time
import torch, torch.distributed as dist
{join}
if dist.get_rank() == 1:
    {end}
else:
    dist.all_reduce(torch.ones(3))
"""

FORKS = """\
if os.fork() == 0:  # the child keeps the rank's sockets open
        time.sleep(60)
        os._exit(0)"""

SHOAL_INIT = "import shoal; shoal.init(timeout=600)"
OWN_GROUP = "dist.init_process_group('gloo')"


def shoal_run(tmp_path, program: str, timeout: float = 90):
    (tmp_path / "job.py").write_text(program)
    return run([sys.executable, "-m", "shoal", "run", "--workers", "2", "job.py"],
               env=shoal_env(uuid.uuid4().hex), cwd=tmp_path, timeout=timeout)


@pytest.mark.parametrize("join, end, line", [
    (SHOAL_INIT, "pass", "rank 1: exited with status 0 while the others were still running"),
    (SHOAL_INIT, "raise ValueError('boom')", "rank 1: ValueError: boom"),
    (SHOAL_INIT, "os._exit(3)", "rank 1: worker process exited with code 3"),
    (SHOAL_INIT, FORKS, "rank 1: exited with status 0 while the others were still running"),
    (OWN_GROUP, "pass", "rank 1: exited with status 0 while the others were still running"),
], ids=["returns", "raises", "os._exit(3)", "forks", "returns-own-group"])
def test_a_rank_that_ends_while_another_is_in_a_plain_collective(tmp_path, join, end, line):
    """Before, a rank that returned waited at the end of the job with its connections open,
    and the job hung (the forked child, holding them too, hangs it under torchrun still)."""
    res = shoal_run(tmp_path, ENDS_EARLY.format(join=join, end=end))
    assert res.returncode == 1, res.stderr
    assert one_error_line(res.stderr).startswith(f"shoal: error: {line}"), res.stderr
    assert "has waited" not in res.stderr, res.stderr


# -- processes named by role (issue 55, part 5; under torchrun: test_job_processes.py) ----------
#: Rank 1 of ENDS_EARLY ends once the test has seen the workers' names (the file ``seen``).
UNTIL_SEEN = """deadline = time.monotonic() + 120
    while not os.path.exists("seen") and time.monotonic() < deadline:
        time.sleep(0.01)"""


def names_while_running(args: list[str], cwd, timeout: float = 180,
                        tell: tuple[set[tuple[str, str]], Path] | None = None
                        ) -> tuple[int, set[tuple[str, str]]]:
    """Run ``args`` (a ``shoal`` command) to its end, looking at its processes (those with
    its marker) meanwhile: its exit status and each process's ``(command line, name)``, as
    ``ps`` and ``top`` show them. ``tell``: (names, file): the file is made once those
    names were all seen (the job may end then)."""
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(args, env=shoal_env(marker), cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen: set[tuple[str, str]] = set()
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            for pid in marked_processes(marker):
                with contextlib.suppress(OSError):
                    line = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0")
                    name = Path(f"/proc/{pid}/comm").read_text().strip()
                    seen.add((line.replace(b"\0", b" ").decode(errors="replace"), name))
            if tell is not None and tell[0] <= seen:
                tell[1].touch()
            time.sleep(0.1)
        assert proc.poll() is not None, f"{args} did not end in {timeout} s"
        return proc.wait(), seen
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        wait_gone(marker, 10.0)


def test_processes_are_named_by_role_in_ps_and_top(tmp_path):
    """One job of compute groups (a server, two workers in a group, a DataLoader process
    each) and one of ``shoal run``: each process's command line and name say what it is."""
    code, seen = names_while_running(
        [sys.executable, "-m", "shoal", "train", "--dataset", "digits", "--model", "mlp",
         "--strategy", "groups", "--groups", "1", "--workers", "2", "--loader-workers", "1",
         "--epochs", "1", "--progress", "none", "--out", str(tmp_path / "run")], tmp_path)
    assert code == 0
    for title in ("shoal launcher", "shoal server 0", "shoal worker 0", "shoal worker 1",
                  "shoal loader 0", "shoal loader 1"):
        assert (title, title) in seen, seen
    assert ("shoal forkserver", "forkserver") in seen, seen  # 15 bytes at most: top's name
    (tmp_path / "job.py").write_text(ENDS_EARLY.format(join=SHOAL_INIT, end=UNTIL_SEEN))
    workers = {("shoal worker 0", "shoal worker 0"), ("shoal worker 1", "shoal worker 1")}
    code, seen = names_while_running([sys.executable, "-m", "shoal", "run", "--workers", "2",
                                      "job.py"], tmp_path, tell=(workers, tmp_path / "seen"))
    assert code == 1  # rank 1 ends while rank 0 waits
    assert workers <= seen


# -- SIGTERM after a worker's loss: one stop line ------------------------------------------------
def pid_titled(marker: str, title: str) -> int | None:
    for pid in marked_processes(marker):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0") == title.encode():
                return pid
    return None


def test_sigterm_after_a_workers_loss_prints_one_stop_line(tmp_path):
    """``--elastic``: worker 1 killed with SIGKILL, the job goes on in worker 0, then SIGTERM
    to ``shoal train``: it stops with a checkpoint, one line saying so, status 143."""
    marker, out = uuid.uuid4().hex, tmp_path / "run"
    proc = popen(
        [sys.executable, "-m", "shoal", "train", "--dataset", "digits", "--model", "mlp",
         "--workers", "2", "--epochs", "200", "--elastic", "--progress", "none", "--out",
         str(out)], shoal_env(marker), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        worker = pid_titled(marker, "shoal worker 1")
        assert worker is not None and (out / "metrics.jsonl").exists(), "training never began"
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        os.kill(worker, signal.SIGKILL)
        while not any("worker 1 left" in line for line in lines) and \
                time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, "".join(lines)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        reader.join(timeout=10)
        err = "".join(lines)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        wait_gone(marker, 10.0)
    assert proc.returncode == 143, err
    stops = [line for line in err.splitlines() if "SIGTERM" in line]
    assert len(stops) == 1 and stops[0].startswith("shoal: stopped by SIGTERM at step "), err
