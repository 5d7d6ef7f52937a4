"""A serving thread's end of one client's pair (:class:`Session`): its buffers, the early
receive of a pusher's next payload, and the replies."""

from __future__ import annotations

import torch

from shoal.core.header import TAG_BYTES, TAG_DATA, TAG_HEAD, Header, Kind, to_bytes
from shoal.core.pairs import PairChannel, Pending


class Session:
    """A serving thread's end of one client's pair: its header buffer, the payload and
    reply vectors (a shard each), and the payload's receive, posted ahead of the header."""

    def __init__(self, channel: PairChannel, center: torch.Tensor | None) -> None:
        self.channel = channel
        self.head = channel.header_buffer()
        self.payload: torch.Tensor | None = None
        self.reply: torch.Tensor | None = None
        self._posted: Pending | None = None
        #: where the pair shares memory: the reply's header and vector, in place
        self._room: list[torch.Tensor] | None = None
        #: a pusher over Gloo: post its next payload's receive early (through shared memory
        #: a receive is made when it is finished)
        self.ahead = center is not None and not channel.shared
        if center is not None:
            self.allocate(center)

    def allocate(self, center: torch.Tensor) -> None:
        self.payload, self.reply = torch.empty_like(center), torch.empty_like(center)

    def _post(self) -> None:
        """Post the receive of the next payload (once): Gloo hands a message over only when
        its receive is posted, so posting it ahead saves a round of that handshake. It is
        matched by tag, so other requests in between leave it waiting."""
        if self._posted is None:
            assert self.payload is not None
            self._posted = self.channel.irecv([self.payload], tags=[TAG_DATA])

    def next_request(self) -> Header:
        """The client's next request header (a pusher's next payload receive posted first)."""
        if self.ahead:
            self._post()
        self.channel.recv([self.head], tags=[TAG_HEAD])
        return self.channel.unpack(self.head)

    def receive_payload(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The payload that follows an exchange's header, and the buffer of the reply. Where
        the pair shares memory both lie in its rings: the rule reads the worker's vector
        where it came and writes its reply where the worker reads it (no copy here)."""
        assert self.payload is not None and self.reply is not None
        ch = self.channel
        if ch.shared:
            payload = ch.take(TAG_DATA, self.payload)
            self._room = ch.reserve([TAG_HEAD, TAG_DATA], [self.head, self.reply])
            return payload, self.reply if self._room is None else self._room[1]
        self._post()
        assert self._posted is not None
        pending, self._posted = self._posted, None
        ch.finish(pending)
        return self.payload, self.reply

    def reply_with(self, kind: int, version: int, vector: torch.Tensor | None,
                   error: str | None) -> None:
        """Header (and the vector the client expects, even with an error: the client has
        posted its receive), then the error message."""
        ch = self.channel
        data = None if error is None else \
            to_bytes(error.strip().splitlines()[0] if error.strip() else error)
        head = ch.pack(Header(kind, ch.client, version=version) if data is None else
                       Header(Kind.ERROR, ch.client, version=version, nbytes=data.numel()))
        room, self._room = self._room, None
        if room is not None:  # the reply's room in the ring (the rule wrote it there)
            if vector is not room[1]:
                assert vector is not None
                room[1].copy_(vector)
            room[0].copy_(head)
            ch.commit()
            if data is not None:
                ch.send([data], tags=[TAG_BYTES])
            return
        out, tags = [head], [TAG_HEAD]
        if vector is not None:
            out.append(vector)
            tags.append(TAG_DATA)
        if data is not None:
            out.append(data)
            tags.append(TAG_BYTES)
        ch.send(out, tags=tags)
