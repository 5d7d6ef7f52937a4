"""Parameter-server transport: push+pull round trips per second of a flat float32 vector
through ``shoal.ps`` against a bare Gloo ``send``/``recv`` round trip of the same size
(the limit), in the same run. Prints a markdown table; ``--out`` writes JSON. Run:

    .venv/bin/python benchmarks/bench_ps.py --sizes-mb 1 10
    .venv/bin/python benchmarks/bench_ps.py --servers 2 --clients 2

*Through the server*: each client process calls ``ServerClient.exchange`` (its header and
the whole vector out, split over ``--servers`` server processes; the reply back into the
same slices), one at a time, booked on its Comm as a worker's are; each server applies a
locked rule that does the least a rule can (``reply = payload``, one copy) and reads the
header fields async-msgd's rule reads (so the header is the size a training run sends).

*Bare*: the same client process sends the vector with ``ProcessGroupGloo.send`` to an echo
process of its own, which sends it back (no header, no thread, no copy): what Gloo over
loopback allows for one round trip of that size.

The two alternate in blocks (every client in step, through a barrier), so a change in the
machine's load touches both; the rates are from the median round trip over all blocks.
Every process uses one torch thread. With several clients, each one's rate is reported
and the table gives their sum; the bare rows then run that many pairs at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from shoal.core.comm import Comm
from shoal.core.env import Environment
from shoal.core.header import Header
from shoal.core.ops import split_ranges
from shoal.core.processes import loopback_gloo_interface, loopback_store
from shoal.ps import ServerClient, ShardServer

TIMEOUT = 120.0


class EchoRule:
    """The least a rule can do: send the payload back (one copy), under the shard's lock."""

    locked = True
    fields = ("lr", "momentum", "weight_decay")

    def apply(self, header: Header, payload: torch.Tensor, reply: torch.Tensor) -> None:
        reply.copy_(payload)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def floats(mb: float) -> int:
    return int(mb * 1e6) // 4


def _store(port: int) -> dist.Store:
    return dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=TIMEOUT))


def _pin(index: int, ready) -> None:
    """With ``--pin``: run on core ``index`` (modulo the cores there are)."""
    cores = sorted(os.sched_getaffinity(0))
    if ready["pin"] and len(cores) > 1:
        os.sched_setaffinity(0, {cores[index % len(cores)]})


def server_main(port: int, server: int, clients: int, sizes: list[float], ready) -> None:
    """One server process: a ShardServer per size (own store prefix), until all clients left."""
    torch.set_num_threads(1)
    _pin(1 + server, ready)
    store = _store(port)
    servers = []
    for i, mb in enumerate(sizes):
        size = split_ranges(floats(mb), ready["servers"])[server]
        center = torch.zeros(size[1] - size[0])
        for path in PATHS:  # the same shard served over Gloo and over shared memory
            ps = ShardServer(dist.PrefixStore(f"size{i}/{path}", store), server, clients,
                             EchoRule(), center.clone(), timeout=TIMEOUT, intra_host=path)
            ps.start()
            servers.append(ps)
    for ps in servers:
        ps.wait(TIMEOUT * 4)
    for ps in servers:
        ps.close()


#: The bare round trips, each timed in every block; the limit is the fastest.
BARE = ("posted", "after", "framed")
#: The pairs' paths timed through the servers (``--intra-host``): Gloo's, shared memory's.
PATHS = ("gloo", "shm")


def echo_main(port: int, client: int, sizes: list[float], blocks: int, reps: int, ready) -> None:
    """The bare pair's far end: receive, send back, as often and in the way (:data:`BARE`)
    the client times it."""
    torch.set_num_threads(1)
    _pin(1 + client, ready)
    store = _store(port)
    head = HEADER.pack(EchoRule.fields)
    for i, mb in enumerate(sizes):
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"bare/{i}/{client}", store), 0, 2,
                                   timedelta(seconds=TIMEOUT))
        buf = torch.empty(floats(mb))
        for _ in range(blocks):
            for variant in BARE:
                message = [head, buf] if variant == "framed" else [buf]
                for _ in range(reps + 2):
                    for t in message:
                        pg.recv([t], 1, 0).wait()
                    for w in [pg.send([t], 1, 0) for t in message]:
                        w.wait()
        del pg


def _timed(trip, reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls of ``trip(k)``, after two that warm up."""
    times = []
    for k in range(reps + 2):
        start = time.perf_counter()
        trip(k)
        if k >= 2:
            times.append(time.perf_counter() - start)
    return times


#: A training run's exchange header (async-msgd's rule fields).
HEADER = Header(0, 0, fields={"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4})


def _time_size(pg, ps: dict[str, ServerClient], n: int, client: int, blocks: int, reps: int,
               barrier) -> dict:
    payload, reply = torch.randn(n), torch.zeros(n)
    head = HEADER.pack(EchoRule.fields)
    back = torch.empty_like(head)

    def posted(k: int) -> None:  # the receive posted at once
        works = [pg.send([payload], 0, 0), pg.recv([reply], 0, 0)]
        for w in works:
            w.wait()

    def after(k: int) -> None:  # the receive posted once the send is done
        pg.send([payload], 0, 0).wait()
        pg.recv([reply], 0, 0).wait()

    def framed(k: int) -> None:  # exchange()'s messages: a header before each vector
        works = [pg.send([head], 0, 0), pg.send([payload], 0, 0), pg.recv([back], 0, 0),
                 pg.recv([reply], 0, 0)]
        for w in works:
            w.wait()

    def through(path: str):
        def trip(k: int) -> None:
            ps[path].exchange(payload, reply, dataclasses.replace(HEADER, client=client, clock=k))
        return trip

    trips = {"posted": posted, "after": after, "framed": framed, "ps": through("gloo"),
             "shm": through("shm")}
    times: dict[str, list[float]] = {name: [] for name in trips}
    for _ in range(blocks):
        for name, trip in trips.items():
            barrier.wait(TIMEOUT)
            times[name] += _timed(trip, reps)
    assert torch.equal(reply, payload), "the servers' reply is not the payload"
    out = {f"{name}_s": statistics.median(t) for name, t in times.items()}
    out["bare_s"] = min(out[f"{name}_s"] for name in BARE)
    return out


def client_main(port: int, client: int, sizes: list[float], blocks: int, reps: int,
                ready) -> None:
    """Time ``reps`` round trips, bare and through the servers, in ``blocks`` alternations."""
    torch.set_num_threads(1)
    _pin(client, ready)
    store = _store(port)
    results = []
    for i, mb in enumerate(sizes):
        n = floats(mb)
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"bare/{i}/{client}", store), 1, 2,
                                   timedelta(seconds=TIMEOUT))
        comm = Comm(Environment(client, ready["clients"]), torch.device("cpu"), peers=False)
        ps = {path: ServerClient(dist.PrefixStore(f"size{i}/{path}", store), client,
                                 split_ranges(n, ready["servers"]), timeout=TIMEOUT, comm=comm,
                                 intra_host=path) for path in PATHS}
        assert all(ps["shm"].shared), "the shm pairs took Gloo"
        results.append({"mb": mb, **_time_size(pg, ps, n, client, blocks, reps,
                                               ready["barrier"])})
        for one in ps.values():
            one.close()
        del pg
    ready["results"].put((client, results))


def run(sizes: list[float], servers: int, clients: int, blocks: int, reps: int,
        pin: bool = True) -> list[dict]:
    interface = loopback_gloo_interface()
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface  # the children inherit it
    ctx = mp.get_context("spawn")
    store = loopback_store(TIMEOUT)
    shared = {"servers": servers, "clients": clients, "pin": pin, "barrier": ctx.Barrier(clients),
              "results": ctx.Queue()}
    procs = []

    def start(target, *args) -> None:
        procs.append(ctx.Process(target=target, args=(store.port, *args, shared)))
        procs[-1].start()

    try:
        for s in range(servers):
            start(server_main, s, clients, sizes)
        for c in range(clients):
            start(echo_main, c, sizes, blocks, reps)
            start(client_main, c, sizes, blocks, reps)
        per_client = dict(shared["results"].get(timeout=TIMEOUT * 4) for _ in range(clients))
        for p in procs:
            p.join(TIMEOUT)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join(5)
    rows = []
    for i, mb in enumerate(sizes):
        mine = [per_client[c][i] for c in range(clients)]
        bare = sum(1.0 / r["bare_s"] for r in mine)
        through = sum(1.0 / r["ps_s"] for r in mine)
        shared = sum(1.0 / r["shm_s"] for r in mine)
        rows.append({"mb": mb, "servers": servers, "clients": clients, "bare_per_s": bare,
                     "ps_per_s": through, "ratio": through / bare, "shm_per_s": shared,
                     "shm_ratio": shared / through,
                     **{f"{key[:-2]}_ms": [1e3 * r[key] for r in mine]
                        for key in ("ps_s", "shm_s", *(f"{name}_s" for name in BARE))}})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 10.0],
                   help="vector sizes in MB (float32)")
    p.add_argument("--servers", type=int, default=1, help="server processes (shards)")
    p.add_argument("--clients", type=int, default=1, help="client processes, timed at once")
    p.add_argument("--blocks", type=int, default=5, help="alternations of bare and server")
    p.add_argument("--reps", type=int, default=40, help="round trips per block")
    p.add_argument("--no-pin", action="store_true",
                   help="do not pin the processes to cores (default: clients on the first "
                        "cores, servers and echoes on the next, modulo the cores)")
    p.add_argument("--out", help="write the rows as JSON here")
    a = p.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} on {len(os.sched_getaffinity(0))} "
          f"cores\n")
    rows = run(a.sizes_mb, a.servers, a.clients, a.blocks, a.reps, pin=not a.no_pin)
    print(f"### Push+pull round trips per second, {a.servers} server(s), {a.clients} "
          f"client(s) (median of {a.blocks}x{a.reps} per client)\n")
    print("| vector | bare Gloo send+recv (/s) | through the server, Gloo (/s) | ratio "
          "| through the server, shared memory (/s) | shm / Gloo "
          "| server ms (Gloo / shm) | bare ms: recv posted first | recv after send "
          "| with headers |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")

    def ms(values: list[float]) -> str:
        return " / ".join(f"{v:.2f}" for v in values)

    for r in rows:
        print(f"| {r['mb']:g} MB | {r['bare_per_s']:.1f} | {r['ps_per_s']:.1f} | "
              f"{r['ratio']:.2f} | {r['shm_per_s']:.1f} | **{r['shm_ratio']:.2f}x** | "
              f"{ms(r['ps_ms'])} / {ms(r['shm_ms'])} | {ms(r['posted_ms'])} | "
              f"{ms(r['after_ms'])} | {ms(r['framed_ms'])} |")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"servers": a.servers, "clients": a.clients, "blocks": a.blocks,
                       "reps": a.reps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
