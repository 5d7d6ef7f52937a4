"""Connecting a process to its job: :func:`init_comm` finds this process's device,
joins the job's store and (unless the job has none) its process group, and returns the
process's :class:`~shoal.core.comm.Comm`."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from shoal.core.comm import Comm
from shoal.core.env import Environment, pick_device
from shoal.core.group import all_joined, job_store, join_group
from shoal.core.timeline import Timeline
from shoal.errors import ShoalError


def init_comm(
    env: Environment,
    device: str = "auto",
    timeout: float = 300.0,
    threads: int | None = None,
    timeline: Timeline | None = None,
    heartbeat_timeout: float | None = 10.0,
    *,
    place: Environment | None = None,
    elastic: bool = False,
    store: dist.Store | None = None,
) -> Comm:
    """Join the job described by ``env`` and return its :class:`Comm`.

    Gloo on CPU, NCCL on CUDA. ``timeout`` (seconds) bounds every collective and the
    rendezvous, so a lost peer is an error, never a hang. ``heartbeat_timeout`` (seconds;
    ``None``: never) is how long a rank may send no heartbeat (stopped, swapped out) before
    the job stops and names it; a rank that only computes or waits keeps beating.
    ``threads`` sets this process's intra-op threads.

    ``place``: the job has no process group of all its ranks (an asynchronous job, whose
    ranks meet through their parameter servers); this process joins only the job's store
    and its Comm, with no peers, speaks for ``place`` (its rank among the workers); it
    returns once every rank has joined. Such processes may share GPUs: they meet in no NCCL
    group of the job's. ``elastic``: the job goes on
    without a lost worker; its collectives time out after ``heartbeat_timeout`` (see
    :class:`Comm`), but its ranks first wait up to ``timeout`` for each other to arrive: a
    rank that starts slowly (a busy machine) is not a lost one. ``store``: the job's store
    to join on (a namespace of it: the job's ranks laid out anew inside the job, as
    :func:`shoal.train.launch.relaid` does), instead of the one ``env`` names.
    """
    if heartbeat_timeout is not None and not (math.isfinite(heartbeat_timeout)
                                              and heartbeat_timeout > 0):
        raise ShoalError(f"heartbeat timeout must be a positive number of seconds (or None), "
                         f"got {heartbeat_timeout}")
    if threads is not None:
        torch.set_num_threads(max(1, threads))
    mine = place or env
    dev = pick_device(device, mine.local_rank, mine.local_world_size, share=place is not None)
    if store is None and (env.world_size > 1 or elastic) \
            and (place is not None or not dist.is_initialized()):
        store = job_store(env, timeout)
    if place is not None:
        if store is not None:
            all_joined(store, env, timeout)
        return Comm(place, dev, timeline, store, peers=False, timeout=timeout)
    if store is not None:
        if elastic:  # the rendezvous waits ``timeout``; only collectives the heartbeat's
            all_joined(store, env, timeout, elastic=True)
        join_group(store, env.rank, env.world_size, dev.type,
                   (heartbeat_timeout or timeout) if elastic else timeout,
                   where=f"the job at {env.master_addr}:{env.master_port}")
        if not elastic:  # (elastic's meetings see a rank lost as the others join)
            # A rank whose group is formed may return and end: it cuts its connections
            # (Comm.close), and a rank still connecting to it would fail to join.
            all_joined(store, env, timeout, what="connected")
    return Comm(env, dev, timeline, store, heartbeat_timeout, timeout=timeout, elastic=elastic)
