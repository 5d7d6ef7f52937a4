"""``shoal join OUT``: a new worker joins the elastic job running in ``OUT``.

The command reads the job file its launcher published (:mod:`shoal.train.membership.jobfile`: checked
to be its user's own; ``--store HOST:PORT``: a torchrun job's document in its store, checked
against the join secret), takes a ticket in the job's store (its worker id:
:func:`~shoal.core.admission.worker_id`), and starts the worker in a child process that dies
with it (:func:`~shoal.core.processes.start_process`). The worker loads the data and builds
the trainer alone, then starts beating in the store, asks to join with the job's secret,
and, admitted at the job's next meeting point, joins the new group, takes worker 0's live
state (:mod:`shoal.train.membership.handover`) and trains with the others to the job's end. The
command waits for it and, when it dies by a signal, says so in the store, as the
launcher does for its own workers; a worker whose store goes away (the job ended or
failed) stops within seconds (its watchdog).

In an asynchronous job the joiner is a new worker of its parameter server
(:func:`run_async_worker`): it asks to join the same way, and once server 0 admitted it (a
new client of its shard: :mod:`shoal.train.membership.server.dealer`) it connects to the
servers, builds its trainer from the center as its first pull has it (the live server's
state, not a file), reports that state's digest, waits for the part of the others' work
given to it, and trains it as any detached worker does (reports to server 0, its own
``--record-samples`` file), to the job's release.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from shoal.core.admission import answer, ask, take_ticket, ticket_of, worker_id
from shoal.core.failures import exit_status
from shoal.core.guard import name_process
from shoal.core.keeper import run_child
from shoal.core.outlive import finished_key
from shoal.core.processes import loopback_gloo_interface
from shoal.core.stop import Leaving, leave_on_sigterm
from shoal.core.waits import ELASTIC, ended_key, key_prefix, members_now, say_finished
from shoal.errors import JobError, ShoalError
from shoal.train.membership.jobfile import JOIN_SECRET_VAR, join_secret, read_job, read_job_in_store

log = logging.getLogger("shoal.train")

#: Seconds a joiner waits for the job's store to take its connection: a live one answers at
#: once, and a store gone (the job ended between the job file's read and the connection) would
#: keep a client retrying for all of its timeout.
CONNECT_TIMEOUT = 5.0


def join_job(out: Path | None, at: str | None = None,
             on_id: Callable[[int], None] | None = None) -> int:
    """Run ``shoal join OUT`` (or ``shoal join --store HOST:PORT``, ``at``: a torchrun job's
    store, where its document is signed with the join secret): returns 0 once the joined
    worker finished with the job. ``on_id``: told the worker id the ticket gave."""
    if (out is None) == (at is None):
        raise ShoalError("shoal join takes the job's --out, or --store HOST:PORT (a torchrun, "
                         "srun or mpirun job's, from a host that does not see its --out), not "
                         "both")
    if at is not None:
        host, port = _address(at)
        store = _store({"address": host, "port": port, "key": join_secret()}, timeout=10.0)
        job, where = read_job_in_store(store, host, port), f"at {at}"
    else:
        job, where = read_job(out), f"in {out}"
        store = _store(job, timeout=10.0)
    keys = _prefixed(store, job["attempt"])
    servers = job_servers(job["config"])  # an asynchronous job's server 0 checks the bound
    members = members_now(keys) or list(range(job["workers"]))
    if not servers and len(members) >= job["max_workers"]:
        raise ShoalError(f"the job {where} has {len(members)} workers, its most "
                         f"(--max-workers {job['max_workers']}); join once one is lost")
    me = worker_id(job["first_id"], take_ticket(_prefixed(store, job["attempt"], ELASTIC)))
    log.info(f"shoal: joining the job {where} as worker {me}")
    if on_id is not None:
        on_id(me)
    code, report = run_child(_worker_main, (job, me), f"shoal-join-{me}")
    failed = report is not None and report[0] == "failed"
    said = report[1] if report and report[0] == "returned" and report[1] else {}
    left, stopped = said.get("left"), said.get("stopped")
    if code == 0 and left is not None:
        with contextlib.suppress(Exception):  # for the members (the store gone: so is the job)
            keys.set(ended_key(servers + me), f"left at step {left} (SIGTERM to shoal join)")
        log.info(f"shoal: worker {me} left the job after step {left} (SIGTERM); the job goes on")
        return 0
    if code == 0 and not failed:
        with contextlib.suppress(Exception):  # for a launcher whose own workers were lost
            keys.set(finished_key(me), "1")
        log.info(f"shoal: worker {me} finished with the job" if stopped is None else
                 f"shoal: worker {me} was the job's last worker: SIGTERM stopped the job after "
                 f"step {stopped}, with a checkpoint (go on with the job's command and --resume)")
        return 0
    if failed or (code is not None and code < 0):
        how = "failed" if failed else exit_status(code or 1)
        with contextlib.suppress(Exception):  # the store gone: so is the job
            keys.set(ended_key(servers + me), how)  # for the members, and the launcher
    if failed:
        assert report is not None
        raise (ShoalError if report[2] else JobError)(f"worker {me}: {report[1]}")
    raise JobError(f"worker {me}: process {exit_status(code or 1)}")


def _store(job: dict[str, Any], timeout: float) -> Any:
    """A client of the job's store, sealed with its secret (``job["key"]``), whose calls wait
    up to ``timeout`` seconds, or a one-line error when the store does not take the
    connection within :data:`CONNECT_TIMEOUT` (the job ended: a client would retry for all
    of ``timeout``) or no secret is given."""
    import torch.distributed as dist

    from shoal.core.sealed import SealedStore, kept

    if job["key"] is None:
        raise ShoalError(f"shoal join --store needs the job's secret in {JOIN_SECRET_VAR} (the "
                         "one its ranks have)")
    try:
        inner = dist.TCPStore(job["address"], job["port"], None, False,
                              timeout=timedelta(seconds=min(timeout, CONNECT_TIMEOUT)),
                              wait_for_workers=False)
        store = kept(SealedStore(inner, bytes.fromhex(job["key"])))
        store.set_timeout(timedelta(seconds=timeout))
        return store
    except (RuntimeError, ValueError) as exc:
        raise ShoalError(f"the job's store at {job['address']}:{job['port']} does not answer "
                         f"(the job ended?): {str(exc).splitlines()[0] if str(exc) else exc}"
                         ) from None


def _address(at: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too), or a one-line error."""
    host, _, port = at.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ShoalError(f"--store {at!r} is not HOST:PORT (the address rank 0 prints)")
    return host, int(port)


def _loopback(address: str) -> bool:
    """Whether ``address`` (a name or an IP) is this machine's loopback."""
    import ipaddress

    try:
        return address == "localhost" or ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _prefixed(store: Any, attempt: int, *under: str) -> Any:
    import torch.distributed as dist

    keys = dist.PrefixStore(key_prefix(attempt), store)
    for prefix in under:
        keys = dist.PrefixStore(prefix, keys)
    return keys


def _worker_main(job: dict[str, Any], me: int) -> dict[str, int] | None:
    """The joining worker's process (:func:`~shoal.core.keeper.run_child`'s child): its
    Gloo pairs on loopback where the job's store is (a job of shoal's launcher; a torchrun
    job on a host of its own), else where ``GLOO_SOCKET_IFNAME`` says, as for the job's
    ranks; then :func:`run_worker` or, in an asynchronous job,
    :func:`run_async_worker`."""
    name_process(f"shoal worker {me}")
    interface = loopback_gloo_interface() if _loopback(job["address"]) else None
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    if job_servers(job["config"]):
        return run_async_worker(job, me, _store(job, job["config"].timeout))
    return run_worker(job, me)


def run_worker(job: dict[str, Any], me: int) -> dict[str, int] | None:
    """Build the trainer alone, ask to join, take the state handed over, train to the end;
    on SIGTERM leave the job at the next meeting (``{"left": step}``), which goes on."""
    from shoal.core.comm import Comm
    from shoal.core.env import pick_device
    from shoal.core.timeline import Timeline
    from shoal.core.trust import Seal
    from shoal.train.membership import handover
    from shoal.train.membership.tracker.process_group import Elastic
    from shoal.train.trainer import Trainer
    from shoal.train.workload import load_workload

    cfg, env = joiner_place(job, me)
    first, ticket = job["workers"], ticket_of(job["first_id"], me)
    comm = Comm(env, pick_device(cfg.device, me, me + 1), Timeline(keep_events=cfg.trace))
    work = load_workload(cfg)
    t = Trainer(cfg, comm, work.data, work.model)  # alone: its collectives go nowhere
    m = comm.watch_as_joiner(env, _store(job, cfg.timeout), cfg.heartbeat_timeout, cfg.timeout)
    # The job's secret: as a member it may be the one that checks the next joiner's proof.
    m.seal = Seal(bytes.fromhex(job["key"]))
    ask(m.keys, m.seal, ticket)
    reply = answer(m.keys, ticket, cfg.timeout)
    if "refused" in reply:
        raise ShoalError(f"the job refused it: {reply['refused']}")
    m.first_world, m.joins_handled, m.join_rounds = first, reply["handled"], reply["rounds"]
    # A member lost meanwhile: the group is agreed again with this worker in it (left out,
    # it is killed as a member would be, and its launcher says so).
    joined = m.grow(reply["epoch"], reply["members"], reply["joined"])
    comm.rank, comm.world_size = m.rank, m.world_size
    side = Elastic(t)  # its side of the job's membership, which the hand-over fills
    t.join_group(side)
    handover.receive(t, side, joined)
    leave_on_sigterm()  # a member now: SIGTERM asks it to leave (before: it ends it)
    try:
        summary = t.run()
    except Leaving as left:  # SIGTERM: this worker left, the job goes on without it
        t.close_loader()
        comm.aborted = True  # nobody waits for it at the end
        comm.close("left")
        return {"left": left.step}
    say_finished(comm.attempt_store, summary)  # the summary is its when every other was lost
    comm.close()
    return {"stopped": t.state.step} if t.elastic.stopped_job else None


def job_servers(cfg: Any) -> int:
    """How many parameter servers the job of ``cfg`` runs (0: none, a synchronous job)."""
    from shoal.train.launch import job_topology

    return job_topology(cfg, 1).servers


def joiner_place(job: dict[str, Any], me: int) -> tuple[Any, Any]:
    """Joiner ``me``'s settings (the job's, started afresh: no ``--resume``, no
    ``--init-from``) and its place (worker ``me`` of a job that started with
    ``job["workers"]``, on the job's store); its intra-op threads set."""
    import torch

    from shoal.core.env import Environment, default_threads

    cfg = dataclasses.replace(job["config"], resume=None, init_from=None)
    first = job["workers"]
    torch.set_num_threads(cfg.threads_per_worker or default_threads(first + 1))
    return cfg, Environment(rank=me, world_size=first, local_rank=me, local_world_size=me + 1,
                            master_addr=job["address"], master_port=job["port"],
                            launcher="local", agent_store=True, attempt=job["attempt"])


def run_async_worker(job: dict[str, Any], me: int, store: Any) -> dict[str, int] | None:
    """Worker ``me`` of the job ``job`` (its job file's), on its client ``store`` of the
    job's store: asks to join, trains what it is given, leaves; on SIGTERM it leaves after
    sending its work (``{"left": step}``)."""
    import torch.distributed as dist

    from shoal.core.comm import Comm
    from shoal.core.env import pick_device
    from shoal.core.timeline import Timeline
    from shoal.core.trust import Seal
    from shoal.train.launch import job_topology
    from shoal.train.remote import remote_components
    from shoal.train.server import connect, leave
    from shoal.train.trainer import Trainer
    from shoal.train.workload import load_workload

    cfg, place = joiner_place(job, me)
    first = job["workers"]
    comm = Comm(place, pick_device(cfg.device, me, me + 1, share=True),
                Timeline(keep_events=cfg.trace), store, peers=False, timeout=cfg.timeout)
    work = load_workload(cfg)
    keys, ticket = dist.PrefixStore(ELASTIC, comm.attempt_store), ticket_of(job["first_id"], me)
    ask(keys, Seal(bytes.fromhex(job["key"])), ticket)
    reply = answer(keys, ticket, cfg.timeout)
    if "refused" in reply:
        raise ShoalError(f"the job refused it: {reply['refused']}")
    # A failure from here on leaves the job as a lost worker (its pairs break as this
    # process ends), whose part server 0 deals to the others: the job goes on.
    client = connect(cfg, comm, job_topology(cfg, first), work.model)
    t = Trainer(cfg, comm, work.data, work.model, components=remote_components(client))
    t.join_detached(int(reply["epoch"]))
    leave_on_sigterm()  # a member now: SIGTERM asks it to leave (before: it ends it)
    try:
        t.run()
    except Leaving as left:  # SIGTERM: its work sent, it leaves as a lost worker does (no
        client.abandon()  # word to the servers), its rest dealt to the others
        return {"left": left.step}
    leave(client)
    return {"stopped": t.state.step} if t.elastic.stopped_job else None
