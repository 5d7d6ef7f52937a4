"""``shoal join OUT`` for an asynchronous job: a new worker of its parameter server.

The joiner loads the data alone, asks to join (its ticket's proof in the job's store, as
for a synchronous job: :mod:`shoal.core.joining`), and once server 0 admitted it (a new
client of its shard: :mod:`shoal.train.membership.server.dealer`) it connects to the servers, builds its
trainer from the center as its first pull has it (the live server's state, not a file),
reports that state's digest, waits for the part of the others' work given to it, and
trains it as any detached worker does (reports to server 0, its own ``--record-samples``
file), to the job's release.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shoal.core.stop import Leaving, leave_on_sigterm
from shoal.errors import ShoalError


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
    from shoal.core.joining import answer, ask, ticket_of
    from shoal.core.timeline import Timeline
    from shoal.core.trust import Seal
    from shoal.core.waits import ELASTIC
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
    t.joined = True
    t.elastic.join(int(reply["epoch"]))
    leave_on_sigterm()  # a member now: SIGTERM asks it to leave (before: it ends it)
    try:
        t.run()
    except Leaving as left:  # SIGTERM: its work sent, it leaves as a lost worker does (no
        client.abandon()  # word to the servers), its rest dealt to the others
        return {"left": left.step}
    leave(client)
    return {"stopped": t.state.step} if t.elastic.stopped_job else None
