"""What a parameter-server pair's messages carry: a :class:`Header` first (its
:class:`Kind`, the client, versions, the worker's progress, and the values the server's
rule reads), then at most one payload: a vector, or a pickled object (:func:`to_bytes`).

Headers, vectors and pickled bytes travel on three tags (:data:`TAG_HEAD`,
:data:`TAG_DATA`, :data:`TAG_BYTES`), each tag's messages matched in order, so a server can
post the receive of a worker's next vector before its header arrives: Gloo moves a message
only once its receive is posted. The transport is :mod:`shoal.core.pairs`.

**Header fields.** A header carries the transport's fields and, opaque here, the named
values its server's update rule reads (a learning rate, a moving rate): the rule declares
their names, the server's end of each pair sets them in the pair's store prefix before it
connects, and the client's end reads them once connected, so both pack the same header.
"""

from __future__ import annotations

import enum
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shoal.errors import ShoalError


class Kind(enum.IntEnum):
    """Message kinds (a request's :attr:`Header.kind`; a reply echoes it, or is ERROR)."""

    EXCHANGE = 0  #: a payload out, the rule's reply back
    PULL = 1  #: the shard back
    REPORT = 2  #: a pickled object for server 0's coordinator
    STATE = 3  #: the shard's state back, pickled
    BYE = 4  #: a clean leave
    PING = 5  #: keep-alive from an idle client (no reply)
    ERROR = 6  #: a reply that carries an error message


#: Gloo tags of a pair's messages: each tag's messages are matched in order, so a server
#: can post the receive of a worker's next vector (``TAG_DATA``) before its header arrives.
TAG_HEAD, TAG_DATA, TAG_BYTES = 0, 1, 2

#: The transport's own header fields, in the order they travel.
BASE_FIELDS = ("kind", "client", "clock", "version", "step", "samples", "nbytes")
HEADER_SIZE = len(BASE_FIELDS)  #: values in a header whose rule reads no field
#: The most rule fields a header carries (each is one float64 of every message).
MAX_RULE_FIELDS = 32


@dataclass
class Header:
    """The fixed-size part of every message, sent as one float64 tensor (exact for integers
    below 2**53) before the payload."""

    kind: int
    client: int
    clock: int = 0  #: this client's number of exchanges so far (set by the caller)
    #: in a request: the server version the client last pulled (set by the client per
    #: server); in a reply: the server's version now
    version: int = 0
    step: int = 0  #: the worker's optimizer step count
    samples: int = 0  #: samples this worker has trained on so far
    nbytes: int = 0  #: length of a pickled object that follows (REPORT, STATE, ERROR)
    #: the values the server's rule reads, by name (missing ones travel as 0)
    fields: dict[str, float] = field(default_factory=dict)

    def pack(self, names: Sequence[str] = (), **base: int) -> torch.Tensor:
        """This header as a float64 tensor: the transport's fields (those in ``base`` as
        given there), then ``names``' values."""
        values = [float(base[name] if name in base else getattr(self, name))
                  for name in BASE_FIELDS]
        values += [float(self.fields.get(name, 0.0)) for name in names]
        return torch.from_numpy(np.array(values, dtype=np.float64))  # a tenth of torch.tensor's

    @classmethod
    def unpack(cls, t: torch.Tensor, names: Sequence[str] = ()) -> Header:
        """The header packed in ``t`` (as :meth:`pack` made it with ``names``)."""
        values = t.tolist()
        base = [int(v) for v in values[:HEADER_SIZE]]
        return cls(*base, fields=dict(zip(names, values[HEADER_SIZE:], strict=True)))


def check_field_names(names: Sequence[str], whose: str) -> tuple[str, ...]:
    """``names`` as a tuple, if they can name a header's rule fields (identifiers, unique,
    none of the transport's own, at most :data:`MAX_RULE_FIELDS`); else one line."""
    names = tuple(names)
    bad = [n for n in names if not (isinstance(n, str) and n.isidentifier()) or n in BASE_FIELDS]
    if bad or len(set(names)) != len(names) or len(names) > MAX_RULE_FIELDS:
        raise ShoalError(f"{whose}: header fields {list(names)!r} must be at most "
                         f"{MAX_RULE_FIELDS} distinct names, none of {', '.join(BASE_FIELDS)}")
    return names


def to_bytes(obj: Any) -> torch.Tensor:
    """``obj`` pickled, as a uint8 tensor (one message)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def from_bytes(buf: torch.Tensor) -> Any:
    """The object :func:`to_bytes` made ``buf`` of."""
    return pickle.loads(buf.numpy().tobytes())
