"""shoal's input pipeline (``--loader-workers``) against a plain PyTorch DataLoader + DDP loop.

The benchmark writes an image folder of generated JPEGs itself (``--images`` training images
of ``--size`` x ``--size`` pixels in ``--classes`` classes, a tenth as many test images,
each a class colour plus noise, so the files are as costly to decode as photographs of
that size) and trains ResNet-18 (shoal's zoo, torchvision's architecture) on it with
``--workers`` processes, for every count of ``--loader-workers``:

- **shoal**: ``shoal train --model resnet18 --dataset imagefolder:DIR --loader-workers N``
  (strategy sync, constant learning rate, ``--stop-at-step`` after the timed steps);
- **plain**: the same number of processes joined by Gloo, each a ``DistributedDataParallel``
  ResNet-18 fed by ``torch.utils.data.DataLoader(num_workers=N, persistent_workers=N > 0,
  prefetch_factor=2)`` over a ``DistributedSampler``, each item decoded with Pillow and
  standardized, as shoal's ``imagefolder`` does; the same batch per worker, threads per
  worker (cores // workers) and optimizer.

Both are timed alike: rank 0's wall clock over the steps after ``--warmup``, and the share
of it spent waiting for the next batch (shoal's ``data`` time category; the plain loop's
``next(loader)``). Shown: samples/s, that data share, and shoal / plain. Run (a few
minutes on 2 cores):

    .venv/bin/python benchmarks/bench_loader.py --images 2000 --batch 8 --steps 8 --warmup 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
MEAN, STD = 0.5, 0.25  # the plain loop standardizes with fixed numbers; the cost is the same


# -- the data -----------------------------------------------------------------------------------
def write_folder(root: Path, images: int, classes: int, size: int, seed: int = 0) -> None:
    """``root/train/<class>/*.jpg`` and ``root/test/<class>/*.jpg``: a class colour plus
    noise per image, JPEG quality 90."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    colours = rng.integers(0, 256, (classes, 3))
    for split, count in (("train", images), ("test", max(classes, images // 10))):
        for i in range(count):
            c = i % classes
            folder = root / split / f"class{c:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            noise = rng.normal(0, 40, (size, size, 3))
            pixels = np.clip(colours[c] + noise, 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"{i:05d}.jpg", quality=90)


class PlainFolder(torch.utils.data.Dataset):
    """What a user writes: the files of ``root/train``, decoded and standardized per item."""

    def __init__(self, root: Path) -> None:
        classes = sorted(d.name for d in (root / "train").iterdir() if d.is_dir())
        self.items = [(f, label) for label, c in enumerate(classes)
                      for f in sorted((root / "train" / c).iterdir())]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.items[i]
        with Image.open(path) as img:
            arr = np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0
        return (torch.from_numpy(arr.transpose(2, 0, 1)) - MEAN) / STD, label


# -- the plain loop -----------------------------------------------------------------------------
def _plain_rank(rank: int, a: argparse.Namespace, port: int, out: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from shoal.models import build_model

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=a.workers)
    data = PlainFolder(Path(a.data))
    n = a.loader_workers
    loader = DataLoader(data, batch_size=a.batch, num_workers=n, persistent_workers=n > 0,
                        prefetch_factor=2 if n else None,
                        sampler=DistributedSampler(data, a.workers, rank, shuffle=True, seed=0))
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model("resnet18", (3, a.size, a.size), a.classes))
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    waits, ends = [], []
    batches = iter(loader)
    for _ in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        x, y = next(batches)
        waits.append(time.perf_counter() - t0)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ends.append(time.perf_counter())
    if rank == 0:
        wall = ends[-1] - ends[a.warmup - 1]
        with open(out, "w") as f:
            json.dump({"samples_per_s": a.steps * a.batch * a.workers / wall,
                       "data_fraction": sum(waits[a.warmup:]) / wall}, f)
    dist.destroy_process_group()


def run_plain(a: argparse.Namespace, data: Path, loader_workers: int) -> dict[str, float]:
    """The plain loop in a fresh interpreter (as shoal's run is), its result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plain.json"
        cmd = [sys.executable, __file__, "--plain", str(out), "--data", str(data),
               "--loader-workers-now", str(loader_workers), *_shared_flags(a)]
        subprocess.run(cmd, check=True, cwd=REPO)
        return json.loads(out.read_text())


def _shared_flags(a: argparse.Namespace) -> list[str]:
    return ["--workers", str(a.workers), "--batch", str(a.batch), "--steps", str(a.steps),
            "--warmup", str(a.warmup), "--size", str(a.size), "--classes", str(a.classes),
            "--threads", str(a.threads), "--lr", str(a.lr)]


# -- shoal --------------------------------------------------------------------------------------
def run_shoal(a: argparse.Namespace, data: Path, loader_workers: int) -> dict[str, float]:
    """``shoal train``; throughput and data share from rank 0's step records after the
    warm-up (everything the loop does counts: logging, bookkeeping)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "shoal", "train", "--model", "resnet18",
               "--dataset", f"imagefolder:{data}", "--workers", str(a.workers),
               "--threads-per-worker", str(a.threads), "--batch-size", str(a.batch),
               "--loader-workers", str(loader_workers), "--lr", str(a.lr), "--momentum", "0.9",
               "--schedule", "constant", "--epochs", "1",
               "--stop-at-step", str(a.warmup + a.steps), "--log-every", "1",
               "--progress", "none", "--out", out]
        subprocess.run(cmd, check=True, cwd=REPO)
        steps = [json.loads(line) for line in (Path(out) / "metrics.jsonl").open()]
        steps = [r for r in steps if r["event"] == "step"]
        first, timed = steps[a.warmup - 1], steps[a.warmup:]
        wall = timed[-1]["elapsed_s"] - first["elapsed_s"]
        data_s = sum(r["time_s"]["data"] for r in timed)
        return {"samples_per_s": a.steps * a.batch * a.workers / wall,
                "data_fraction": data_s / wall}


# -- the table ----------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=2000, help="training images (test: a tenth)")
    p.add_argument("--size", type=int, default=224, help="image side in pixels")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--workers", type=int, default=2, help="training processes")
    p.add_argument("--loader-workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--batch", type=int, default=8, help="per worker")
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--repeats", type=int, default=1, help="runs of each; the median counts")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads per worker (default: cores // workers)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--data", help="use this image folder instead of writing one")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--plain", help=argparse.SUPPRESS)  # the plain loop's result file
    p.add_argument("--loader-workers-now", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    a.threads = a.threads or max(1, len(os.sched_getaffinity(0)) // a.workers)
    if a.warmup < 1 or a.steps < 1:
        p.error("--warmup and --steps must be at least 1")
    if a.plain:  # a child of run_plain: the plain loop's processes
        import torch.multiprocessing as mp

        from shoal.core.env import free_port

        a.loader_workers = a.loader_workers_now
        mp.spawn(_plain_rank, (a, free_port(), a.plain), nprocs=a.workers)
        return
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(a.data) if a.data else Path(tmp) / "images"
        if not a.data:
            started = time.perf_counter()
            write_folder(data, a.images, a.classes, a.size)
            print(f"wrote {a.images} + {a.images // 10} JPEGs of {a.size}x{a.size} in "
                  f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
        rows = []
        for n in a.loader_workers:
            runs: dict[str, list[dict[str, float]]] = {"shoal": [], "plain": []}
            for _ in range(a.repeats):  # alternating, so a slow spell hits both
                runs["shoal"].append(run_shoal(a, data, n))
                runs["plain"].append(run_plain(a, data, n))
            row = {"loader_workers": n}
            for who, results in runs.items():
                row[f"{who}_samples_per_s"] = statistics.median(r["samples_per_s"] for r in results)
                row[f"{who}_data_fraction"] = statistics.median(r["data_fraction"] for r in results)
                row[f"{who}_runs"] = [round(r["samples_per_s"], 2) for r in results]
            row["ratio"] = row["shoal_samples_per_s"] / row["plain_samples_per_s"]
            rows.append(row)
            print(f"loader workers {n}: {json.dumps(row)}", file=sys.stderr, flush=True)
    print(f"ResNet-18, {a.workers} workers x {a.threads} threads, batch {a.batch} per worker, "
          f"{a.size}x{a.size} JPEGs ({a.images} training images), {a.steps} timed steps after "
          f"{a.warmup}, median of {a.repeats}\n")
    print("| loader workers | shoal samples/s | shoal data | plain samples/s | plain data "
          "| shoal / plain |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['loader_workers']} | {r['shoal_samples_per_s']:.1f} | "
              f"{100 * r['shoal_data_fraction']:.1f}% | {r['plain_samples_per_s']:.1f} | "
              f"{100 * r['plain_data_fraction']:.1f}% | {r['ratio']:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": {k: v for k, v in vars(a).items()
                                                         if k not in ("plain",)},
                                            "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
