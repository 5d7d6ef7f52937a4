"""Test doubles and helpers of the parameter-server tests.

- :class:`LoopbackClient`: a client without servers, which applies each shard's rule in
  this process in the order its exchanges are made, so a test decides the order in which
  workers meet the server (the paper references of test_async_reference.py);
- :class:`AddRule`: a server rule that adds what it is sent and remembers who sent it;
- :class:`Children`, :func:`pushing_client`, :func:`serve`: clients in processes of their
  own against servers in the test's process.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing as mp
import os
import pickle
import secrets
import signal
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shoal.core.comm import Comm
from shoal.core.header import Header, Kind
from shoal.core.ops import split_sizes
from shoal.core.processes import loopback_store, start_process
from shoal.core.sealed import SealedStore, kept
from shoal.core.secret import SECRET_VAR, given_secret
from shoal.ps import ServerClient, ShardServer
from shoal.ps.rule import ServerRule, tell


class LoopbackClient:
    """A :class:`~shoal.core.pairs.Client` in one process: each exchange applies
    ``rules[i]`` to shard ``i`` directly (``centers[i]``, which the rule was built on),
    under a lock per shard for locked rules, with the header a server would unpack (the
    rule's declared fields only). Exchanges and pulls are booked on ``comm``, as
    :class:`~shoal.ps.client.ServerClient` books them; reports are kept in :attr:`reports`.
    """

    timeout = 60.0

    def __init__(self, rules: list[ServerRule], centers: list[torch.Tensor],
                 ranges: list[tuple[int, int]] | None = None, *, client: int = 0,
                 comm: Comm | None = None) -> None:
        if ranges is None:
            ranges, start = [], 0
            for c in centers:
                ranges.append((start, start + c.numel()))
                start += c.numel()
        self.rules, self.centers, self.ranges = rules, centers, [tuple(r) for r in ranges]
        self.client, self.comm = client, comm
        self.versions = [0] * len(centers)
        self.reports: list[Any] = []
        self._locks = [threading.Lock() for _ in centers]

    def _booked(self, name: str, nbytes: int) -> contextlib.AbstractContextManager:
        return self.comm.point_to_point(name, nbytes) if self.comm is not None \
            else contextlib.nullcontext()

    def exchange(self, payload: torch.Tensor, reply: torch.Tensor, header: Header) -> None:
        """Apply every shard's rule to its slice of ``payload``; replies into ``reply``."""
        nbytes = sum(b - a for a, b in self.ranges) * payload.element_size()
        with self._booked("push+pull", nbytes):
            for i, (a, b) in enumerate(self.ranges):
                rule = self.rules[i]
                head = replace(header, kind=Kind.EXCHANGE, client=self.client, version=self.versions[i],
                               fields={name: header.fields[name] for name in rule.fields})
                lock = self._locks[i] if rule.locked else contextlib.nullcontext()
                with lock:
                    rule.apply(head, payload[a:b], reply[a:b])
                    self.versions[i] += 1

    def pull(self, reply: torch.Tensor, header: Header | None = None) -> None:
        """Copy every shard into its slice of ``reply``."""
        with self._booked("pull", 0):
            for i, (a, b) in enumerate(self.ranges):
                with self._locks[i]:
                    reply[a:b].copy_(self.centers[i])
                    tell(self.rules[i] if self.rules else None, "sent", self.client)

    def report(self, obj: Any, header: Header | None = None,
               timeout: float | None = None) -> None:
        self.reports.append(obj)

    def fetch_state(self, server: int) -> dict:
        """Shard ``server``'s state, as :meth:`~shoal.ps.server.ShardServer.state` has it."""
        with self._locks[server]:
            return {"center": self.centers[server].clone(), "version": self.versions[server],
                    "rule": copy.deepcopy(self.rules[server].state_dict())}

    def close(self) -> None:
        """Nothing to leave."""

    def abandon(self) -> None:
        """Nothing to leave."""


class AddRule:
    """center += payload; reply = the new center. Read, yield, write: without the shard's
    lock, concurrent exchanges would lose updates. Keeps the clients of its exchanges, in
    the order applied, the header fields each brought (it reads ``lr``), and the server's
    calls of its optional hooks (``told``: ``("sent", client)`` per pull, ``("forget",
    client)`` per client gone)."""

    fields = ("lr",)

    def __init__(self, center: torch.Tensor, locked: bool = True, delay: float = 0.0,
                 sleep_on: int = 0) -> None:
        self.center, self.locked, self.delay, self.sleep_on = center, locked, delay, sleep_on
        self.applied = 0
        self.clients: list[int] = []
        self.seen: list[dict] = []
        self.told: list[tuple[str, int]] = []

    def sent(self, client: int) -> None:
        self.told.append(("sent", client))

    def forget(self, client: int) -> None:
        self.told.append(("forget", client))

    def apply(self, header: Header, payload: torch.Tensor, reply: torch.Tensor) -> None:
        self.applied += 1
        self.clients.append(header.client)
        self.seen.append(header.fields)
        if self.sleep_on and self.applied == self.sleep_on:
            time.sleep(60)  # an exchange the client waits for while this server is killed
        value = self.center.clone()
        time.sleep(self.delay)
        self.center.copy_(value + payload)
        reply.copy_(self.center)

    def state_dict(self) -> dict:
        return {"applied": self.applied}

    def load_state_dict(self, state: dict) -> None:
        self.applied = state["applied"]


def served_store(monkeypatch) -> SealedStore:
    """A job's store served here, as shoal's launcher serves one: sealed with a fresh secret,
    which the child processes take from the environment (:func:`connect`), as ranks do."""
    secret = secrets.token_bytes(32)
    monkeypatch.setenv(SECRET_VAR, secret.hex())
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # the pairs stay on loopback; children inherit
    return loopback_store(30.0, secret)


def store_client(port: int) -> SealedStore:
    """A client, in a child process, of the store :func:`served_store` serves at ``port``."""
    inner = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30))
    return kept(SealedStore(inner, given_secret()))


def connect(port: int, client: int, ranges, timeout: float, keepalive=None,
            intra_host: str = "auto") -> ServerClient:
    torch.set_num_threads(1)
    return ServerClient(store_client(port), client, ranges, timeout=timeout, keepalive=keepalive,
                        connect_timeout=30.0, intra_host=intra_host)


def send_to_parent(conn, obj: Any) -> None:
    """Tensors by value (the pipe's own pickler would share their memory with a process
    that may be gone when they are read)."""
    conn.send_bytes(pickle.dumps(obj))


def pushing_client(port: int, client: int, ranges, pushes: int, pause: float, timeout: float,
                   die_after: int, how: str, intra_host: str, conn) -> None:
    """``pushes`` exchanges of small random integers, ``pause`` s apart; sends their sum.
    With ``die_after``: after that many, report the time and kill (or stop) itself.
    ``intra_host``: the pairs' path (``gloo``, or shared memory under ``auto``)."""
    ps = connect(port, client, ranges, timeout, intra_host=intra_host)
    assert ps.shared == [intra_host != "gloo"] * len(ranges), ps.shared
    n = ranges[-1][1]
    g = torch.Generator().manual_seed(100 + client)
    total = torch.zeros(n)
    reply = torch.zeros(n)
    for i in range(pushes):
        payload = torch.randint(-3, 4, (n,), generator=g).float()
        ps.exchange(payload, reply, Header(0, 0, clock=i + 1, step=i + 1, samples=10 * (i + 1),
                                           fields={"lr": 1.0}))
        total += payload
        if die_after and i + 1 == die_after:
            send_to_parent(conn, ("dying", time.time()))
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        time.sleep(pause)
    ps.close()
    send_to_parent(conn, ("done", total))


class Children:
    """Child processes with a pipe each; all killed on exit."""

    def __init__(self) -> None:
        self.mp = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.pipes: list[Any] = []

    def start(self, target, *args) -> int:
        parent, child = self.mp.Pipe()
        self.procs.append(start_process(target, (*args, child)))
        self.pipes.append(parent)
        return len(self.procs) - 1

    def recv(self, i: int, timeout: float = 30.0) -> Any:
        if not self.pipes[i].poll(timeout):
            code = self.procs[i].exitcode
            raise AssertionError(f"child {i} sent nothing within {timeout} s (exit code {code})")
        return pickle.loads(self.pipes[i].recv_bytes())

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.exitcode is None and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.join(10)


def serve(store, clients: int, n: int, servers: int = 1, **kw) -> tuple[list[ShardServer], list]:
    """``servers`` started ShardServers of AddRules over a vector of ``n`` zeros."""
    shards = [torch.zeros(size) for size in split_sizes(n, servers)]
    rules = [AddRule(c) for c in shards]
    out = [ShardServer(store, s, clients, rules[s], shards[s], **kw) for s in range(servers)]
    for server in out:
        server.start()
    return out, rules


def close_all(servers: list[ShardServer]) -> None:
    for server in servers:
        server.close(timeout=2.0)
