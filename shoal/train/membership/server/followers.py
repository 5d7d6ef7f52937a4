"""``--elastic`` with several parameter servers (``--servers k``): server 0 decides, the
others follow.

Server 0's coordinator deals a lost worker's rest and admits joiners, as with one server
(:mod:`shoal.train.membership.server.dealer`); what the other servers must know of it, server 0 tells them
on its own pairs with them (a report each, :class:`Follower` applies it): a joiner to
serve (before the joiner is answered, so that every server waits for it), a worker that
rests or works again (a staleness bound or round robin must not wait for one that has
nothing to push), a joiner's first pull taken for the records.

A worker's push counts once *every* server applied it (its exchange returns only then):
at a loss, server 0 takes the least of the servers' counts of the lost worker
(:meth:`Leader.counted`), each published in the job's store by that server once it has
lost the worker too, when the count can no longer move. A push cut off part-way (applied
by some servers, not all) is dealt again: that batch reaches the shards that applied it
twice, none of them never.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from shoal.errors import JobError, ShoalError
from shoal.train.membership.messages import (
    BadReport,
    Leads,
    Rest,
    Serve,
    Taken,
    Word,
    WordKind,
    decode_word,
    encode,
)

#: Server 0's client id on the other servers: outside every worker's id, joiners' included.
COORDINATOR = 1 << 30
#: Seconds between two looks of a server at the workers it lost (to publish their counts).
POLL_S = 0.1


def lost_key(server: int, worker: int) -> str:
    """Where server ``server`` publishes its count of lost ``worker`` (the job's store)."""
    return f"elastic/lost/{server}/{worker}"


class Follower:
    """A server other than 0 of an ``--elastic`` job: applies to its shard what server 0
    tells it. ``on_report`` and ``run`` go to :func:`~shoal.ps.serve_shard` (as server 0's
    coordinator's do)."""

    def __init__(self, server: int, store: Any, timeout: float) -> None:
        self.server, self.store, self.timeout = server, store, timeout
        self.shard: Any = None
        self._ready = threading.Event()
        self._handlers: dict[WordKind, Callable[[Any], None]] = {
            WordKind.SERVE: self._serve, WordKind.LEAD: self._lead, WordKind.REST: self._rest,
            WordKind.TAKEN: self._taken}

    def run(self, shard: Any) -> None:
        """Serve until every client left or was lost, taking server 0's word meanwhile and
        publishing the count of each worker lost (in the job's store, for server 0)."""
        self.shard = shard
        self._ready.set()
        told: set[int] = set()
        while True:
            done = shard.wait(POLL_S)
            for worker, info in dict(shard.lost).items():
                if worker not in told:
                    self.store.set(lost_key(self.server, worker), str(int(info["counted"])))
                    told.add(worker)
            if done:
                return

    def on_report(self, client: int, obj: object) -> None:
        """What server 0 told this server (nobody else reports here).

        Raises:
            ShoalError: a report from another client, or not one of server 0's words.
        """
        if client != COORDINATOR:
            raise ShoalError(f"server {self.server} takes reports from server 0 only, not "
                             f"from client {client}")
        if not self._ready.wait(self.timeout):
            raise ShoalError(f"server {self.server} was not serving yet")
        try:
            word = decode_word(obj)
        except BadReport as exc:
            raise ShoalError(f"server {self.server}: {exc}") from None
        self._handlers[word.KIND](word)

    def _serve(self, word: Serve) -> None:
        self.shard.add_client(word.client, word.connect_timeout)

    def _lead(self, word: Leads) -> None:  # a compute group's member in its lost leader's place
        self.shard.lead(word.client)

    def _rest(self, word: Rest) -> None:
        self.shard.rest(word.client, word.resting)

    def _taken(self, word: Taken) -> None:  # one dict operation: atomic beside serving threads'
        self.shard.first_pulls.pop(word.client, None)


class Leader:
    """Server 0's side: its ``client`` of servers ``1 .. servers-1``, each of which loses a
    silent worker within ``silence`` seconds as server 0 does."""

    def __init__(self, client: Any, store: Any, servers: int, silence: float) -> None:
        self.client, self.store = client, store
        self.others, self.silence = range(1, servers), silence

    def tell(self, word: Word) -> None:
        """Tell every other server ``word`` (each has applied it on return)."""
        for s in self.others:
            self.client.report(encode(word), server=s)

    def counted(self, worker: int, mine: int) -> int:
        """The samples of lost ``worker``'s schedule that every server applied (``mine``:
        server 0's count), each server's as it published it once it lost the worker too."""
        wait = self.silence + 5.0
        deadline, counts = time.monotonic() + wait, [mine]
        for s in self.others:
            key = lost_key(s, worker)
            while not self.store.check([key]):  # polled: a store wait blocks this client
                if time.monotonic() > deadline:
                    raise JobError(f"server {s} did not lose worker {worker} within {wait:g} s "
                                   "of server 0; the job ends")
                time.sleep(POLL_S)
            counts.append(int(self.store.get(key)))
        return min(counts)

    def first_pull(self, joiner: int, mine: torch.Tensor | None) -> torch.Tensor | None:
        """The whole center ``joiner``'s first pull had: server 0's shard of it ``mine``
        and each other server's (which then forgets it)."""
        if mine is None:
            return None
        shards = [mine]
        for s in self.others:
            shard = self.client.fetch_state(s)["first_pulls"].get(joiner)
            if shard is None:
                raise JobError(f"server {s} did not serve joiner {joiner}'s first pull")
            shards.append(shard)
            self.client.report(encode(Taken(joiner)), server=s)
        return torch.cat(shards)
