"""shoal's synchronous strategy against a minimal hand-written PyTorch DDP loop.

Both train the same model on the same data with the same per-worker batch, threads per
worker and steps, in alternation, several times; the table reports median samples/s and
the ratio shoal / DDP. Run:

    .venv/bin/python benchmarks/bench_ddp.py --model resnet20 --workers 1 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from shoal.core.env import default_threads
from shoal.sweep.measure import measure_run
from shoal.sweep.reference import Workload, run_reference

REPO = Path(__file__).resolve().parent.parent


def run_shoal(w: Workload, world_size: int, threads: int, log_every: int = 5) -> dict:
    """`shoal train --strategy sync`; throughput from rank 0's wall clock between the step
    records after warm-up (everything the loop does counts: logging, bookkeeping), measured
    as `shoal bench` measures it."""
    with tempfile.TemporaryDirectory() as out:
        shape = "x".join(map(str, w.shape))
        cmd = [sys.executable, "-m", "shoal", "train", "--strategy", "sync", "--model", w.model,
               "--dataset", "synthetic", "--synthetic-shape", shape,
               "--synthetic-classes", str(w.classes),
               "--synthetic-samples", str(w.samples(world_size)), "--epochs", "1",
               "--batch-size", str(w.batch), "--workers", str(world_size),
               "--threads-per-worker", str(threads), "--lr", str(w.lr),
               "--momentum", str(w.momentum), "--schedule", "constant",
               "--log-every", str(log_every), "--progress", "none", "--out", out]
        subprocess.run(cmd, check=True, cwd=REPO)
        return {"samples_per_s": measure_run(Path(out), w.warmup)["samples_per_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet20")
    p.add_argument("--shape", default="3x32x32")
    p.add_argument("--batch", type=int, default=32, help="per worker")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args()
    shape = tuple(int(d) for d in a.shape.split("x"))
    w = Workload(model=a.model, shape=shape, batch=a.batch, steps=a.steps, warmup=a.warmup)
    rows = []
    for world_size in a.workers:
        threads = default_threads(world_size)
        ours, ref = [], []
        for _ in range(a.repeats):  # alternate, so drifts in machine speed hit both alike
            ours.append(run_shoal(w, world_size, threads)["samples_per_s"])
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                ref.append(run_reference(w, world_size, threads, f.name)["samples_per_s"])
        rows.append({"workers": world_size, "threads": threads,
                     "shoal": statistics.median(ours), "ddp": statistics.median(ref),
                     "shoal_all": ours, "ddp_all": ref})
    print(f"\n{a.model}, batch {a.batch}/worker, {a.steps} steps ({a.warmup} warm-up), "
          f"median of {a.repeats}\n")
    print("| workers | threads/worker | shoal sync (samples/s) | plain DDP (samples/s) | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workers']} | {r['threads']} | {r['shoal']:,.0f} | {r['ddp']:,.0f} | "
              f"{r['shoal'] / r['ddp']:.3f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
