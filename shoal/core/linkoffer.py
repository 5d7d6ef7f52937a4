"""A parameter-server pair's shared-memory link, offered and taken through the pair's
store (its keys sealed with the job's secret): the server offers a fresh owner-only
segment, the client takes it where both ends share a host, its process ids and its user
(or declines it), and the segment is unlinked once both mapped it. The link itself is
:mod:`shoal.core.mailbox`'s; without one, the pair goes through Gloo
(:mod:`shoal.core.pairs`).
"""

from __future__ import annotations

import contextlib
import json
import os
from datetime import timedelta

import torch.distributed as dist

from shoal.core.mailbox import ALIGN_RING, MIN_RING_BYTES, RING_BYTES, SharedLink, segment_bytes
from shoal.core.segment import (
    create_segment,
    host_key,
    open_segment,
    pid_space,
    segment_name,
    sweep_stale,
    unavailable_here,
    unlink_segment,
)

_OFFER = "shm"


def _here() -> dict[str, str]:
    """What both ends must share to share memory: the host (its boot, network and IPC
    namespaces: :func:`~shoal.core.segment.host_key`), the process ids' namespace, the user."""
    return {"host": host_key(), "pids": pid_space(), "uid": str(os.getuid())}


def ring_for(message: int) -> int:
    """The ring that passes a message of ``message`` bytes whole, twice over (a request
    written while the last reply is read), within :data:`MIN_RING_BYTES` and
    :data:`RING_BYTES`: a pair of a small model takes little of ``/dev/shm``."""
    ring = MIN_RING_BYTES
    while ring < 2 * message + 4096 and ring < RING_BYTES:
        ring *= 2
    return ring


def offer_link(store: dist.Store, mode: str, peer: str, timeout: float,
               message: int = RING_BYTES) -> SharedLink | None:
    """The server's end: a fresh owner-only segment (rings of :func:`ring_for` ``message``
    bytes, the pair's largest message) offered in ``store`` (unless ``mode`` is ``gloo``,
    this host has no fast path or no room in ``/dev/shm``), taken or declined by the client
    within ``timeout`` seconds, then unlinked. ``None``: the pair goes through Gloo.

    Raises:
        RuntimeError: The client said nothing within ``timeout`` (the store's wait).
    """
    segment = None
    if mode != "gloo" and unavailable_here("cpu") is None:
        sweep_stale()  # what a server killed inside this window left
        name, ring = segment_name("ps"), ring_for(message)
        with contextlib.suppress(OSError):  # no room: Gloo
            segment = create_segment(name, segment_bytes(ring))
    if segment is None:
        store.set(_OFFER, "")
        return None
    try:
        store.set(_OFFER, json.dumps({"name": name, "ring": ring, "pid": os.getpid(),
                                      **_here()}))
        store.wait([f"{_OFFER}/{name}"], timedelta(seconds=timeout))
        answer = store.get(f"{_OFFER}/{name}").decode()
    finally:
        unlink_segment(name)  # mapped by both ends by now, or by none
    if not answer:
        return None
    try:
        return SharedLink(segment, True, int(json.loads(answer)["pid"]), peer, ring)
    except OSError:  # its process ended as it answered
        raise RuntimeError(f"{peer} ended as it connected") from None


def take_link(store: dist.Store, mode: str, peer: str, timeout: float) -> SharedLink | None:
    """The client's end: the server's offer (waited for up to ``timeout`` seconds), taken
    where both ends share this host, its process ids and its user (and ``mode`` is not
    ``gloo``), declined otherwise; the answer goes back through ``store``. ``None``: the
    pair goes through Gloo.

    Raises:
        RuntimeError: The server made no offer within ``timeout``.
    """
    store.wait([_OFFER], timedelta(seconds=timeout))
    text = store.get(_OFFER).decode()
    if not text:
        return None
    offer = json.loads(text)
    link = None
    if mode != "gloo" and unavailable_here("cpu") is None and \
            all(offer.get(k) == v for k, v in _here().items()):
        ring = int(offer["ring"])
        with contextlib.suppress(OSError, ValueError):
            if MIN_RING_BYTES <= ring <= RING_BYTES and ring % ALIGN_RING == 0:
                link = SharedLink(open_segment(offer["name"], segment_bytes(ring)), False,
                                  int(offer["pid"]), peer, ring)
    answer = json.dumps({"pid": os.getpid()}) if link is not None else ""
    store.set(f"{_OFFER}/{offer['name']}", answer)
    return link
