"""Soak: a run with a worker killed at random every ~30 s under --max-restarts, against
the same run uninterrupted.

Both runs are the same `shoal train` command (the soak run adds --max-restarts); a killer
thread SIGKILLs one of the launcher's worker processes, chosen at random, every
U(0.5, 1.5) x --kill-every seconds. Reported: restarts, steps redone (failed at minus
resumed from, summed), samples lost (the uninterrupted run's samples minus the soak run's;
the goal is 0), time lost per failure (the wall-time difference over the restarts), the
final test accuracy of both and the largest parameter difference (resume is exact, so 0).
Writes soak.json and soak.md to --out. Run:

    .venv/bin/python benchmarks/soak.py --epochs 60 --kill-every 30 --out runs/soak
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def workers_of(launcher: int) -> list[int]:
    """The worker processes ``launcher`` started (multiprocessing spawn children)."""
    pids: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{launcher}/task").iterdir():
            with contextlib.suppress(OSError):
                pids += [int(p) for p in (task / "children").read_text().split()]
    found = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lenet5")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--kill-every", type=float, default=30.0, help="mean seconds between kills")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/soak")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
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
    result = {
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
    (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = "\n".join(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |"
                     for k, v in result.items())
    (out / "soak.md").write_text(f"| measure | value |\n| --- | --- |\n{rows}\n")
    print((out / "soak.md").read_text())


if __name__ == "__main__":
    main()
