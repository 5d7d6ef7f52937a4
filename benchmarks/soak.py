"""Soak: a run with a worker killed at random every ~30 s under --max-restarts, against
the same run uninterrupted; or (--async STRATEGY) an asynchronous run through SIGTERM and
--resume cycles with workers killed in between.

Both runs are the same `shoal train` command (the soak run adds --max-restarts); a killer
thread SIGKILLs one of the launcher's worker processes, chosen at random, every
U(0.5, 1.5) x --kill-every seconds. Reported: restarts, steps redone (failed at minus
resumed from, summed), samples lost (the uninterrupted run's samples minus the soak run's;
the goal is 0), time lost per failure (the wall-time difference over the restarts), the
final test accuracy of both and the largest parameter difference (resume is exact, so 0).

--async STRATEGY [--elastic]: one run, `shoal train --resume auto` started again each time it stops,
until it completes. Every U(0.5, 1.5) x --kill-every seconds an event: SIGTERM to the
launcher (a share --term-share of them; the run checkpoints, exits 143, and is started
again) or SIGKILL of a random live worker (the run goes on without it; a later --resume
brings it back). Reported: cycles, SIGTERMs, kills, the epoch records lost and doubled
(goal 0: every epoch recorded exactly once), the steps each worker trained against the
run's (a worker killed after the last SIGTERM stays short: the run completed without it),
and the final test accuracy. With --elastic (and --record-samples) a killed worker's rest is
dealt to the others and the next --resume brings it back; reported too: the samples never
trained and trained twice over all cycles (goal 0 both).

Writes soak.json and soak.md to --out. Run:

    .venv/bin/python benchmarks/soak.py --epochs 60 --kill-every 30 --out runs/soak
    .venv/bin/python benchmarks/soak.py --async async-easgd --model mlp --epochs 300 \
        --kill-every 8 --out runs/soak-async
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def children(pid: int) -> list[int]:
    """``pid``'s child processes (of every thread of it)."""
    pids: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


#: How a rank's process shows in ``ps`` (shoal.core.guard.name_process names it).
RANK_NAMES = (b"shoal worker ", b"shoal server ")


def workers_of(launcher: int) -> list[int]:
    """The rank processes (servers, then workers) below ``launcher``, in rank order (it
    starts them one after the other: by start time, then pid), found by their names in
    ``ps``: the fork server's children, a keeper's, or spawned ones alike."""
    found, todo = [], children(launcher)
    while todo:
        pid = todo.pop()
        todo += children(pid)
        with contextlib.suppress(OSError, ValueError, IndexError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            if cmdline.startswith(RANK_NAMES) and fields[0] != "Z":
                found.append((int(fields[19]), pid))
    return [pid for _, pid in sorted(found)]


def train(cmd: list[str], kill_every: float | None, rng: random.Random) -> tuple[float, list]:
    """Run ``cmd``; with ``kill_every``, kill a random worker every ~that many seconds.
    Returns the wall time and the kills (time, pid)."""
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
    kills: list[tuple[float, int]] = []
    done = threading.Event()
    start = time.monotonic()

    def killer() -> None:
        while not done.wait(rng.uniform(0.5, 1.5) * kill_every):
            workers = workers_of(proc.pid)
            if workers:
                victim = rng.choice(workers)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
                    kills.append((time.monotonic() - start, victim))

    thread = threading.Thread(target=killer, daemon=True)
    if kill_every:
        thread.start()
    try:
        code = proc.wait()
    finally:
        done.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    if code != 0:
        sys.exit(f"soak: {' '.join(cmd)} exited with {code}")
    return time.monotonic() - start, kills


def sync_soak(a: argparse.Namespace, out: Path) -> dict[str, object]:
    """The run uninterrupted and under random kills with --max-restarts."""
    base = [sys.executable, "-m", "shoal", "train", "--model", a.model, "--dataset", a.dataset,
            "--workers", str(a.workers), "--epochs", str(a.epochs), "--progress", "none",
            "--checkpoint-every", str(a.checkpoint_every), "--log-every", "1", "--overwrite"]
    rng = random.Random(a.seed)
    ref_wall, _ = train([*base, "--out", str(out / "uninterrupted")], None, rng)
    soak_wall, kills = train([*base, "--out", str(out / "soak"), "--max-restarts", "1000"],
                             a.kill_every, rng)
    ref = json.loads((out / "uninterrupted" / "summary.json").read_text())
    soak = json.loads((out / "soak" / "summary.json").read_text())
    restarts = soak.get("restarts", [])
    a_params = torch.load(out / "uninterrupted" / "checkpoint.pt", weights_only=True)["model"]
    b_params = torch.load(out / "soak" / "checkpoint.pt", weights_only=True)["model"]
    steps = [json.loads(line)["step"] for line in (out / "soak" / "metrics.jsonl").open()
             if json.loads(line)["event"] == "step"]
    return {
        "command": " ".join(base[2:]),
        "uninterrupted_wall_s": ref_wall, "soak_wall_s": soak_wall,
        "kills": len(kills), "restarts": len(restarts),
        "steps": soak["steps"], "steps_redone": sum(r["failed_at_step"] - r["resumed_from_step"]
                                                   for r in restarts),
        "samples_lost": ref["samples"] - soak["samples"],
        "steps_logged_once_each": steps == list(range(1, ref["steps"] + 1)),
        "time_lost_per_failure_s": (soak_wall - ref_wall) / len(restarts) if restarts else 0.0,
        "uninterrupted_test_accuracy": ref["test_accuracy"],
        "soak_test_accuracy": soak["test_accuracy"],
        "max_param_diff": max((a_params[k].double() - b_params[k].double()).abs().max().item()
                              for k in a_params),
    }


def epoch_records(run: Path) -> int:
    """How many epoch records ``run``'s metrics.jsonl holds."""
    with contextlib.suppress(OSError):
        return (run / "metrics.jsonl").read_text().count('"event": "epoch"')
    return 0


def cycle(cmd: list[str], run: Path, a: argparse.Namespace,
          rng: random.Random) -> tuple[int, int, int]:
    """One invocation of the asynchronous run: once it records an epoch (it is training),
    events every ~``a.kill_every`` s until it exits: SIGTERM to it (then no more events) or
    SIGKILL of a random live worker (never the last). Returns its exit status, SIGTERMs and
    kills."""
    before = epoch_records(run)
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL)
    terms = kills = 0
    killed: set[int] = set()
    try:
        while proc.poll() is None and epoch_records(run) <= before:
            time.sleep(0.05)
        while proc.poll() is None:
            deadline = time.monotonic() + rng.uniform(0.5, 1.5) * a.kill_every
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if proc.poll() is not None or terms:
                continue
            live = [w for w in workers_of(proc.pid)[a.servers:] if w not in killed]
            if rng.random() < a.term_share or len(live) < 2:
                proc.send_signal(signal.SIGTERM)
                terms += 1
            else:
                victim = rng.choice(live)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
                    killed.add(victim)
                    kills += 1
        return proc.wait(), terms, kills
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def async_soak(a: argparse.Namespace, out: Path) -> dict[str, object]:
    """The asynchronous run through SIGTERM and --resume cycles and worker kills."""
    run = out / "soak-async"
    cmd = [sys.executable, "-m", "shoal", "train", "--model", a.model, "--dataset", a.dataset,
           "--workers", str(a.workers), "--epochs", str(a.epochs), "--progress", "none",
           "--strategy", a.strategy, "--out", str(run),
           *(["--servers", str(a.servers)] if a.servers != 1 else []),  # hogwild takes none
           "--resume", "auto", *(["--elastic", "--record-samples"] if a.elastic else [])]
    rng = random.Random(a.seed)
    shutil.rmtree(run, ignore_errors=True)
    started, codes, terms, kills = time.monotonic(), [], 0, 0
    trail: list[dict[str, int]] = []
    while not codes or codes[-1] not in (0, 3):  # 3: completed without a killed worker
        code, t, k = cycle(cmd, run, a, rng)
        codes, terms, kills = codes + [code], terms + t, kills + k
        if a.elastic:  # what each invocation left: the records' count against the files'
            done = json.loads((run / "summary.json").read_text())
            trail.append({"exit": code, "kills": k, "samples_in_records": done["samples"],
                          "samples_recorded": sum(samples_recorded(run).values())})
        # -15: the signal came after the job's end, once the launcher stopped passing it on
        if code not in (0, 3, 143, -15) or len(codes) > 1000:
            sys.exit(f"soak: {' '.join(cmd)} exited with {code}")
    summary = json.loads((run / "summary.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    epochs = Counter(r["epoch"] for r in records if r["event"] == "epoch")
    saved = torch.load(run / "checkpoint.pt", weights_only=True)
    per_epoch = summary["steps"] // summary["epochs"]
    worker_steps = [own["strategy"]["steps"] if own is not None else None
                    for own in saved["ranks"]]
    elastic = {} if not a.elastic else {**samples_once(run, a.epochs, a.dataset),
                                        "membership_changes": len(summary["membership_changes"])}
    return {
        "command": " ".join(cmd[2:]), "wall_s": time.monotonic() - started,
        "cycles": len(codes), "sigterms": terms, "worker_kills": kills,
        "exit_statuses": dict(Counter(map(str, codes))),
        "epoch_records_lost": sum(1 for e in range(1, a.epochs + 1) if e not in epochs),
        "epoch_records_doubled": sum(n - 1 for n in epochs.values()),
        "worker_steps": worker_steps, "run_steps": per_epoch * a.epochs,
        "workers_short_at_the_end": sum(s is None or s < per_epoch * a.epochs
                                        for s in worker_steps),
        # Epochs recorded while a worker was lost miss its rows (it trains them again after
        # the next --resume, from its last checkpoint); the workers' own counts are exact.
        "samples_in_records": summary["samples"],
        "samples_trained_by_workers": sum(own["strategy"]["samples"] for own in saved["ranks"]
                                          if own is not None),  # None: lost at the end
        "lost_workers_at_the_end": len(summary.get("lost_workers", [])),
        "test_accuracy": summary["test_accuracy"],
        **elastic, **({"invocations": trail} if trail else {}),
    }


def samples_recorded(run: Path) -> Counter:
    """How often each (epoch, sample) is in ``run``'s --record-samples files."""
    counts: Counter = Counter()
    for path in (run / "samples").glob("worker*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            counts.update((record["epoch"], s) for s in record["samples"])
    return counts


def samples_once(run: Path, epochs: int, dataset: str) -> dict[str, int]:
    """--elastic: the (epoch, sample) pairs of --record-samples never trained and trained
    twice or more (goal 0 both: every kill is dealt, every stop a SIGTERM)."""
    from shoal.data import load_dataset

    rows = len(load_dataset(dataset).train)
    counts = samples_recorded(run)
    return {"samples_never_trained": sum(1 for e in range(epochs) for s in range(rows)
                                         if (e, s) not in counts),
            "samples_trained_twice": sum(n > 1 for n in counts.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lenet5")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--kill-every", type=float, default=30.0, help="mean seconds between events")
    p.add_argument("--async", dest="strategy", metavar="STRATEGY",
                   help="an asynchronous strategy: SIGTERM/--resume cycles and worker kills")
    p.add_argument("--servers", type=int, default=1, help="with --async")
    p.add_argument("--elastic", action="store_true",
                   help="with --async: --elastic --record-samples (a kill is dealt to the "
                        "others, a --resume brings the worker back); every sample once")
    p.add_argument("--term-share", type=float, default=0.5,
                   help="with --async: the share of events that are SIGTERMs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/soak")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = async_soak(a, out) if a.strategy else sync_soak(a, out)
    (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = "\n".join(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |"
                     for k, v in result.items())
    (out / "soak.md").write_text(f"| measure | value |\n| --- | --- |\n{rows}\n")
    print((out / "soak.md").read_text())


if __name__ == "__main__":
    main()
