"""Issue 24's matrix: every asynchronous strategy and ``groups`` at ``shoal train``'s defaults
against ``sync``, on every (dataset, workers, epochs, seed) cell asked for.

Each run is the command a new user types (only ``--strategy``, ``--workers``, ``--epochs``,
``--seed``; ``--groups 2`` for groups, its one structural knob; ``--dataset synthetic
--synthetic-samples 1024`` for the second dataset), one at a time, as a subprocess. A run is
judged as ``tests/test_async_defaults.py`` judges it: the mean test accuracy of its last
three epochs, against sync's on the same cell. Every run is appended to
``OUT/bench_defaults.jsonl`` as it ends (an interrupted matrix goes on where it stopped when
run again with the same ``--out``), and a table per cell is printed::

    .venv/bin/python benchmarks/bench_defaults.py --out runs/defaults \\
        --datasets digits,synthetic --workers 2,4 --epochs 10,30 --seeds 1

``--strategy-extra "FLAGS"`` adds flags to the strategies' runs only (``--delay-compensation
5``, which sync does not take); ``--extra`` to every run. ``--lr-scale F`` runs the
strategies whose lr ``--momentum auto`` scales at ``F`` times that
lr (given as ``--lr``), to try another rule against the same sync runs (sync is never
scaled: its runs are shared by every ``F``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from shoal.core.files import read_records

STRATEGIES = ("async-sgd", "async-msgd", "async-easgd", "async-measgd", "hogwild",
              "hogwild-easgd", "groups")
DATASETS = {"digits": [], "synthetic": ["--dataset", "synthetic", "--synthetic-samples", "1024"],
            # digits' shape and model, Gaussian classes: the one tried where sync's defaults
            # are stable (docs/asynchronous.md "The second dataset, revisited")
            "synthetic-8x8": ["--dataset", "synthetic", "--synthetic-samples", "1024",
                              "--synthetic-shape", "1x8x8"],
            # the same at four times the samples (819 test samples, not 204)
            "synthetic-8x8-4k": ["--dataset", "synthetic", "--synthetic-samples", "4096",
                                 "--synthetic-shape", "1x8x8"]}
MARGIN = 1.5  #: points below sync's accuracy that issue 24 allows


def last_epochs(out: Path, n: int = 3) -> float | None:
    """The mean test accuracy (%) of a run's last ``n`` tested epochs; None if it has none."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return None
    records = read_records(path, "run's records")
    tested = [r["test_accuracy"] for r in records
              if r.get("event") == "epoch" and r.get("test_accuracy") is not None]
    return 100 * sum(tested[-n:]) / len(tested[-n:]) if tested else None


def auto_lr(strategy: str, workers: int) -> float | None:
    """The lr ``--momentum auto`` gives ``strategy`` on ``workers`` (None: it scales none)."""
    from shoal.config import TrainConfig
    from shoal.train.optim import resolve_momentum

    options = {"groups": 2} if strategy == "groups" else {}
    cfg = resolve_momentum(TrainConfig(strategy=strategy, strategy_options=options).validate(),
                           workers)
    return cfg.lr if cfg.lr_auto else None


def run(cell: dict[str, Any], strategy: str, out: Path, timeout: float,
        scale: float = 1.0, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One ``shoal train`` of ``strategy`` on ``cell``: its accuracy, exit status and time."""
    lr = auto_lr(strategy, cell["workers"]) if scale != 1.0 else None
    command = [sys.executable, "-m", "shoal", "train", "--strategy", strategy,
               *(["--lr", f"{lr * scale:.6g}"] if lr is not None else []),
               "--workers", str(cell["workers"]), "--epochs", str(cell["epochs"]),
               "--seed", str(cell["seed"]), *DATASETS[cell["dataset"]],
               *(["--groups", "2"] if strategy == "groups" else []),
               *extra, "--out", str(out), "--overwrite", "--progress", "none"]
    start = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        rc, tail = done.returncode, (done.stderr.strip().splitlines() or [""])[-1]
    except subprocess.TimeoutExpired:
        rc, tail = None, f"timed out after {timeout:g} s"
    return {**cell, "strategy": strategy, "lr_scale": scale if lr is not None else 1.0,
            "accuracy": last_epochs(out), "rc": rc,
            "wall_s": round(time.monotonic() - start, 2), "load": os.getloadavg()[0],
            "note": tail[:200] if rc else ""}


def label(r: dict[str, Any]) -> str:
    """A run's row: its strategy, and its lr scale where not 1."""
    scale = r.get("lr_scale", 1.0)
    return r["strategy"] if scale == 1.0 else f"{r['strategy']} x{scale:g}"


def table(results: list[dict[str, Any]]) -> str:
    """A markdown table: a row per strategy, a column per cell, each run's accuracy and its
    gap to sync's (a miss, more than the margin below, in bold); the misses counted."""
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return r["dataset"], r["workers"], r["epochs"], r["seed"]
    cells = sorted({key(r) for r in results})
    by = {(key(r), label(r)): r for r in results}
    head = ["strategy"] + [f"{d} w{w} e{e} s{s}" for d, w, e, s in cells] + ["misses"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    labels = sorted({label(r) for r in results},
                    key=lambda x: (("sync", *STRATEGIES).index(x.split(" ")[0]), x))
    for strategy in labels:
        row, misses, runs = [strategy], 0, 0
        for c in cells:
            r, ref = by.get((c, strategy)), by.get((c, "sync"))
            if r is None or r["accuracy"] is None:
                row.append("-" if r is None else f"failed ({r['rc']})")
                misses += r is not None
                runs += r is not None
                continue
            runs += 1
            if strategy == "sync" or ref is None or ref["accuracy"] is None:
                row.append(f"{r['accuracy']:.2f}")
                continue
            gap = ref["accuracy"] - r["accuracy"]
            missed = gap > MARGIN
            misses += missed
            text = f"{r['accuracy']:.2f} ({-gap:+.2f})"
            row.append(f"**{text}**" if missed else text)
        row.append("" if strategy == "sync" else f"{misses} of {runs}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def mean_table(results: list[dict[str, Any]]) -> str:
    """A markdown table of means over seeds: a row per strategy, a column per (dataset,
    workers, epochs) cell, the mean of its seeds' accuracies and its gap to sync's mean (a miss
    in bold; a failed run counts as 0%); sync's row gives its own spread over the seeds. A
    seed on which sync itself collapsed or failed (a non-zero exit) is left out of its cell
    for every strategy (sync's row names it): there is nothing to match."""
    def cell(r: dict[str, Any]) -> tuple[Any, ...]:
        return r["dataset"], r["workers"], r["epochs"]
    runs: dict[tuple[Any, ...], dict[int, float]] = {}
    for r in results:
        runs.setdefault((cell(r), label(r)), {})[r["seed"]] = r["accuracy"] or 0.0
    lost = {(cell(r), r["seed"]) for r in results if r["strategy"] == "sync" and r["rc"] != 0}
    cells = sorted({cell(r) for r in results})
    head = ["strategy"] + [f"{d} w{w} e{e}" for d, w, e in cells] + ["misses"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    labels = sorted({label(r) for r in results},
                    key=lambda x: (("sync", *STRATEGIES).index(x.split(" ")[0]), x))
    for strategy in labels:
        row, misses = [strategy], 0
        for c in cells:
            seeds = runs.get((c, strategy), {})
            accs = [a for seed, a in seeds.items() if (c, seed) not in lost]
            ref = [a for seed, a in runs.get((c, "sync"), {}).items() if (c, seed) not in lost]
            if not accs:
                row.append("-")
                continue
            mean = sum(accs) / len(accs)
            if strategy == "sync" or not ref:
                left = sorted(seed for seed in seeds if (c, seed) in lost)
                row.append(f"{mean:.2f} ({min(accs):.2f}-{max(accs):.2f}, n={len(accs)}"
                           + (f"; seed {', '.join(map(str, left))} collapsed" if left else "")
                           + ")")
                continue
            gap = sum(ref) / len(ref) - mean
            misses += gap > MARGIN
            text = f"{mean:.2f} ({-gap:+.2f})"
            row.append(f"**{text}**" if gap > MARGIN else text)
        row.append("" if strategy == "sync" else f"{misses} of {len(cells)}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--datasets", default="digits",
                    help=f"{', '.join(DATASETS)} (comma-separated)")
    ap.add_argument("--workers", default="2", help="comma-separated")
    ap.add_argument("--epochs", default="10", help="comma-separated")
    ap.add_argument("--seeds", default="1", help="comma-separated")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--timeout", type=float, default=900, help="seconds a run may take")
    ap.add_argument("--lr-scale", type=float, default=1.0,
                    help="run the strategies at this times auto's lr (sync as it is)")
    ap.add_argument("--extra", default="",
                    help="more shoal train flags for every run, sync's too (one string)")
    ap.add_argument("--strategy-extra", default="",
                    help="more shoal train flags for the strategies' runs, not sync's")
    args = ap.parse_args()
    strategies = ["sync", *[s for s in args.strategies.split(",") if s and s != "sync"]]
    for s in strategies:
        if s != "sync" and s not in STRATEGIES:
            ap.error(f"--strategies: {s!r} is not one of {', '.join(STRATEGIES)}")
    for d in args.datasets.split(","):
        if d not in DATASETS:
            ap.error(f"--datasets: {d!r} is not one of {', '.join(DATASETS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "bench_defaults.jsonl"
    results = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    flags = {"extra": args.extra, "strategy_extra": args.strategy_extra}
    other = next((r for r in results if {k: r.get(k, "") for k in flags} != flags), None)
    if other is not None:  # its runs would be taken as done, and tabled beside these
        ap.error(f"{log} holds runs with other flags (--extra {other.get('extra', '')!r} "
                 f"--strategy-extra {other.get('strategy_extra', '')!r}): use another --out")
    done = {(r["dataset"], r["workers"], r["epochs"], r["seed"], label(r)) for r in results}
    for dataset in args.datasets.split(","):
        for workers in map(int, args.workers.split(",")):
            for epochs in map(int, args.epochs.split(",")):
                for seed in map(int, args.seeds.split(",")):
                    cell = {"dataset": dataset, "workers": workers, "epochs": epochs, "seed": seed}
                    for strategy in strategies:
                        scale = args.lr_scale if auto_lr(strategy, workers) else 1.0
                        row = strategy if scale == 1.0 else f"{strategy} x{scale:g}"
                        if (*cell.values(), row) in done:
                            continue
                        name = f"{dataset}-w{workers}-e{epochs}-s{seed}-{row.replace(' ', '-')}"
                        extra = args.extra if strategy == "sync" else \
                            f"{args.extra} {args.strategy_extra}"
                        r = run(cell, strategy, args.out / "runs" / name, args.timeout, scale,
                                tuple(shlex.split(extra)))
                        r.update(flags)
                        results.append(r)
                        with log.open("a") as f:
                            f.write(json.dumps(r) + "\n")
                        acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.2f}%"
                        print(f"{name}: {acc} (exit {r['rc']}, {r['wall_s']} s, "
                              f"load {r['load']:.1f}) {r['note']}", flush=True)
    print(table(results))
    print()
    print(mean_table(results))


if __name__ == "__main__":
    main()
