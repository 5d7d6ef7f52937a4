"""What the owner-only gate costs a store call: torch's TCPStore served on loopback, reached
directly and through a :class:`~shoal.core.gate.Gate`, from a client in another process (as
a job's workers reach their launcher's store).

This process serves both stores, as a launcher does, and starts a client process per store
and repeat, alternately; the client times each call (the mean of ``--calls`` calls), and this
process measures the CPU it spent itself meanwhile (the store's server thread, and the
gate's threads when gated). Each line gives a call's median over the repeats, direct and
gated, and the difference; the last, this process's CPU per call. Run (Linux):

    .venv/bin/python benchmarks/store_gate.py --calls 2000 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import statistics
import subprocess
import sys
from datetime import timedelta

import torch.distributed as dist
from bench_store import per_call, store_calls

from shoal.core.gate import Gate


def client(port: int, calls: int) -> None:
    """Time each call on the store at ``127.0.0.1:port``; print the means (seconds) as JSON."""
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
    means = {name: per_call(run, calls) for name, run in store_calls(store).items()}
    for i in range(calls):
        store.delete_key(f"k{i}")
        store.delete_key(f"vote{i}")
    print(json.dumps(means))


def _served() -> dict[str, dist.TCPStore]:
    """The two stores: one on a plain loopback listener, one behind a gate."""
    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    plain.listen(socket.SOMAXCONN)
    gate = Gate()
    stores = {}
    for name, fd in (("direct", plain.detach()), ("gated", gate.listener_fd())):
        stores[name] = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30),
                                     wait_for_workers=False, master_listen_fd=fd)
    return stores


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--client", type=int, help=argparse.SUPPRESS)  # a client's run
    args = parser.parse_args()
    if args.client is not None:
        client(args.client, args.calls)
        return
    stores = _served()
    times: dict[str, dict[str, list[float]]] = {name: {} for name in stores}
    cpu: dict[str, list[float]] = {name: [] for name in stores}
    for _ in range(args.repeats):
        for name, store in stores.items():
            before = _cpu()
            out = subprocess.run([sys.executable, __file__, "--client", str(store.port),
                                  "--calls", str(args.calls)], check=True, capture_output=True,
                                 text=True).stdout
            means = json.loads(out)
            cpu[name].append((_cpu() - before) / (args.calls * len(means)))
            for call, mean in means.items():
                times[name].setdefault(call, []).append(mean)
    print(f"{'call':<22}{'direct us':>11}{'gated us':>10}{'added us':>10}")
    for call in times["direct"]:
        direct = statistics.median(times["direct"][call]) * 1e6
        gated = statistics.median(times["gated"][call]) * 1e6
        print(f"{call:<22}{direct:>11.1f}{gated:>10.1f}{gated - direct:>10.1f}")
    direct, gated = (statistics.median(cpu[name]) * 1e6 for name in ("direct", "gated"))
    print(f"{'server CPU':<22}{direct:>11.1f}{gated:>10.1f}{gated - direct:>10.1f}  (us per call)")


if __name__ == "__main__":
    main()
