"""shoal.core.sockets: the connections a body opens, less the store's, and cutting exactly
those (what leaving an elastic group relies on; the group itself: tests/test_elastic.py)."""

from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from shoal.core.sockets import cut, opened, store_port

pytestmark = pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(),
                                reason="Linux only (/proc)")


def _pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname(), timeout=5)
    server, _ = listener.accept()
    server.settimeout(5)
    return client, server


def test_only_the_connections_opened_in_the_body_are_cut_and_not_the_stores():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        before = _pair(listener)
        with opened(store) as found:
            mine = _pair(listener)
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                                   timeout=timedelta(seconds=10))
        assert store_port(dist.PrefixStore("a", dist.PrefixStore("b", client))) == store.port
        assert len(found) == 2  # both ends of the one connection; not the store's, not the listener
        assert cut(found) == 2
        assert mine[1].recv(1) == b"" and mine[0].recv(1) == b""  # shut down both ways
        before[0].sendall(b"x")
        assert before[1].recv(1) == b"x"  # opened before: untouched
        client.set("k", "v")  # the store's connection: untouched
        assert client.get("k") == b"v"
        for s in (*before, *mine):
            s.close()
        assert cut(found) == 0  # closed since: nothing left to cut


def test_a_closed_and_reused_descriptor_is_not_cut():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with opened(None) as found:
            first = _pair(listener)
        numbers = {s.fileno() for s in first}
        for s in first:
            s.close()
        other = _pair(listener)  # the lowest free descriptors: the same numbers, new sockets
        assert {s.fileno() for s in other} == numbers
        assert cut(found) == 0
        other[0].sendall(b"y")
        assert other[1].recv(1) == b"y"
        for s in other:
            s.close()
