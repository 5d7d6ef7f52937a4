"""Joining a job's process group: its rendezvous store and ``init_process_group``, both
bounded by a timeout, with one-line errors. Every front end joins through here: training
ranks (:func:`shoal.core.connect.init_comm`), the ranks of a parallel session, and the
controller that starts them."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from shoal.core.env import Environment
from shoal.core.processes import loopback_gloo_interface
from shoal.core.sealed import SealedStore, kept
from shoal.core.secret import job_secret
from shoal.core.sockets import cut, opened
from shoal.core.stop import stop_requested
from shoal.core.waits import ended_key, key_prefix
from shoal.errors import JobError, ShoalError, Terminated

#: The TCP sockets of the default process group, as :func:`join_group` last opened it (so
#: that :func:`shoal.core.inflight.leave_group` can cut a group left with a collective).
DEFAULT_SOCKETS: set[int] = set()


def job_store(env: Environment, timeout: float) -> dist.Store:
    """The job's store as ``env`` describes it, as torch's ``env://`` rendezvous makes it: a
    client of the store the launcher serves (``env.agent_store``), else rank 0 serves it and
    the others are its clients; sealed with the job's secret (:mod:`shoal.core.sealed`)."""
    serve = env.rank == 0 and not env.agent_store
    secret = job_secret(env)
    try:
        inner = dist.TCPStore(env.master_addr, env.master_port, env.world_size, serve,
                              timeout=timedelta(seconds=timeout), multi_tenant=not env.agent_store)
    except (RuntimeError, ValueError) as exc:
        raise ShoalError(f"could not reach the job's store at {env.master_addr}:{env.master_port} "
                         f"as rank {env.rank} of {env.world_size}: {exc}") from exc
    return kept(SealedStore(inner, secret))


def own_client(store: dist.Store, attempt: int) -> dist.Store:
    """A client of its own of the job's ``store`` (under ``attempt``'s key prefix), for a
    thread that must never queue behind another's call; ``store`` itself when it is not the
    job's sealed store."""
    if isinstance(store, SealedStore):
        store = store.client(timeout=30)
    return dist.PrefixStore(key_prefix(attempt), store)


def all_joined(store: dist.Store, env: Environment, timeout: float, *,
               elastic: bool = False, what: str = "joined") -> None:
    """Say in the job's ``store`` that ``env``'s rank joined, and wait until every rank did
    (at most ``timeout`` seconds): the rendezvous of a job without a process group of all
    its ranks, after which each rank knows the others have passed their checks; of an
    ``elastic`` job's first group, which stops waiting once shoal's launcher says a rank
    ended (it would never come); and, ``what="connected"``, of the ranks that joined a
    process group (:func:`join_group`). SIGTERM (:func:`~shoal.core.stop.stop_requested`)
    ends the wait at once: a rank that never comes (its keeper killed under torchrun) would
    hold this one past the launcher's grace."""
    keys = dist.PrefixStore(key_prefix(env.attempt), store)
    if keys.add(what, 1) >= env.world_size:
        keys.set(f"{what}/all", "1")
    deadline, pause = time.monotonic() + timeout, 0.001
    try:
        while not keys.check([f"{what}/all"]):
            if stop_requested():  # SIGTERM: a rank that never comes is not waited for
                raise Terminated(f"stopped by SIGTERM before every rank of the job at "
                                 f"{env.master_addr}:{env.master_port} {what} (rank "
                                 f"{env.rank} of {env.world_size})")
            for rank in range(env.world_size) if elastic else ():
                if keys.check([ended_key(rank)]):
                    raise ShoalError(f"rank {rank} of the job at {env.master_addr}:"
                                     f"{env.master_port} {keys.get(ended_key(rank)).decode()} "
                                     f"before every rank {what}")
            if time.monotonic() >= deadline:
                raise RuntimeError("timeout")
            time.sleep(pause)  # the last rank's coming is seen within a tenth of a second
            pause = min(2 * pause, 0.2 if elastic else 0.1)
    except RuntimeError as exc:
        raise ShoalError(f"not every rank of the job at {env.master_addr}:{env.master_port} "
                         f"{what} within {timeout:g} s (rank {env.rank} of {env.world_size})"
                         ) from exc


def backend_for(device_type: str) -> str:
    """Gloo on CPU; NCCL for CUDA tensors (and Gloo for the CPU ones a job also sends)."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


@contextlib.contextmanager
def loopback_gloo(enabled: bool = True) -> Iterator[None]:
    """Pin the Gloo connections made inside to loopback (``GLOO_SOCKET_IFNAME=lo``), then give
    the previous value back: a process of the user's (a parallel session's controller) keeps
    its own setting for other jobs."""
    interface = loopback_gloo_interface() if enabled else None
    if interface is None:
        yield
        return
    old = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = old


def mesh_not_formed(message: str) -> bool:
    """Whether ``message`` is Gloo's mesh failing to form as a process group is made
    (``connectFullMesh``: a peer closed a fresh connection): Gloo's own transient on a
    loaded machine (PyTorch's CI meets it too, pytorch/pytorch#53270), not the job's
    fault."""
    return "Gloo connectFullMesh failed" in message and "Connection closed by peer" in message


def bound_waits(seconds: float) -> None:
    """Bound every later collective of this process's default group to ``seconds`` (a
    compute group under ``--elastic``: a member silent that long is gone, whatever
    ``--timeout`` its group was joined with)."""
    group = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        with contextlib.suppress(RuntimeError, ValueError):  # no backend for that device
            backend = group._get_backend(torch.device(device))
            setter = getattr(backend, "_set_default_timeout", None)
            if setter is not None:
                setter(timedelta(seconds=seconds))


def join_group(store: dist.Store, rank: int, world_size: int, device_type: str,
               timeout: float, where: str = "the job") -> None:
    """``init_process_group`` over ``store``; ``timeout`` (seconds) bounds every collective,
    so a lost peer is an error, never a hang. A failure is one line naming ``where``, and the
    job's failure, not the user's input (the store was reached: Gloo's or NCCL's own
    connections failed), so ``--max-restarts`` restarts it."""
    try:
        with opened(store) as found:
            dist.init_process_group(backend_for(device_type), store=store, rank=rank,
                                    world_size=world_size, timeout=timedelta(seconds=timeout))
        DEFAULT_SOCKETS.clear()
        DEFAULT_SOCKETS.update(found)
    except (RuntimeError, ValueError) as exc:
        raise JobError(f"could not join {where} as rank {rank} of {world_size}: {exc}") from exc


def hang_up() -> None:
    """Shut down the connections of this process's Gloo process group (as :func:`join_group`
    opened it), which stays joined: a peer still in a collective with this process, one of
    shoal's or its own ``torch.distributed`` call, fails at once, as it would had this
    process ended. (NCCL's connections are its own: left as they are.)"""
    if dist.is_initialized() and dist.get_backend() == "gloo":
        cut(DEFAULT_SOCKETS)
