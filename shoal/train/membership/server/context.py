"""What server 0's side of an asynchronous ``--elastic`` job
(:class:`~shoal.train.membership.server.members.AsyncMembers`) reads and updates of the
coordinator's records: :class:`ServerContext`, a :class:`~typing.Protocol` that the
:class:`~shoal.train.coordinator.Coordinator` (above membership) meets without being
imported."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.data import Dataset
from shoal.ps import ShardServer
from shoal.train.membership.context import ChangeRecords
from shoal.train.membership.messages import Final
from shoal.train.membership.server.followers import Leader
from shoal.train.state import RunState


class ServerContext(Protocol):
    """What server 0's ``--elastic`` side reads and updates of the coordinator's records."""

    @property
    def cfg(self) -> TrainConfig: ...

    @property
    def comm(self) -> Comm: ...

    @property
    def data(self) -> Dataset: ...

    @property
    def workers(self) -> int:
        """The workers the job started with."""

    @property
    def servers(self) -> int: ...

    @property
    def state(self) -> RunState: ...

    @property
    def recorder(self) -> ChangeRecords: ...

    @property
    def shard(self) -> ShardServer | None:
        """Server 0's shard, once it serves."""

    @property
    def followers(self) -> Leader | None:
        """The other servers' leader (several servers under ``--elastic``)."""

    @property
    def counted_of(self) -> Callable[[int, dict[str, Any]], list[int]] | None:
        """A lost worker's ``[counted, step]`` where server 0's own count is not it."""

    @property
    def ended(self) -> Callable[[int], str | None] | None:
        """How the process of a rank ended, as its launcher says."""

    @property
    def live(self) -> set[int]:
        """The workers alive (joiners added)."""

    @property
    def finals(self) -> dict[int, Final]:
        """The workers that sent their last report."""

    @property
    def own(self) -> dict[int, Any]:
        """Each worker's own state in the checkpoint."""

    @property
    def lost(self) -> dict[int, dict[str, Any]]:
        """What the records keep of each lost worker."""


__all__ = ["ServerContext"]
