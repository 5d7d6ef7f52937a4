"""A joiner's state, taken from a live peer: what a worker that joins a running elastic job
(``shoal join``) needs to go on as the others do, sent over the job's process group.

Right after the group is re-formed with the joiner (:mod:`shoal.core.admission`), worker 0
broadcasts its *live state* (:func:`live_state`): the model's parameters and buffers, the
optimizer's state, the strategy's (EASGD's center and pending pull, DiLoCo's global model
and outer optimizer, a round's progress), the schedule, the gradient scaler, where the run
is, and the rest of the epoch as dealt over the grown group. The joiner puts it in place
(:func:`install`) and sends back the digest of its own live state built the same way, so
that the membership change's record shows both (``state_sha256``, ``joiner_state_sha256``):
equal when the joiner took every part.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from shoal.train.membership.context import JoinSide, LiveContext

#: The run's position that the digest covers (its times are each worker's own).
POSITION = ("epoch", "epoch_step", "step", "samples", "lr")


def live_state(t: LiveContext, side: JoinSide) -> dict[str, Any]:
    """Trainer ``t``'s state as a joiner takes it (on CPU), with its membership ``side``'s."""
    progress = t.state.state_dict()["progress"]
    return {"model": t.model.state_dict(), "optimizer": t.optimizer.state_dict(),
            "strategy": t.strategy.handover_state(), "scheduler": t.scheduler.state_dict(),
            "precision": t.amp.state_dict(), "progress": progress,
            "order": t.plan.order, "elastic": side.handover_state()}


def digest(state: dict[str, Any]) -> str:
    """SHA-256 of a :func:`live_state`: every tensor's dtype, shape and bytes, every number
    and name, in a fixed order (the position only by :data:`POSITION`)."""
    h = hashlib.sha256()
    tree = {**state, "progress": {k: state["progress"].get(k) for k in POSITION}}
    tree.pop("elastic", None)
    _feed(h, tree)
    return h.hexdigest()


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, dict):
        h.update(b"{")
        for key in sorted(value, key=repr):
            h.update(repr(key).encode())
            _feed(h, value[key])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for item in value:
            _feed(h, item)
        h.update(b"]")
    elif value is None or isinstance(value, (bool, int, float, str)):
        h.update(repr(value).encode())
    else:  # an object a state dict keeps as it is (a schedule's function): its type
        h.update(type(value).__qualname__.encode())


def send(t: LiveContext, side: JoinSide, joined: list[int]) -> tuple[str, dict[str, str]]:
    """Every member: worker 0's live state to the joiners (a broadcast over the grown
    group), then each joiner's digest of what it took. Returns worker 0's digest and the
    joiners' (by id)."""
    comm = t.comm
    state = live_state(t, side) if comm.rank == 0 else None
    mine = digest(state) if state is not None else ""
    _, mine = comm.broadcast_object((None, mine) if state is None else (state, mine))
    return mine, _digests(t, joined)


def receive(t: LiveContext, side: JoinSide, joined: list[int]) -> None:
    """A joiner: take worker 0's live state into trainer ``t`` and its membership ``side``,
    then send the digest of its own (with the others', :func:`send`)."""
    state, theirs = t.comm.broadcast_object(None)
    install(t, side, state)
    side.joined(theirs, _digests(t, joined, digest(live_state(t, side))))


def _digests(t: LiveContext, joined: list[int], mine: str = "") -> dict[str, str]:
    """Each joiner's digest, by its id: gathered at worker 0 and sent to all, so that a
    joiner lost meanwhile (the meetings held again without it) sends none."""
    me = t.comm.membership.me
    got = t.comm.gather_objects((me, mine) if me in joined else None)
    return t.comm.broadcast_object({str(w): d for w, d in filter(None, got or [])})


def install(t: LiveContext, side: JoinSide, state: dict[str, Any]) -> None:
    """Put a :func:`live_state` in place in trainer ``t`` and its membership ``side`` (a
    joiner's)."""
    t.model.load_state_dict(state["model"])
    t.optimizer.load_state_dict(state["optimizer"])
    t.strategy.load_state_dict(state["strategy"])
    t.scheduler.load_state_dict(state["scheduler"])
    t.amp.load_state_dict(state["precision"])
    t.state.load_state_dict({"progress": state["progress"], "rank": None})
    side.take_over(state["order"], state["elastic"])
