"""What a strategy's workers exchange, how often and with whom: a :class:`Pattern`.

Each strategy class states its pattern (``Strategy.communication(options, workers)``) next
to the code that does the exchanging; :mod:`shoal.strategies.cost` turns a pattern, a model's size,
a step's compute and a network into time. The planner's trial estimates, the search's
expected costs and ``shoal plan --simulate`` all read the same patterns, so a strategy's
cost is described once, by the strategy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Exchange(enum.Enum):
    """The shape of one exchange."""

    #: A ring all-reduce of the vector over every worker.
    ALL_REDUCE = "all-reduce"
    #: A push of the vector to the parameter servers and a pull of their reply: the vector
    #: split in ``servers`` contiguous shards, each server serving every pusher.
    SERVER = "server"
    #: Compute groups: a ring all-reduce inside the group, the group leader's push and pull
    #: (the leaders are the servers' pushers), then a broadcast of the reply inside the group.
    GROUP_SERVER = "group-server"


@dataclass(frozen=True)
class Pattern:
    """A strategy's communication, for the cost model.

    ``what``: the vector exchanged, in words (gradients, parameters, ...); ``size``: its bytes
    relative to the model's float32 parameters (0.5 for a half-precision hook);
    ``every``: local steps per exchange; ``hidden``: the exchange travels behind the next
    ``every - 1`` steps' compute (EASGD's overlap) instead of being waited for at once;
    ``servers``: parameter-server processes (0: none); ``pushers``: the workers that send
    to the servers (every worker, or one leader per compute group); ``groups``: compute
    groups (the workers of a group all-reduce among themselves); ``fragments``: the vector
    goes in this many slices at staggered steps of a round (Streaming DiLoCo), each waited
    for ``overlap`` steps after it started.
    """

    exchange: Exchange
    what: str
    every: int = 1
    size: float = 1.0
    hidden: bool = False
    servers: int = 0
    pushers: int = 0
    groups: int = 1
    fragments: int = 1
    overlap: int = 0

    def __post_init__(self) -> None:
        if self.every < 1 or self.size <= 0 or self.groups < 1 or self.fragments < 1 \
                or self.overlap < 0:
            raise ValueError(f"a pattern needs every >= 1, size > 0, groups >= 1, "
                             f"fragments >= 1, overlap >= 0: {self}")
        if self.exchange is not Exchange.ALL_REDUCE and (self.servers < 1 or self.pushers < 1):
            raise ValueError(f"a pattern through servers needs servers and pushers: {self}")
