"""Soak of elastic membership: 4 workers, one killed (SIGKILL) every ~--kill-every seconds for
--duration seconds and a replacement started --replace-after seconds later, in four runs side
by side (one after the other, same model, data and epochs):

- ``elastic``: ``shoal train --elastic`` (diloco, or --strategy); the replacement is
  ``shoal join OUT``;
- ``restarts``: the same without --elastic, under ``--max-restarts``: the launcher restarts
  the whole job from its last checkpoint (the restart is the replacement);
- ``torchft``: torchft 0.2.0's DiLoCo, 4 replica groups of one process each with their
  Manager and a lighthouse asking for 2 replicas at least (benchmarks/soak_torchft.py);
  the killed replica is started again and heals from a live peer;
- ``uninterrupted``: the elastic run with no kills (the reference accuracy).

Worker 0 (replica 0) is killed only with ``--any-worker`` (shoal's runs; it writes the
records, which the lowest id left then takes over). Reported per run: kills,
joins/restarts, the survivors' longest stall (the longest time without a new step record
from a kill to the next kill or 40 s on: steps redone
after a restart or a failed round are not new), samples lost and repeated (shoal elastic:
every worker's --record-samples; restarts: the summary's samples against the reference's and
the steps redone; torchft: the rows of every committed round each replica took part in),
test accuracy against the uninterrupted run's, wall time and the load average.
Writes soak.json and soak.md to --out. Run:

    .venv/bin/python benchmarks/soak_elastic.py --epochs 400 --duration 600 --out runs/soak-elastic
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from itertools import pairwise
from pathlib import Path

from soak import samples_recorded, workers_of

from shoal.strategies import get_strategy, option_fields

REPO = Path(__file__).resolve().parent.parent
ROWS = 1437  # digits' training rows
STALL_WINDOW = 40.0
ASYNC = ("async-", "hogwild", "groups")  # with a parameter server: rank 0 is server 0


def _servers(a: argparse.Namespace) -> int:
    """The parameter servers of an asynchronous run (``--servers`` in ``--extra``, or 1)."""
    extra = shlex.split(a.extra)
    return int(extra[extra.index("--servers") + 1]) if "--servers" in extra else 1


class Steps(threading.Thread):
    """Follows a JSON-lines file (restarted when it is replaced) and stamps each new highest
    ``step`` of its step records with the time it appeared."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path, self.seen, self.done = path, [(time.monotonic(), 0)], threading.Event()

    def run(self) -> None:
        inode, offset, rest = None, 0, b""
        while not self.done.wait(0.05):
            with contextlib.suppress(OSError):
                st = self.path.stat()
                if st.st_ino != inode or st.st_size < offset:
                    inode, offset, rest = st.st_ino, 0, b""
                with self.path.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                offset += len(chunk)
                *lines, rest = (rest + chunk).split(b"\n")
                for line in lines:
                    with contextlib.suppress(ValueError):
                        record = json.loads(line)
                        if record.get("event", "step") == "step" and record["step"] > self.seen[-1][1]:
                            self.seen.append((time.monotonic(), record["step"]))

    def stall_after(self, t: float, until: float) -> float:
        """The longest time without a new step from ``t`` to ``until``."""
        times = [s for s, _ in self.seen if t <= s <= until]
        before = [s for s, _ in self.seen if s < t]
        marks = ([before[-1]] if before else []) + times + [until]
        return max(b - a for a, b in pairwise(marks))


def kill_stalls(steps: Steps, kills: list[float], end: float) -> list[float]:
    """Each kill's (``time.monotonic()``) longest time without a new step record, up to the
    next kill, at most :data:`STALL_WINDOW` s, and ``end``."""
    return [round(steps.stall_after(t, min(nxt, t + STALL_WINDOW, end)), 2)
            for t, nxt in itertools.pairwise([*kills, end])]


class Killer(threading.Thread):
    """Once ``steps`` sees the run train: every U(0.8, 1.2) x ``every`` seconds for
    ``duration`` seconds, SIGKILL one of ``victims()`` (pid, what) and ``replace(what)``
    ``after`` seconds later."""

    def __init__(self, a: argparse.Namespace, steps: Steps, victims, replace,
                 rng: random.Random) -> None:
        super().__init__(daemon=True)
        self.a, self.steps, self.victims, self.replace, self.rng = a, steps, victims, replace, rng
        self.kills: list[dict] = []
        self.replaced = 0
        self.done = threading.Event()

    def run(self) -> None:
        while len(self.steps.seen) < 2:
            if self.done.wait(0.2):
                return
        start = time.monotonic()
        next_kill, pending = start + self.rng.uniform(0.8, 1.2) * self.a.kill_every, []
        while next_kill < float("inf") or pending:
            wake = min([next_kill, *[t for t, _ in pending]])
            if self.done.wait(max(0.0, wake - time.monotonic())):
                return
            now = time.monotonic()
            for due in [p for p in pending if p[0] <= now]:
                pending.remove(due)
                if self.replace(due[1]):
                    self.replaced += 1
            if now >= next_kill:
                pending += self.kill(now, start)
                next_kill = now + self.rng.uniform(0.8, 1.2) * self.a.kill_every
                if next_kill - start >= self.a.duration:
                    next_kill = float("inf")

    def kill(self, now: float, start: float) -> list[tuple[float, str]]:
        """SIGKILL a random victim; its replacement's time and what it was."""
        live = self.victims()
        if not live:
            return []
        pid, what = self.rng.choice(live)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return []
        self.kills.append({"t": now, "at_s": round(now - start, 1), "victim": what})
        return [(now + self.a.replace_after, what)]

    def stalls(self, steps: Steps) -> list[float]:
        """Each kill's stall of worker 0, up to the next kill (at most STALL_WINDOW s)."""
        return kill_stalls(steps, [k["t"] for k in self.kills], time.monotonic())


def stop(procs: list[subprocess.Popen]) -> None:
    """Kill each process group we started (their session) and reap them."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """``cmd`` in a session of its own, its output to ``log``."""
    with log.open("ab") as f:
        return subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=f,
                                stderr=subprocess.STDOUT, env=env)


def shoal_args(a: argparse.Namespace, out: Path) -> list[str]:
    # diloco's outer step as torchft's run takes it (benchmarks/soak_torchft.py's defaults)
    outer = ["--outer-lr", "0.7", "--outer-momentum", "0.5"] if a.strategy == "diloco" else []
    options = {f.name for f in option_fields(get_strategy(a.strategy))}
    tau = ["--tau", str(a.tau)] if "tau" in options else []  # async-sgd has no period
    return [sys.executable, "-m", "shoal", "train", "--model", a.model, "--dataset", "digits",
            "--workers", "4", "--epochs", str(a.epochs), "--strategy", a.strategy, *tau,
            "--lr", str(a.lr), "--momentum", "0.9", "--schedule", "constant",
            *outer, *shlex.split(a.extra), "--progress", "plain", "--log-every", "1",
            "--overwrite", "--out", str(out)]


def run_shoal(a: argparse.Namespace, name: str, kills: bool, rng: random.Random) -> dict:
    """One shoal run: elastic (joins), restarts (--max-restarts) or uninterrupted."""
    out = Path(a.out) / name
    out.mkdir(parents=True, exist_ok=True)
    extra = ["--max-restarts", "1000"] if name == "restarts" else ["--elastic", "--record-samples"]
    began = time.monotonic()
    job = start(shoal_args(a, out) + extra, Path(a.out) / f"{name}.log")
    joins: list[subprocess.Popen] = []

    def victims() -> list[tuple[int, str]]:
        # never a server (the asynchronous strategies' first ranks), nor worker 0 unless asked
        first = _servers(a) if a.strategy.startswith(ASYNC) else 0 if a.any_worker else 1
        mine = [(pid, "worker") for pid in workers_of(job.pid)[first:]]
        return mine + [(pid, "joiner") for j in joins if j.poll() is None for pid in workers_of(j.pid)]

    def join(_: str) -> bool:
        if name != "elastic" or job.poll() is not None:
            return False
        joins.append(start([sys.executable, "-m", "shoal", "join", str(out)],
                           Path(a.out) / f"{name}-joins.log"))
        return True

    steps = Steps(out / "metrics.jsonl")
    killer = Killer(a, steps, victims, join, rng)
    steps.start()
    if kills:
        killer.start()
    try:
        code = job.wait(timeout=a.limit)
    finally:
        killer.done.set()
        if killer.is_alive():
            killer.join(timeout=10)
        steps.done.set()
        stop([job, *joins])
    wall = time.monotonic() - began
    if code != 0:  # said in the table; the other runs go on
        return {"failed": f"exit status {code}, see {name}.log", "kills": len(killer.kills),
                "wall_s": round(wall, 1)}
    return shoal_result(a, out, killer, steps, wall, joins)


def shoal_result(a: argparse.Namespace, out: Path, killer: Killer, steps: Steps, wall: float,
                 joins: list[subprocess.Popen]) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    changes = summary.get("membership_changes", [])
    restarts = summary.get("restarts", [])
    result = {"kills": len(killer.kills), "victims": dict(Counter(k["victim"] for k in killer.kills)),
              "joins_started": len(joins), "joined": sum(len(c.get("joined", [])) for c in changes),
              "joins_exit_codes": dict(Counter(str(j.returncode) for j in joins)),
              "restarts": len(restarts),
              "stalls_s": None if a.strategy.startswith(ASYNC) else killer.stalls(steps),
              "stall_s_membership_changes": [c.get("stall_s") for c in changes if "stall_s" in c],
              "steps": summary["steps"], "samples": summary["samples"],
              "steps_redone": sum(r["failed_at_step"] - r["resumed_from_step"] for r in restarts),
              "test_accuracy": summary["test_accuracy"], "wall_s": round(wall, 1),
              "workers_at_end": summary["workers"]}
    if (out / "samples").is_dir():
        counts = samples_recorded(out)
        result.update(samples_lost=a.epochs * ROWS - len(counts),
                      samples_repeated=sum(counts.values()) - len(counts))
    return result


def run_torchft(a: argparse.Namespace, rng: random.Random) -> dict:
    """torchft's DiLoCo, 4 replicas and a lighthouse; a killed replica is started again."""
    from soak_torchft import lighthouse

    out = Path(a.out) / "torchft"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.json*"):
        old.unlink()
    per_epoch = -(-ROWS // (16 * 4))
    rounds = -(-a.epochs * per_epoch // a.tau)
    house = lighthouse()
    began = time.monotonic()
    procs: dict[int, subprocess.Popen] = {}
    everything: list[subprocess.Popen] = []

    def launch(r: int) -> None:
        procs[r] = start([sys.executable, str(REPO / "benchmarks" / "soak_torchft.py"),
                          "--replica", str(r), "--lighthouse", house.address(), "--model", a.model,
                          "--rounds", str(rounds), "--tau", str(a.tau), "--lr", str(a.lr),
                          "--out", str(out)], out / f"replica{r}.log")
        everything.append(procs[r])

    def victims() -> list[tuple[int, str]]:
        return [(p.pid, f"replica {r}") for r, p in procs.items() if r and p.poll() is None]

    def restart(what: str) -> bool:
        if procs[0].poll() is not None:
            return False
        launch(int(what.split()[1]))
        return True

    for r in range(4):
        launch(r)
    steps = Steps(out / "steps0.jsonl")
    killer = Killer(a, steps, victims, restart, rng)
    steps.start()
    killer.start()
    try:
        code = procs[0].wait(timeout=a.limit)
        for p in procs.values():
            p.wait(timeout=120)
    finally:
        killer.done.set()
        killer.join(timeout=10)
        steps.done.set()
        stop(everything)
        house.shutdown()
    if code != 0:
        return {"failed": f"replica 0: exit status {code}, see torchft/replica0.log",
                "kills": len(killer.kills), "wall_s": round(time.monotonic() - began, 1)}
    return torchft_result(a, out, killer, steps, time.monotonic() - began, rounds)


def torchft_result(a: argparse.Namespace, out: Path, killer: Killer, steps: Steps, wall: float,
                   rounds: int) -> dict:
    counts: Counter = Counter()
    committed = Counter()
    for path in out.glob("rounds*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            committed[path.stem] += 1
            for epoch, rows in record["rows"]:
                counts.update((epoch, s) for s in rows if epoch < a.epochs)
    return {"kills": len(killer.kills), "victims": dict(Counter(k["victim"] for k in killer.kills)),
            "restarted_replicas": killer.replaced, "stalls_s": killer.stalls(steps),
            "rounds": rounds, "committed_rounds_by_replica": dict(sorted(committed.items())),
            "samples_lost": a.epochs * ROWS - len(counts),
            "samples_repeated": sum(counts.values()) - len(counts),
            "test_accuracy": json.loads((out / "result.json").read_text())["test_accuracy"],
            "wall_s": round(wall, 1)}


def table(results: dict[str, dict], ref: float, epochs: int) -> str:
    """The markdown table of the runs (``epochs``: the epochs of each)."""
    def cell(r: dict, key: str) -> str:
        return "-" if r.get(key) is None else str(r[key])

    rows = ["| run | kills | joins / restarts | longest stall (s) | median stall (s) | samples "
            "lost / repeated | steps redone | test accuracy (vs uninterrupted) | wall (s) | load |",
            "| --- | ---: | --- | ---: | ---: | --- | ---: | --- | ---: | --- |"]
    for name, r in results.items():
        if "failed" in r:
            rows.append(f"| {name} | {r['kills']} | failed: {r['failed']} | | | | | | "
                        f"{r['wall_s']} | {r['load'][0]:.1f} -> {r['load'][1]:.1f} |")
            continue
        stalls = sorted(r.get("stalls_s") or [0.0])
        longest, median = (f"{stalls[-1]:.2f}", f"{stalls[len(stalls) // 2]:.2f}") \
            if r.get("stalls_s") is not None else ("-", "-")
        again = {"elastic": f"{r.get('joined')} joined of {r.get('joins_started')} started",
                 "restarts": f"{r.get('restarts')} restarts",
                 "torchft": f"{r.get('restarted_replicas')} replicas restarted"}.get(name, "-")
        if "samples_lost" not in r and "samples" in r:  # restarts: the records' count
            r = {**r, "samples_lost": epochs * ROWS - r["samples"]}
        delta = 100 * (r["test_accuracy"] - ref)
        rows.append(f"| {name} | {r['kills']} | {again} | {longest} | {median} | "
                    f"{cell(r, 'samples_lost')} / "
                    f"{cell(r, 'samples_repeated')} | {cell(r, 'steps_redone')} | "
                    f"{100 * r['test_accuracy']:.2f} % ({delta:+.2f}) | {r['wall_s']} | "
                    f"{r['load'][0]:.1f} -> {r['load'][1]:.1f} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="benchmarks/models.py:mlp_1024x2")
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--strategy", default="diloco",
                   help="shoal's runs' (an asynchronous one: server 0 is never killed, and "
                        "its records are per epoch, so no stall is measured)")
    p.add_argument("--tau", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of kills a run")
    p.add_argument("--kill-every", type=float, default=30.0, help="mean seconds between kills")
    p.add_argument("--replace-after", type=float, default=10.0)
    p.add_argument("--runs", default="uninterrupted,elastic,restarts,torchft")
    p.add_argument("--limit", type=float, default=3600.0, help="seconds a run may take at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--any-worker", action="store_true",
                   help="kill worker 0 too in shoal's runs (not torchft's replica 0)")
    p.add_argument("--extra", default="",
                   help="more flags of shoal's runs, e.g. '--fragments 2 --overlap-steps 1'")
    p.add_argument("--out", default="runs/soak-elastic")
    a = p.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("soak: stopped (SIGTERM)"))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in background
    rng, results = random.Random(a.seed), {}
    for name in a.runs.split(","):
        load = os.getloadavg()[0]
        results[name] = (run_torchft(a, rng) if name == "torchft"
                         else run_shoal(a, name, name != "uninterrupted", rng))
        results[name]["load"] = [load, os.getloadavg()[0]]
        print(f"soak: {name}: {json.dumps(results[name])}", flush=True)
        (Path(a.out) / "soak.json").write_text(json.dumps(
            {"command": " ".join(sys.argv), "args": vars(a), "results": results}, indent=2) + "\n")
    ref = next((r["test_accuracy"] for n, r in sorted(results.items(), key=lambda i: i[0] != "uninterrupted")
                if "test_accuracy" in r), 0.0)
    (Path(a.out) / "soak.md").write_text(table(results, ref, a.epochs))
    print((Path(a.out) / "soak.md").read_text())


if __name__ == "__main__":
    main()
