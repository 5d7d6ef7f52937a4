"""Parallel functions: per-call overhead against a bare collective, and speedup on a CPU-bound
function. Prints markdown tables. Run:

    .venv/bin/python benchmarks/bench_parallel.py --workers 2
    .venv/bin/python benchmarks/bench_parallel.py --workers 2 --only collectives
    .venv/bin/python benchmarks/bench_parallel.py --workers 2 --only collectives \
        --ops broadcast all_gather gather scatter --sizes 1000 20875 262144 1000000

*Overhead*: a parallel function that returns an ``avg``-reduced tensor of S floats (its input
is a ``shoal.shared`` array, so no argument moves) against ``dist.all_reduce`` of S floats in
the same process group, timed in the same processes. The difference is what a call costs
beyond the one collective it needs: the command, running the function, the status round and
the bookkeeping. A second row per size uses ``reduce=None`` (no tensor moves at all).

*Collectives* (``--only collectives``): each of ``--ops`` (``shoal.all_reduce`` by default)
inside a function through the session's path in host memory (the default on one host) and
through Gloo (the path put aside), beside the bare ``torch.distributed`` call, alternating.

*Speedup*: a CPU-bound function (a stack of matrix products over the rows it gets) called
directly in one process and as a parallel function on ``--workers`` processes, one torch
thread per process, so the speedup is what the extra processes add; the direct call with
all cores' threads is listed too.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import torch
import torch.distributed as dist

import shoal


def echo(w):
    return w


def nothing(w):
    return None


def _bare(op: str, buf: torch.Tensor):
    """The bare ``torch.distributed`` call of ``op`` on ``buf`` (rank 0: the root)."""
    n, me = dist.get_world_size(), dist.get_rank()
    if op == "all_reduce":
        return lambda: dist.all_reduce(buf)
    if op == "broadcast":
        return lambda: dist.broadcast(buf, 0)
    rows = [torch.empty_like(buf) for _ in range(n)]
    if op == "all_gather":
        return lambda: dist.all_gather(rows, buf)
    if op == "gather":
        return lambda: dist.gather(buf, rows if me == 0 else None, 0)
    share = torch.empty_like(buf[:len(buf) // n])
    chunks = list(buf[:len(share) * n].split(len(share))) if me == 0 else None
    return lambda: dist.scatter(share, chunks, 0)


def bare_collective(w, reps, op="all_reduce"):
    """Time ``reps`` bare calls of ``op`` on ``w`` on every rank; rank 0's median per call."""
    return timed(_bare(op, w.clone()), reps)


def shoal_collective(w, reps, path, op="all_reduce"):
    """Time ``reps`` ``shoal.<op>`` calls of ``w`` on every rank (the shape check and the
    data), through the session's path in host memory (``shm``) or, with it put aside on
    every rank, through Gloo; rank 0's median per call."""
    from shoal.parallel import hostsums

    saved = list(hostsums._PATH)
    if path == "gloo":
        hostsums._PATH.clear()
    try:
        buf, call = w.clone(), getattr(shoal, op)
        return timed(lambda: call(buf), reps)
    finally:
        hostsums._PATH[:] = saved


def collectives(workers: int, sizes: list[int], reps: int, op: str = "all_reduce",
                rounds: int = 5) -> list[dict]:
    """``shoal.<op>`` inside a function through host memory and through Gloo, and the bare
    call, alternating ``rounds`` times; medians of the rounds."""
    f = shoal.function(shoal_collective, broadcast=["w"], reduce=None)
    f_bare = shoal.function(bare_collective, broadcast=["w"], reduce=None)
    rows = []
    with shoal.fork(workers, threads=1):
        for size in sizes:
            w = shoal.shared(torch.ones(size))
            f(w, 5, "shm", op), f_bare(w, 5, op)  # warm up
            times: dict[str, list[float]] = {"shm": [], "gloo": [], "bare": []}
            for _ in range(rounds):
                times["shm"].append(f(w, reps, "shm", op))
                times["gloo"].append(f(w, reps, "gloo", op))
                times["bare"].append(f_bare(w, reps, op))
            ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            rows.append({"op": op, "floats": size, **{f"{k}_ms": v for k, v in ms.items()},
                         "ratio": ms["gloo"] / ms["shm"]})
    return rows


def crunch(x, w, depth):
    for _ in range(depth):
        x = torch.tanh(x @ w)
    return x.sum(0)


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def overhead(workers: int, sizes: list[int], reps: int) -> list[dict]:
    f_echo = shoal.function(echo, broadcast=["w"], reduce="avg")
    f_none = shoal.function(nothing, broadcast=["w"], reduce=None)
    f_bare = shoal.function(bare_collective, broadcast=["w"], reduce=None)
    rows = []
    with shoal.fork(workers, threads=1):
        for size in sizes:
            w = shoal.shared(torch.ones(size))
            f_echo(w), f_none(w), f_bare(w, 5)  # warm up: functions and data reach the workers
            bare = f_bare(w, reps)
            call = timed(lambda w=w: f_echo(w), reps)
            control = timed(lambda w=w: f_none(w), reps)
            rows.append({"floats": size, "bare_ms": bare * 1e3, "call_ms": call * 1e3,
                         "overhead_ms": (call - bare) * 1e3, "none_ms": control * 1e3})
    return rows


def _independent(rows: int, dim: int, depth: int, reps: int, start, out) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, dim, generator=g)
    w = torch.randn(dim, dim, generator=g) / dim ** 0.5
    start.wait()
    out.put(timed(lambda: crunch(x, w, depth), reps))


def ceiling(workers: int, rows: int, dim: int, depth: int, reps: int) -> float:
    """Seconds for ``workers`` plain processes, no shoal and no communication, each doing its
    share at the same time: what the machine allows at this moment (other jobs included)."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_independent, args=(rows // workers, dim, depth, reps, start, out))
             for _ in range(workers)]
    for p in procs:
        p.start()
    time.sleep(3.0)  # let them import torch and build their data
    start.set()
    times = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return max(times)


def speedup(workers: int, rows: int, dim: int, depth: int, reps: int) -> list[dict]:
    """Alternate, ``reps`` times: the function called directly (1 process, 1 thread), the
    parallel call (``workers`` processes, 1 thread each) and the direct call with every core's
    threads; medians. Alternating keeps a change in the machine's load from favouring one."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, dim, generator=g)
    w = torch.randn(dim, dim, generator=g) / dim ** 0.5
    f = shoal.function(crunch, scatter=["x"], broadcast=["w"], reduce="sum")
    cores = len(os.sched_getaffinity(0))
    one, many, threaded = [], [], []
    with shoal.fork(workers, threads=1):
        torch.testing.assert_close(f(x, w, depth), crunch(x, w, depth), rtol=1e-4, atol=1e-3)
        for _ in range(reps):
            one.append(timed(lambda: crunch(x, w, depth), 1))
            many.append(timed(lambda: f(x, w, depth), 1))
            torch.set_num_threads(cores)
            threaded.append(timed(lambda: crunch(x, w, depth), 1))
            torch.set_num_threads(1)
    base = statistics.median(one)
    bound = ceiling(workers, rows, dim, depth, reps)
    return [{"setup": "1 process, 1 thread (direct call)", "s": base, "speedup": 1.0},
            {"setup": f"{workers} independent processes, no shoal (the machine's ceiling now)",
             "s": bound, "speedup": base / bound},
            {"setup": f"shoal.fork({workers}), 1 thread each", "s": statistics.median(many),
             "speedup": base / statistics.median(many)},
            {"setup": f"1 process, {cores} threads (direct call)", "s": statistics.median(threaded),
             "speedup": base / statistics.median(threaded)}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 1000, 100_000, 1_000_000])
    p.add_argument("--reps", type=int, default=200, help="calls per overhead measurement")
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--speed-reps", type=int, default=7)
    p.add_argument("--only", choices=["overhead", "speedup", "collectives"],
                   help="run one of the parts")
    p.add_argument("--ops", nargs="+", default=["all_reduce"],
                   choices=["all_reduce", "broadcast", "all_gather", "gather", "scatter"],
                   help="--only collectives: the collectives timed")
    a = p.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} on {len(os.sched_getaffinity(0))} cores\n")
    if a.only == "collectives":
        print(f"### Collectives inside a function, {a.workers} processes (ms per call, "
              f"median of 5 rounds of {a.reps})\n")
        print("| collective | floats | through host memory | through Gloo | Gloo / host memory "
              "| bare torch.distributed (Gloo) |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for op in a.ops:
            for r in collectives(a.workers, a.sizes, a.reps, op):
                print(f"| {op} | {r['floats']:,} | {r['shm_ms']:.3f} | {r['gloo_ms']:.3f} | "
                      f"**{r['ratio']:.1f}x** | {r['bare_ms']:.3f} |")
        return
    if a.only != "speedup":
        print(f"### Per-call overhead, {a.workers} processes (median of {a.reps} calls)\n")
        print("| floats reduced | bare all_reduce (ms) | shoal call, avg (ms) | overhead (ms) "
              "| shoal call, reduce=None (ms) |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for r in overhead(a.workers, a.sizes, a.reps):
            print(f"| {r['floats']:,} | {r['bare_ms']:.3f} | {r['call_ms']:.3f} | "
                  f"{r['overhead_ms']:.3f} | {r['none_ms']:.3f} |")
    if a.only == "overhead":
        return
    print(f"\n### Speedup of a CPU-bound function ({a.rows}x{a.dim} rows, {a.depth} matmul+tanh "
          f"layers, median of {a.speed_reps})\n")
    print("| setup | seconds per call | speedup vs 1 process |")
    print("| --- | ---: | ---: |")
    for r in speedup(a.workers, a.rows, a.dim, a.depth, a.speed_reps):
        print(f"| {r['setup']} | {r['s']:.3f} | {r['speedup']:.2f}x |")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
