"""A joiner's admission to a running elastic job (``shoal join``): the request, its proof and
its answer, in the job's store (under the elastic prefix, :mod:`shoal.core.membership`).

A joiner takes a *ticket* (``join/tickets``, counted by the store), which fixes its worker
id: the job's first size plus the tickets before it (fresh, never a lost worker's), and
writes its *proof*: an HMAC under the job's secret (:class:`~shoal.core.trust.Seal`; the
launcher publishes it to its user only) of the ticket. A process that does not know the
secret cannot be admitted; a proof read from the store is good for its own ticket only,
which is answered once. It then counts itself in ``join/asked``.

The members see the request in a meeting's decision (its decider looks at ``join/asked``:
one store call a meeting) and, at their next meeting point where all their work counted,
:func:`admit`: worker 0 checks every request's proof and the bound on the workers, answers
each (``join/<ticket>/answer``) and writes the round's record; every member reads it and
forms the next membership epoch's group with the joiners (:meth:`Membership.grow`). A
request at the job's most workers (``--max-workers``) while shoal's launcher says a
member's process ended is not refused but answered at the next meeting point, after the
members saw the loss: a replacement started right after a kill takes its place.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

from shoal.core.membership import Membership
from shoal.errors import ShoalError

PROOF_WAIT = 5.0  # seconds worker 0 waits for the proof of a ticket counted as asked
BAD_PROOF = "its proof does not match this job's secret"
WAIT = "wait"  # a request at the job's most workers while a member's process has ended
_CONTEXT = b"shoal-join"


def worker_id(first_world: int, ticket: int) -> int:
    """The id of the joiner holding ``ticket`` (counted from 1)."""
    return first_world + ticket - 1


def ticket_of(first_world: int, worker: int) -> int:
    """The ticket joiner ``worker`` holds (:func:`worker_id`'s inverse)."""
    return worker - first_world + 1


def take_ticket(store: Any) -> int:
    """A new ticket (``store``: the job's store under the elastic prefix)."""
    return int(store.add("join/tickets", 1))


def ask(store: Any, seal: Any, ticket: int) -> None:
    """Ask to join with ``ticket``, proved under the job's ``seal``."""
    store.set(f"join/{ticket}/proof", seal.tag(_CONTEXT, str(ticket).encode()).hex())
    store.add("join/asked", 1)


def answer(store: Any, ticket: int, timeout: float) -> dict[str, Any]:
    """The members' answer to ``ticket`` (``{"epoch", "members"}``, or ``{"refused"}``),
    waiting up to ``timeout`` seconds: a one-line error when none comes."""
    key = f"join/{ticket}/answer"
    try:
        store.wait([key], timedelta(seconds=timeout))
    except RuntimeError as exc:
        if "timeout" not in str(exc).lower():
            raise ShoalError(f"the job ended before it admitted this worker ({exc})") from None
        raise ShoalError(f"the job did not admit this worker within {timeout:g} s (it meets "
                         "again only after its next step or round)") from None
    return json.loads(store.get(key))


def admit(m: Membership, cap: int, timeout: float) -> list[int]:
    """Answer the join requests at a meeting point every member reached (they all saw
    :attr:`Membership.join_asked`): worker 0 decides, all form the new group with those
    admitted. Returns the ids that joined (none: the group is unchanged)."""
    m.join_asked = False
    round_key = f"join/round/{m.join_rounds}"
    if m.rank == 0:
        _decide(m, cap, round_key)
    m.keys.wait([round_key], timedelta(seconds=timeout))
    record = json.loads(m.keys.get(round_key))
    m.joins_handled, m.join_rounds = record["handled"], m.join_rounds + 1
    if not record["joined"]:
        return []
    return m.grow(m.epoch + 1, record["members"], record["joined"])


def _decide(m: Membership, cap: int, round_key: str) -> None:
    """Worker 0: check and answer every request asked so far (up to the first that waits
    for a lost member's place); write the round's record."""
    store, handled = m.keys, int(m.keys.add("join/asked", 0))
    epoch, members, joined = m.epoch + 1, list(m.members), []
    refused: dict[int, str | None] = {}
    for ticket in range(m.joins_handled + 1, handled + 1):
        why = _refusal(m, store, ticket, len(members), cap)
        if why == WAIT:  # it and the later ones are asked again at the next meeting point
            handled = ticket - 1
            break
        refused[ticket] = why
        if why is None:
            joined.append(worker_id(m.first_world, ticket))
            members.append(joined[-1])
    if joined:
        store.compare_set(f"{epoch}/members", "", ",".join(map(str, members)))
    for ticket, why in refused.items():
        reply = {"refused": why} if why else {"epoch": epoch, "members": members, "joined": joined,
                                              "handled": handled, "rounds": m.join_rounds + 1}
        store.set(f"join/{ticket}/answer", json.dumps(reply))
    store.set(round_key, json.dumps({"handled": handled, "joined": joined, "members": members}))


def proved(store: Any, seal: Any, ticket: int) -> bool:
    """Whether ``ticket``'s proof (waited for up to :data:`PROOF_WAIT` s) is good under the
    job's ``seal`` (``None``: the secret is not known here, nothing is proved)."""
    key = f"join/{ticket}/proof"
    deadline = time.monotonic() + PROOF_WAIT
    while not store.check([key]) and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        return bool(store.check([key]) and seal is not None and seal.check(
            bytes.fromhex(store.get(key).decode()), _CONTEXT, str(ticket).encode()))
    except ValueError:
        return False


def _refusal(m: Membership, store: Any, ticket: int, workers: int, cap: int) -> str | None:
    """Why ``ticket``'s request is refused, or ``None`` to admit it."""
    if not proved(store, m.seal, ticket):
        return BAD_PROOF
    if workers >= cap:
        if m.lost_unseen():
            return WAIT  # the members have not met since: its place is coming
        return (f"the job has {workers} workers, its most (--max-workers {cap}); "
                "a worker may join once one is lost")
    return None
