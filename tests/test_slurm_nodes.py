"""A real Slurm of two emulated nodes (``.ci/slurm-nodes``: a network namespace and a
hostname each, one slurmd each): shoal's elastic jobs across hosts under srun, and under
MPICH's mpiexec inside a Slurm allocation. Skipped where that cluster is not up."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import (
    EPOCHS,
    MPIEXEC_HYDRA,
    REPO,
    assert_went_on_without,
    run,
    shoal_env,
    slurmctld_runs,
)

CONF = "/etc/shoal-slurm-nodes/slurm.conf"


@functools.cache
def nodes_up() -> bool:
    """Whether the two emulated nodes take jobs."""
    if not slurmctld_runs():
        return False
    try:
        res = subprocess.run(["ip", "netns", "exec", "slurm-emu1", "sinfo", "-h", "-N", "-o",
                              "%T"], capture_output=True, text=True, timeout=10,
                             env={**os.environ, "SLURM_CONF": CONF})
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0 and sum(
        state.rstrip("*") in ("idle", "mixed", "allocated") for state in res.stdout.split()) == 2


pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(
    "not nodes_up()", reason="no Slurm of two emulated nodes (.ci/slurm-nodes sets one up)")]

KILLED = ["train", "--dataset", "digits", "--epochs", str(EPOCHS), "--schedule", "constant",
          "--elastic", "--record-samples", "--model", "tests.fixtures_models:killed_at",
          "--progress", "plain"]


def _on_emu1(command: str) -> list[str]:
    """``command`` (a shell line) run on node emu1, as its user would: in its namespace,
    under its hostname."""
    return ["ip", "netns", "exec", "slurm-emu1", "unshare", "--uts", "sh", "-c",
            f"hostname emu1 && exec {command}"]


def _rank_3_killed(launched: list[str], out: Path, name: str) -> None:
    """``launched`` (Slurm job ``name``: 4 ranks, 2 a node; rank 3, on emu2, kills itself
    at its 20th forward) exits 0 and the 3 left trained its share: each sample once, the
    loss in the summary. The job is cancelled whatever happens (salloc runs its command in
    a process group of its own, which the test's kill of its session would miss)."""
    env = {**shoal_env(uuid.uuid4().hex), "SLURM_CONF": CONF, "SHOAL_TEST_KILL_RANK": "3",
           "SHOAL_TEST_KILL_AT": "train:20"}
    try:
        res = run(launched, timeout=200, env=env)
    finally:
        subprocess.run(["ip", "netns", "exec", "slurm-emu1", "scancel", "--name", name],
                       env={**os.environ, "SLURM_CONF": CONF}, timeout=30, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stray == []
    assert_went_on_without(out, 3, 3)


def test_a_worker_killed_on_the_second_node_leaves_under_srun_across_two_nodes(tmp_path):
    """``srun -N 2 -n 4``: no SLURM_NTASKS_PER_NODE, the store on emu1 reached by name from
    emu2, the killed rank's keeper on emu2 outlives its worker so srun sees no failure."""
    out, name = tmp_path / "run", f"shoal-test-{uuid.uuid4().hex[:8]}"
    _rank_3_killed(_on_emu1(
        f"srun -J {name} -N 2 -n 4 --kill-on-bad-exit=1 --immediate=30 --chdir {REPO} "
        f"{sys.executable} -m shoal {' '.join(KILLED)} --out {out}"), out, name)


@pytest.mark.skipif(not Path(MPIEXEC_HYDRA).exists(), reason="no MPICH mpiexec.hydra")
def test_mpiexec_inside_a_slurm_allocation_of_two_nodes(tmp_path):
    """``salloc -N 2 -n 4 mpiexec.hydra -bootstrap slurm``: each rank's SLURM_PROCID is its
    node's proxy's (two ranks share one), its PMI_RANK its own."""
    out, name = tmp_path / "run", f"shoal-test-{uuid.uuid4().hex[:8]}"
    _rank_3_killed(_on_emu1(
        f"salloc -J {name} -N 2 -n 4 --immediate=30 {MPIEXEC_HYDRA} -bootstrap slurm -n 4 -ppn 2 "
        f"-genv MASTER_ADDR emu1 -wdir {REPO} {sys.executable} -m shoal {' '.join(KILLED)} "
        f"--out {out}"), out, name)
