"""Hierarchical sums and one replica a host, on 2 emulated hosts x 2 processes (issue 57).

Two emulated hosts (``shoal.emulate.Cluster``: a network namespace each, their veth links
rate-limited with ``tbf``; needs root) run ``shoal train`` (LeNet-5 on digits) under
torchrun, two processes a host, once per variant and repeat, the variants alternating:

- ``sync-flat``: ``--strategy sync --intra-host gloo``: DDP's buckets through Gloo over all
  four ranks (a rank's bytes cross the link);
- ``sync-hier``: ``--strategy sync`` (``--intra-host auto``): each host sums in its shared
  memory, one leader a host sums across the link (Gloo), then back inside the host;
- ``diloco-hier``: ``--strategy diloco --host-sync``: each host's processes are one replica
  (gradients averaged in the host's memory every step), DiLoCo couples the two hosts;
- ``diloco-flat``: ``--strategy diloco --intra-host gloo``: DiLoCo over four workers.

Every variant trains the same epochs at the same global batch (``--batch-size`` a process)
and tests every epoch. Measured: the bytes each host's link sent and received (its veth's
counters, read in its namespace) over the whole run (rendezvous, store and heartbeats
included) and while shoal trained (the counters sampled every half second, the window the
``wall_time_s`` before ``summary.json`` was written: checkpoints included, which gather
every rank's part to rank 0 at each epoch's end unless ``--checkpoint-every`` says
otherwise); samples/s (``summary.json``) and the median of the epochs after the first (a
one-time cost, such as DiLoCo's first outer step importing ``torch._dynamo``, falls in the
first); the first epoch whose test accuracy reaches ``--target`` and the wall time then
(``metrics.jsonl``'s ``elapsed_s``: evaluation included); the final test accuracy. The
tables give medians and ratios to ``sync-flat``; every run and the medians go, one JSON
object a line, to ``--out``. Run::

    sudo .venv/bin/python benchmarks/hierarchical.py --rates 100mbit 10mbit --reps 5
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from accelerate_wan import counters  # the veth counters' reader (benchmarks/accelerate_wan.py)

from shoal.emulate import Cluster, terminate_as_exception
from shoal.errors import ShoalError

REPO = Path(__file__).resolve().parent.parent
VARIANTS = {
    "sync-flat": ["--strategy", "sync", "--intra-host", "gloo"],
    "sync-hier": ["--strategy", "sync"],
    "diloco-hier": ["--strategy", "diloco", "--host-sync"],
    "diloco-flat": ["--strategy", "diloco", "--intra-host", "gloo"],
}
LABELS = {"sync-flat": "flat sync (Gloo, 4 ranks)",
          "sync-hier": "hierarchical sync (shm + leaders)",
          "diloco-hier": "hierarchical DiLoCo (--host-sync: 2 replicas)",
          "diloco-flat": "flat DiLoCo (Gloo, 4 replicas)"}


def reached(epochs: list[dict], target: float) -> tuple[int | None, float | None]:
    """The first epoch whose test accuracy is at least ``target`` and the run's wall time
    then (``None, None``: not reached)."""
    for r in epochs:
        if (r.get("test_accuracy") or 0.0) >= target:
            return r["epoch"], r["elapsed_s"]
    return None, None


class Sampler:
    """Both hosts' link counters every ``every`` seconds, in a thread, stamped with
    ``time.time()``: the bytes of a window inside the run (its training) interpolate them."""

    def __init__(self, cluster: Cluster, every: float = 0.5) -> None:
        self.cluster, self.every = cluster, every
        self.points: list[tuple[float, int]] = []  # (time, both hosts' tx + rx, summed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _read(self) -> None:
        total = sum(sum(counters(self.cluster, h)) for h in range(self.cluster.hosts))
        self.points.append((time.time(), total))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._read()
            self._stop.wait(self.every)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._read()

    def at(self, t: float) -> float:
        """Bytes counted by time ``t`` (linear between the two samples around it)."""
        pts = self.points
        for (t0, b0), (t1, b1) in zip(pts, pts[1:], strict=False):
            if t0 <= t <= t1:
                return b0 + (b1 - b0) * ((t - t0) / (t1 - t0) if t1 > t0 else 1.0)
        return pts[0][1] if t < pts[0][0] else pts[-1][1]


def epochs_of(metrics: Path) -> list[dict]:
    """The epoch records of ``metrics.jsonl``."""
    return [r for r in map(json.loads, metrics.read_text().splitlines())
            if r.get("event") == "epoch"]


def run(cluster: Cluster, name: str, a: argparse.Namespace) -> dict:
    """One run of variant ``name``: its numbers, or ``error`` when it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out, log = Path(tmp) / "run", Path(tmp) / "log.txt"
        program = ["-m", "shoal", "train", "--model", "lenet5", "--dataset", "digits",
                   "--epochs", str(a.epochs), "--batch-size", str(a.batch_size),
                   "--tau", str(a.tau), "--threads-per-worker", "1", "--seed", str(a.seed),
                   "--progress", "none", "--out", str(out), *VARIANTS[name]]
        if a.checkpoint_every:  # else a checkpoint at each epoch's end, gathered to rank 0
            program += ["--checkpoint-every", str(a.checkpoint_every)]
        if name.startswith("sync"):
            program.remove("--tau")
            program.remove(str(a.tau))
        before = [counters(cluster, h) for h in range(cluster.hosts)]
        start = time.monotonic()
        with Sampler(cluster) as sampler:
            try:
                code = cluster.torchrun(program, nproc_per_node=2, timeout=a.timeout, log=log,
                                        env={"OMP_NUM_THREADS": "1"})
            except ShoalError as exc:  # the run's timeout: its processes are gone already
                code, why = -1, str(exc)
            else:
                why = f"exit {code}"
        seconds = time.monotonic() - start
        after = [counters(cluster, h) for h in range(cluster.hosts)]
        summary = out / "summary.json"
        base = {"variant": name, "rate": cluster.rate, "run_s": seconds,
                "checkpoint_every": a.checkpoint_every,
                "load": os.getloadavg()[0]}
        if code or not summary.exists():
            tail = log.read_text()[-3000:] if log.exists() else ""
            print(f"{name} at {cluster.rate}: {why}\n{tail}", file=sys.stderr, flush=True)
            return {**base, "error": why}
        s = json.loads(summary.read_text())
        end = summary.stat().st_mtime  # written as training ends; it began wall_time_s before
        epochs = epochs_of(out / "metrics.jsonl")
    epoch, at = reached(epochs, a.target)
    link = [(b[0] - p[0], b[1] - p[1]) for p, b in zip(before, after, strict=True)]
    later = [r["samples_per_s"] for r in epochs[1:] if r.get("samples_per_s")]
    return {**base, "link_tx": [t for t, _ in link], "link_rx": [r for _, r in link],
            "link_bytes": statistics.mean(t + r for t, r in link),  # a host's, tx + rx
            # a host's, tx + rx, while shoal trained (its wall time before summary.json)
            "train_link_bytes": (sampler.at(end) - sampler.at(end - s["wall_time_s"]))
            / cluster.hosts,
            "samples_per_s": s["samples_per_s"], "test_accuracy": s["test_accuracy"],
            # the epochs after the first (one-time costs, e.g. imports, fall in the first)
            "later_samples_per_s": statistics.median(later) if later else None,
            "first_epoch_s": epochs[0]["elapsed_s"] if epochs else None,
            "steps": s["steps"], "epochs": s["epochs"], "wall_s": s["wall_time_s"],
            "bytes_sent": s["bytes_sent"], "target_epoch": epoch, "time_to_target": at,
            "accuracy_by_epoch": [r.get("test_accuracy") for r in epochs]}


KEYS = ("link_bytes", "train_link_bytes", "samples_per_s", "later_samples_per_s",
        "test_accuracy", "wall_s", "first_epoch_s", "load")


def medians(runs: list[dict]) -> dict:
    """Medians of the runs that finished; time to target over those that reached it."""
    done = [r for r in runs if "error" not in r]
    m: dict = {"runs": len(runs), "failed": len(runs) - len(done)}
    for k in KEYS:
        m[k] = statistics.median(r[k] for r in done) if done else None
    hits = [r for r in done if r["time_to_target"] is not None]
    m["reached"] = len(hits)
    m["time_to_target"] = statistics.median(r["time_to_target"] for r in hits) if hits else None
    m["target_epoch"] = statistics.median(r["target_epoch"] for r in hits) if hits else None
    return m


def table(found: dict[str, dict], target: float, epochs: int) -> str:
    """The markdown table of one rate: medians, and ratios to flat sync."""
    ref = found.get("sync-flat", {})

    def ratio(name: str, key: str) -> str:
        x, y = found[name].get(key), ref.get(key)
        return f"{x / y:.2f}x" if x is not None and y else "-"

    lines = ["| variant | MB a host's link, run | MB, training | / flat sync | samples/s "
             "| after epoch 1 | / flat sync | first epoch s "
             f"| time to {100 * target:.0f}% s (epoch) | reached | final acc | train s | load |",
             "| --- |" + " ---: |" * 12]
    for name, m in found.items():
        if m["link_bytes"] is None:
            lines.append(f"| {LABELS[name]} | failed {m['failed']}/{m['runs']} |" + " - |" * 11)
            continue
        hit = f"{m['time_to_target']:.1f} ({m['target_epoch']:g})" \
            if m["time_to_target"] is not None else f"not in {epochs} epochs"
        lines.append(
            f"| {LABELS[name]} | {m['link_bytes'] / 1e6:,.2f} | "
            f"{m['train_link_bytes'] / 1e6:,.2f} | {ratio(name, 'train_link_bytes')} | "
            f"{m['samples_per_s']:,.0f} | {m['later_samples_per_s']:,.0f} | "
            f"{ratio(name, 'later_samples_per_s')} | {m['first_epoch_s']:.1f} | {hit} | "
            f"{m['reached']}/{m['runs'] - m['failed']} | {100 * m['test_accuracy']:.1f}% | "
            f"{m['wall_s']:.1f} | {m['load']:.1f} |")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", nargs="+", default=["100mbit", "10mbit"],
                   help="each host's link rate, each way; one cluster a rate")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--reps", type=int, default=3, help="runs of each variant (median)")
    p.add_argument("--epochs", type=int, default=15, help="epochs of every run")
    p.add_argument("--batch-size", type=int, default=16, help="per process (4 processes)")
    p.add_argument("--tau", type=int, default=16, help="DiLoCo's local steps")
    p.add_argument("--seed", type=int, default=0, help="shoal train's --seed")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="STEPS",
                   help="shoal train's --checkpoint-every (default: none, so a checkpoint at "
                        "each epoch's end; more steps than the run: only the last one)")
    p.add_argument("--target", type=float, default=0.95, help="the test accuracy to reach")
    p.add_argument("--timeout", type=float, default=240, help="seconds a run may take")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "hierarchical.jsonl",
                   help="JSON lines appended here")
    p.add_argument("--table-from", default=None, metavar="DATE",
                   help="run nothing: the tables of --out's runs stamped DATE (a cut-short run)")
    a = p.parse_args(argv)
    a.variants = a.variants.split(",")
    unknown = [v for v in a.variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    if a.reps < 1 or a.epochs < 1 or a.tau < 1 or a.batch_size < 1:
        p.error("--reps, --epochs, --tau and --batch-size must be at least 1")
    return a


def tables_from(path: Path, stamp: str, a: argparse.Namespace) -> None:
    """Print the tables of the runs in ``path`` stamped ``stamp`` (those that finished)."""
    rows: dict[str, dict[str, list[dict]]] = {}
    for r in map(json.loads, path.read_text().splitlines()):
        if r.get("date") == stamp and "variant" in r:
            rows.setdefault(r["rate"], {}).setdefault(r["variant"], []).append(r)
    for rate, by_variant in rows.items():
        found = {v: medians(by_variant[v]) for v in VARIANTS if v in by_variant}
        print(f"\n### {rate}\n\n{table(found, a.target, a.epochs)}")


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    if a.table_from is not None:
        tables_from(a.out, a.table_from, a)
        return
    a.out.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    tables = []
    with terminate_as_exception(), a.out.open("a") as out:
        for rate in a.rates:
            rows: dict[str, list[dict]] = {v: [] for v in a.variants}
            with Cluster(hosts=2, rate=rate) as cluster:
                for rep in range(a.reps):  # the variants alternate: the load drifts alike
                    for name, runs in rows.items():
                        runs.append(run(cluster, name, a))
                        line = {"date": stamp, "rep": rep, **runs[-1]}
                        out.write(json.dumps(line) + "\n")
                        out.flush()
                        print(json.dumps(line), file=sys.stderr, flush=True)
            found = {name: medians(runs) for name, runs in rows.items()}
            out.write(json.dumps({"date": stamp, "machine": platform.node(), "rate": rate,
                                  "config": config, "medians": found}) + "\n")
            out.flush()
            tables.append(f"\n### {rate}\n\n{table(found, a.target, a.epochs)}")
            print(tables[-1], flush=True)
    print(f"\nLeNet-5 on digits, 2 emulated hosts x 2 processes, batch {a.batch_size} a "
          f"process, {a.epochs} epochs, DiLoCo tau {a.tau}; median of {a.reps}")
    print("\n".join(tables))


if __name__ == "__main__":
    main()
