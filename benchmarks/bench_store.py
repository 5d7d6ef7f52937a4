"""What sealing costs a store call: each call shoal makes, on a plain TCPStore client and on
the same store through a :class:`~shoal.core.sealed.SealedStore`, on loopback.

Each line gives a call's median time over the repeats (each repeat the mean of ``--calls``
calls) on both, and their difference. Run:

    .venv/bin/python benchmarks/bench_store.py --calls 2000 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from shoal.core.processes import loopback_store


def per_call(call: Callable[[int], object], calls: int) -> float:
    start = time.perf_counter()
    for i in range(calls):
        call(i)
    return (time.perf_counter() - start) / calls


def store_calls(store: dist.Store) -> dict[str, Callable[[int], object]]:
    """The calls shoal makes, by name, each on its ``i``-th key (``present`` is set)."""
    store.set("present", "1")
    return {
        "set": lambda i: store.set(f"k{i}", "x" * 32),
        "get": lambda i: store.get(f"k{i}"),
        "check (absent)": lambda i: store.check([f"none{i}"]),
        "check (present)": lambda i: store.check(["present"]),
        "add": lambda i: store.add("counter", 1),
        "compare_set (a vote)": lambda i: store.compare_set(f"vote{i}", "", "commit"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    server = loopback_store(30.0)
    plain = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
    stores = {"plain": dist.PrefixStore("p", plain), "sealed": dist.PrefixStore("s", server.client())}
    times: dict[str, dict[str, list[float]]] = {name: {} for name in stores}
    for _ in range(args.repeats):
        for name, store in stores.items():
            for call, run in store_calls(store).items():
                times[name].setdefault(call, []).append(per_call(run, args.calls))
        for store in stores.values():  # the next repeat's keys anew
            for i in range(args.calls):
                store.delete_key(f"k{i}")
                store.delete_key(f"vote{i}")
    print(f"{'call':<22}{'plain us':>10}{'sealed us':>11}{'added us':>10}")
    for call in times["plain"]:
        plain_us = statistics.median(times["plain"][call]) * 1e6
        sealed_us = statistics.median(times["sealed"][call]) * 1e6
        print(f"{call:<22}{plain_us:>10.1f}{sealed_us:>11.1f}{sealed_us - plain_us:>10.1f}")


if __name__ == "__main__":
    main()
