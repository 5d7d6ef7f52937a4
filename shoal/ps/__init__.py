"""The parameter server: shards of the center served to the workers of an asynchronous job.

It stands on the core's transport (:mod:`shoal.core.pairs`: pairs and their failures;
:mod:`shoal.core.header`: messages and tags) and knows no strategy: a strategy hands it
an update rule (its ``Rule``, which declares the header fields it reads) and an
:class:`~shoal.ps.admission.Admission` (built from its options). Three parts:

- :mod:`~shoal.ps.server`: :class:`ShardServer`, one shard served to every client on a
  thread of its own, each request answered by the dispatch table's entry for its kind;
- :mod:`~shoal.ps.admission`: when an exchange is applied (arrival, round-robin, bounded
  staleness) and each shard's versions and staleness;
- :mod:`~shoal.ps.client`: :class:`ServerClient`, a worker's end, whose exchanges are
  booked on the worker's :class:`~shoal.core.comm.Comm`.

The launch path calls the two entry points below: :func:`connect_worker` in each worker,
:func:`serve_shard` in each server process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from shoal.core.comm import Comm
from shoal.ps.admission import ORDERS, Admission, staleness_summary
from shoal.ps.client import ServerClient, keepalive
from shoal.ps.rule import ServerRule
from shoal.ps.server import ShardServer

__all__ = ["ORDERS", "Admission", "ServerClient", "ServerRule", "ShardServer", "connect_worker",
           "keepalive", "serve_shard", "staleness_summary"]

T = TypeVar("T")


def connect_worker(store: dist.Store, worker: int, ranges: list[tuple[int, int]],
                   timeout: float, comm: Comm, silence: float | None = None,
                   intra_host: str = "auto") -> ServerClient:
    """Worker ``worker``'s client of the servers holding ``ranges`` (one each, in order):
    connected to all of them, pinging them while idle (often enough for servers that take
    ``silence`` seconds, default ``timeout``, without a word for a loss), its exchanges
    booked on ``comm``, whose :attr:`~shoal.core.comm.Comm.ps` it becomes; ``intra_host``:
    ``--intra-host`` (a server of this host through shared memory unless ``gloo``)."""
    client = ServerClient(store, worker, ranges, timeout=timeout, comm=comm,
                          keepalive=keepalive(silence or timeout), intra_host=intra_host)
    comm.ps = client
    return client


def serve_shard(store: dist.Store, server: int, clients: int, rule: ServerRule | None,
                center: torch.Tensor, admission: Admission, *, timeout: float,
                state: dict | None = None, on_report: Callable[[int, Any], None] | None = None,
                during: Callable[[ShardServer], T] | None = None,
                connect_timeout: float | None = None, readers: tuple[int, ...] = (),
                intra_host: str = "auto") -> T | None:
    """Serve ``center`` (updated in place by ``rule``) as server ``server`` to ``clients``
    clients, from a checkpoint's ``state`` if given, until every client has left or was
    lost (silent for ``timeout`` seconds; ``connect_timeout``, default ``timeout``, to
    connect; ``readers``: ids that only read, see :class:`ShardServer`); with ``during``, its
    value, run on the serving shard meanwhile (server 0's coordinator). Stops serving
    whatever happens."""
    shard = ShardServer(store, server, clients, rule, center, timeout=timeout,
                        admission=admission, on_report=on_report,
                        connect_timeout=connect_timeout, readers=readers, intra_host=intra_host)
    if state is not None:
        shard.load_state(state)
    try:
        shard.start()
        if during is not None:
            return during(shard)
        shard.wait(None)
        return None
    finally:
        shard.close()
