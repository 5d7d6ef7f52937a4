"""``shoal train``, ``shoal run`` and ``shoal join`` start the server that forks their workers
before they import torch, only where they will start processes here, and do their work in a
process forked from it (shoal.cli.early)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from shoal.cli.early import wants_workers

from conftest import REPO, TorchWatch, one_error_line, shoal_env

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
    (["run", "--workers", "2", "x.py"], True),
    (["run", "x.py"], True),  # its one rank is a process too
    (["run", "--help"], False),
    (["run", "--workers", "2", "-h"], False),
    (["run", "x.py", "--help"], True),  # the script's flag
    (["run", "--workers", "2", "-m", "pkg.mod", "-h"], True),
    (["join", "runs/job"], True),  # its worker is a process
    (["join", "--store", "10.0.0.1:29400"], True),
    (["join", "--help"], False),
    (["plan", "--workers", "2"], False),
    ([], False),
])
def test_only_a_command_that_starts_processes_starts_the_server_early(argv, wanted, no_launcher):
    assert wants_workers(argv) is wanted


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_a_rank_of_an_outside_launcher_starts_no_server(launcher, no_launcher):
    """Under torchrun, srun or mpirun the command is itself a rank: it forks nothing. Which
    variables say so is ``shoal train``'s own reading (shoal.core.env)."""
    for name, value in LAUNCHERS[launcher].items():
        no_launcher.setenv(name, value)
    assert not wants_workers(["train", "--workers", "2"])
    assert not wants_workers(["run", "x.py"])
    assert not wants_workers(["join", "runs/job"])


def test_deciding_imports_no_torch():
    """What decides (the arguments, shoal.core.env's reading of the launchers' variables)
    imports no torch: else the server would start no sooner than before."""
    code = "import sys, shoal.cli.early; print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=shoal_env(), timeout=120)
    assert res.stdout.strip() == "False", res.stdout + res.stderr


def _watched(cmd: list[str]) -> tuple[bool, bool]:
    """Run ``cmd`` (a ``shoal`` command line), which must succeed; whether it forked a
    process to do its work, and whether that one loaded torch. Its own process must not."""
    proc = subprocess.Popen(cmd, env=shoal_env(), cwd=REPO, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    watch = TorchWatch(proc.pid)
    try:
        while proc.poll() is None:
            watch.look()
            time.sleep(0.01)
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return watch.forked, watch.torch


def test_the_command_works_in_a_process_forked_from_its_server(tmp_path):
    """``shoal train --workers 2``: the command's own process never loads torch; the work
    (checks, the job's store, records) runs in a process forked from the server, which
    loaded it once for the workers too. The job trains and ends with that process's status:
    0 here, 2 and one line for a command refused after the server started. ``shoal run``
    the same, its ranks writing their files."""
    cmd = [sys.executable, "-m", "shoal", "train", "--workers", "2", "--epochs", "2",
           "--model", "tests.fixtures_models:tiny", "--progress", "none"]
    assert _watched([*cmd, "--out", str(tmp_path / "run")]) == (True, True)
    assert (tmp_path / "run" / "summary.json").exists()
    script = tmp_path / "rank.py"
    script.write_text("import os, sys\nimport shoal\nshoal.init()\n"
                      "open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').close()\n")
    assert _watched([sys.executable, "-m", "shoal", "run", "--workers", "2", str(script),
                     str(tmp_path)]) == (True, True)
    assert (tmp_path / "0").exists() and (tmp_path / "1").exists()
    refused = subprocess.run([*cmd, "--lr", "-1", "--out", str(tmp_path / "other")], cwd=REPO,
                             env=shoal_env(), capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and one_error_line(refused.stderr).startswith(
        "shoal: error: ") and "--lr" in refused.stderr


FALLBACK = """
import sys
import shoal.cli.early as early

def server_gone(process):  # the server died while it forked the work: its pipe broke
    raise EOFError

early.start_guarded = server_gone
from shoal.cli import main
sys.argv = ["shoal", *sys.argv[1:]]
sys.exit(main())
"""


def test_the_command_works_in_its_own_process_when_its_server_cannot_fork_it(tmp_path):
    """Where the server cannot fork the command's work (it died while asked: its pipe
    broke, simulated here), the command does the work in its own process, as before the
    fork: the job trains, its workers from the server, and it exits 0."""
    script = tmp_path / "fallback.py"
    script.write_text(FALLBACK)
    res = subprocess.run([sys.executable, str(script), "train", "--workers", "2", "--epochs", "1",
                          "--model", "tests.fixtures_models:tiny", "--progress", "none",
                          "--out", str(tmp_path / "run")], cwd=REPO, env=shoal_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["completed"] and summary["workers"] == 2
