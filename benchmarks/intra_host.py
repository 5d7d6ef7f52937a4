"""Intra-host all-reduce: Gloo against shoal's shared-memory path (``--intra-host shm``).

Collectives: the same processes all-reduce the same float32 vector through Gloo and through
:class:`shoal.core.intrahost.SharedReducer`, in alternation, ``--rounds`` times; rank 0 also
times ``a += b`` on the vector alone (the memory's limit). The table gives the medians of
the rounds (µs per all-reduce) and the ratios. Training (``--train``): ``shoal train
--strategy sync`` with each ``--intra-host`` against the hand-written DDP/Gloo loop of
``shoal.sweep.reference``, LeNet-5 on digit-sized inputs (1x8x8, 10 classes), and the
machine's ceiling (as many one-worker runs at once, no communication: their samples/s
added), in alternation. ``--vote``: ``shoal train --strategy sync`` with the stop vote at every step
(``SHOAL_STOP_VOTE_S=0``) against its default spacing, on each path. Run:

    .venv/bin/python benchmarks/intra_host.py --workers 2 4
    .venv/bin/python benchmarks/intra_host.py --train --workers 2
    .venv/bin/python benchmarks/intra_host.py --vote --workers 2 --rounds 7
    .venv/bin/python benchmarks/intra_host.py --train --workers 2 --model resnet20 --steps 60
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shoal.core.comm import Comm
from shoal.core.env import Environment, default_threads, free_port
from shoal.core.hostpath import join_host
from shoal.sweep.measure import measure_run
from shoal.sweep.reference import Workload, run_reference
from shoal.train.stopping import VOTE_SPACING_S

REPO = Path(__file__).resolve().parent.parent
#: LeNet-5's gradients on digits, a ResNet-20-sized vector, and two larger ones (bytes).
SIZES = (int(83.5 * 1024), 548 * 1024, 4 << 20, 16 << 20)


def _timed(run, reps: int) -> float:
    """µs per call of ``run()``, over ``reps`` calls after a barrier."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        run()
    return (time.perf_counter() - start) / reps * 1e6


def _rank(rank: int, world_size: int, port: int, rounds: int, results: mp.Queue) -> None:
    """One rank: every size, ``rounds`` rounds of Gloo, shared memory and (rank 0) a += b."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    env = Environment(rank=rank, world_size=world_size, local_world_size=world_size)
    comm = Comm(env, torch.device("cpu"))
    reducer = join_host(comm, "shm")
    assert reducer is not None
    rows, scale = [], 1.0 / world_size
    for nbytes in SIZES:
        a, b = torch.randn(nbytes // 4), torch.randn(nbytes // 4)
        reps = max(5, int(8e6 // nbytes))
        times: dict[str, list[float]] = {"add": [], "gloo": [], "shm": []}
        for _ in range(rounds):
            times["gloo"].append(_timed(lambda: dist.all_reduce(a), reps))  # noqa: B023
            times["shm"].append(_timed(lambda: reducer.all_reduce(a, scale), reps))  # noqa: B023
            dist.barrier()
            if rank == 0:
                start = time.perf_counter()
                for _ in range(reps):
                    a.add_(b)
                times["add"].append((time.perf_counter() - start) / reps * 1e6)
            a.copy_(b)  # keep the values finite
        rows.append((nbytes, {k: statistics.median(v) for k, v in times.items() if v}))
    if rank == 0:
        results.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _result(results: mp.Queue, procs: list) -> list:
    """Rank 0's rows, or an error as soon as a rank failed."""
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise SystemExit("a rank failed (see above)") from None


def collectives(world_size: int, rounds: int) -> None:
    """Print the collectives' table for ``world_size`` processes."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world_size, port, rounds, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        rows = _result(results, procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    print(f"\n{world_size} processes, float32, µs per all-reduce, median of {rounds} rounds\n")
    print("| vector | `a += b` | Gloo | shared memory | Gloo / shm | shm / `a += b` |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for nbytes, t in rows:
        print(f"| {nbytes / 1024:,.1f} KiB | {t['add']:,.1f} | {t['gloo']:,.0f} | "
              f"{t['shm']:,.1f} | {t['gloo'] / t['shm']:.1f}x | {t['shm'] / t['add']:.1f}x |")


def _shoal_cmd(w: Workload, world_size: int, threads: int, intra_host: str,
               strategy: tuple[str, ...], out: str) -> list[str]:
    return [sys.executable, "-m", "shoal", "train", *strategy, "--model", w.model,
            "--dataset", "synthetic", "--synthetic-shape", "x".join(map(str, w.shape)),
            "--synthetic-classes", str(w.classes),
            "--synthetic-samples", str(w.samples(world_size)), "--epochs", "1",
            "--batch-size", str(w.batch), "--workers", str(world_size),
            "--threads-per-worker", str(threads), "--lr", str(w.lr),
            "--momentum", str(w.momentum), "--schedule", "constant", "--log-every", "5",
            "--progress", "none", "--intra-host", intra_host, "--out", out]


def run_shoal(w: Workload, world_size: int, threads: int, intra_host: str,
              strategy: tuple[str, ...] = ("--strategy", "sync"),
              env: dict[str, str] | None = None) -> float:
    """samples/s of ``shoal train`` (``strategy``'s flags) ``--intra-host intra_host`` on ``w``
    (``env``: variables added to this process's for the run)."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(_shoal_cmd(w, world_size, threads, intra_host, strategy, out),
                       check=True, cwd=REPO, env={**os.environ, **(env or {})})
        return measure_run(Path(out), w.warmup)["samples_per_s"]


def ceiling(w: Workload, world_size: int, threads: int) -> float:
    """The machine's ceiling for ``world_size`` workers of ``w``: as many one-worker runs
    (no communication at all) at the same time, their samples/s added up."""
    with tempfile.TemporaryDirectory() as root:
        outs = [str(Path(root) / str(i)) for i in range(world_size)]
        procs = [subprocess.Popen(_shoal_cmd(w, 1, threads, "gloo", ("--strategy", "sync"), out),
                                  cwd=REPO) for out in outs]
        if any(p.wait() != 0 for p in procs):
            raise RuntimeError("a one-worker run failed")
        return sum(measure_run(Path(out), w.warmup)["samples_per_s"] for out in outs)


#: ``--model``'s input shapes: LeNet-5 on digit-sized inputs, ResNet-20 on CIFAR-sized ones.
SHAPES = {"lenet5": (1, 8, 8), "resnet20": (3, 32, 32)}


def training(world_size: int, rounds: int, batch: int, steps: int,
             model: str = "lenet5") -> None:
    """Print samples/s of shoal (Gloo, shm) and the hand-written DDP loop, alternated."""
    w = Workload(model=model, shape=SHAPES[model], batch=batch, steps=steps,
                 warmup=min(20, steps // 3))
    threads = default_threads(world_size)
    got: dict[str, list[float]] = {"gloo": [], "shm": [], "ddp": [], "ceiling": []}
    for _ in range(rounds):
        for mode in ("gloo", "shm"):
            got[mode].append(run_shoal(w, world_size, threads, mode))
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            got["ddp"].append(run_reference(w, world_size, threads, f.name)["samples_per_s"])
        got["ceiling"].append(ceiling(w, world_size, threads))
    med = {k: statistics.median(v) for k, v in got.items()}
    print(f"\n{model}, {'x'.join(map(str, SHAPES[model]))}, batch {batch}/worker, "
          f"{world_size} workers, {steps} steps, "
          f"median of {rounds} (samples/s; ceiling: {world_size} one-worker runs at once)\n")
    print("| hand-written DDP/Gloo | shoal sync, gloo | shoal sync, shm | ceiling | shm / DDP | "
          "shm / gloo | shm / ceiling | DDP / ceiling |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {med['ddp']:,.0f} | {med['gloo']:,.0f} | {med['shm']:,.0f} | "
          f"{med['ceiling']:,.0f} | {med['shm'] / med['ddp']:.2f}x | "
          f"{med['shm'] / med['gloo']:.2f}x | {med['shm'] / med['ceiling']:.2f} | "
          f"{med['ddp'] / med['ceiling']:.2f} |")
    print(f"\nall: {got}")


def periodic(world_size: int, rounds: int, batch: int, steps: int, strategy: str,
             tau: int) -> None:
    """Print samples/s of a periodic strategy's run on Gloo and on shm, alternated."""
    w = Workload(model="lenet5", shape=(1, 8, 8), batch=batch, steps=steps, warmup=20)
    flags = ("--strategy", strategy, "--tau", str(tau))
    got: dict[str, list[float]] = {"gloo": [], "shm": []}
    for _ in range(rounds):
        for mode in ("gloo", "shm"):
            got[mode].append(run_shoal(w, world_size, default_threads(world_size), mode, flags))
    med = {k: statistics.median(v) for k, v in got.items()}
    print(f"\n{strategy} --tau {tau}, LeNet-5, 1x8x8, batch {batch}/worker, {world_size} "
          f"workers, {steps} steps, median of {rounds} (samples/s)\n")
    print("| shoal, gloo | shoal, shm | shm / gloo |\n| ---: | ---: | ---: |")
    print(f"| {med['gloo']:,.0f} | {med['shm']:,.0f} | {med['shm'] / med['gloo']:.2f}x |")
    print(f"\nall: {got}")


def voting(world_size: int, rounds: int, batch: int, steps: int) -> None:
    """Print samples/s of ``shoal train --strategy sync`` with the stop vote at every step
    against the default spacing, on Gloo and on shm, alternated; and their ratio per round."""
    w = Workload(model="lenet5", shape=(1, 8, 8), batch=batch, steps=steps, warmup=20)
    # a vote at every step, as before the spacing; and the default spacing, whatever the
    # environment this runs in says
    spacings = {False: "0", True: str(VOTE_SPACING_S)}
    got: dict[tuple[str, bool], list[float]] = {}
    for _ in range(rounds):
        for mode in ("gloo", "shm"):
            for spaced in (False, True):
                got.setdefault((mode, spaced), []).append(run_shoal(
                    w, world_size, default_threads(world_size), mode,
                    env={"SHOAL_STOP_VOTE_S": spacings[spaced]}))
    print(f"\nsync, LeNet-5, 1x8x8, batch {batch}/worker, {world_size} workers, {steps} steps, "
          f"median of {rounds} (samples/s)\n")
    print("| path | a vote every step | spaced (default) | spaced / every step, per round |")
    print("| --- | ---: | ---: | ---: |")
    for mode in ("gloo", "shm"):
        before, after = got[(mode, False)], got[(mode, True)]
        ratio = statistics.median(b / a for a, b in zip(before, after, strict=True))
        print(f"| {mode} | {statistics.median(before):,.0f} | {statistics.median(after):,.0f} | "
              f"{ratio:.2f}x |")
    print(f"\nall: {got}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--train", action="store_true", help="time training instead")
    p.add_argument("--batch", type=int, default=32, help="per worker (--train)")
    p.add_argument("--steps", type=int, default=300, help="per run (--train)")
    p.add_argument("--strategy", default="sync", help="--train: sync (against a hand-written "
                   "DDP loop too), or a periodic strategy (local-sgd, easgd, diloco)")
    p.add_argument("--tau", type=int, default=1, help="a periodic strategy's period (--train)")
    p.add_argument("--vote", action="store_true", help="time sync's stop vote at every step "
                   "against its spacing")
    p.add_argument("--model", choices=sorted(SHAPES), default="lenet5",
                   help="--train with sync: the model (resnet20: compute-bound)")
    a = p.parse_args()
    for world_size in a.workers:
        if a.vote:
            voting(world_size, a.rounds, a.batch, a.steps)
        elif a.train and a.strategy != "sync":
            periodic(world_size, a.rounds, a.batch, a.steps, a.strategy, a.tau)
        elif a.train:
            training(world_size, a.rounds, a.batch, a.steps, a.model)
        else:
            collectives(world_size, a.rounds)


if __name__ == "__main__":
    main()
