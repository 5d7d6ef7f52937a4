"""An asynchronous job: its parameter servers, its coordinator and its workers.

A strategy with ``asynchronous = True`` (``async-sgd``, ``async-easgd``, ``hogwild``, ...)
runs as ``k + W`` processes, ``k`` = ``--servers``: rank ``r < k`` is **server r**, rank
``k + i`` is **worker i**. shoal's launcher starts them all on the launching host; under
torchrun the first ``k`` ranks (on the node holding the endpoint) are the servers.

- Server ``s`` holds the ``s``-th contiguous range of the flat parameter vector (the center)
  and serves each worker on a two-rank Gloo pair of its own
  (:class:`~shoal.core.ps.ShardServer`): one dead worker breaks only its own pair.
- Server 0 is also the run's **coordinator** (:class:`Coordinator`): workers never talk to
  each other, so it keeps ``--out``. Workers report their sums at each epoch's end, their
  state at each checkpoint and their totals at the end; once every live worker has reported
  an epoch, it evaluates the center and writes the epoch record; once every live worker has
  sent its state for a checkpoint, it writes ``checkpoint.pt`` (the centers of every server,
  every worker's own state). ``summary.json`` adds the staleness histogram and the workers
  that were lost.
- Workers run the usual :class:`~shoal.train.trainer.Trainer`, detached: no process group
  among them, every exchange through their :class:`~shoal.core.ps.ServerClient`.

A worker killed mid-run (``kill -9``) breaks its pairs: the servers mark it lost and the run
completes with the others; ``summary.json`` says ``"degraded": true`` and ``shoal train``
exits with status 3 (``shoal.cli.EXIT_DEGRADED``). A server
that dies ends the job: its workers' next exchange fails in one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import queue
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from shoal.config import TrainConfig
from shoal.core.comm import Comm
from shoal.core.env import Environment, default_threads, pick_device
from shoal.core.flat import FlatParams
from shoal.core.group import job_store
from shoal.core.ops import split_sizes
from shoal.core.ps import PULL, Header, ServerClient, ShardServer
from shoal.core.timeline import Timeline
from shoal.data import Dataset, EpochPlan, load_dataset
from shoal.errors import ShoalError
from shoal.models import build_model, count_parameters
from shoal.strategies import Strategy, get_strategy, make_options
from shoal.strategies.easgd import parameter_order
from shoal.strategies.hogwild import PATH_KEY, create_shared_file, map_shared_file
from shoal.train.checkpoint import EVAL_MODEL, load_checkpoint, save_checkpoint, to_cpu
from shoal.train.optim import build_optimizer
from shoal.train.recorder import Recorder
from shoal.train.records import write_json, write_trace
from shoal.train.state import RunState


def is_asynchronous(cls: type[Strategy]) -> bool:
    """Whether ``cls`` couples its workers through parameter servers (or shared memory)."""
    return bool(getattr(cls, "asynchronous", False))


def server_count(cfg: TrainConfig) -> int:
    """``--servers`` (1 when not given)."""
    return int(cfg.strategy_options.get("servers", 1) or 1)


def shard_ranges(n: int, servers: int) -> list[tuple[int, int]]:
    """The contiguous ``[lo, hi)`` range of the flat vector each server holds."""
    ranges, lo = [], 0
    for size in split_sizes(n, servers):
        ranges.append((lo, lo + size))
        lo += size
    return ranges


def _initial_model(cfg: TrainConfig, data: Dataset, workers: int,
                   start: dict[str, Any] | None = None) -> tuple[torch.nn.Module, FlatParams]:
    """The model every rank starts from (the trainer's seed, or ``start``'s evaluation model:
    ``--init-from``) and its flat layout (the order the strategies pack it in)."""
    from shoal.train.trainer import load_eval_model

    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    if start is not None:
        load_eval_model(model, start, cfg.init_from or "")
    optimizer = build_optimizer(cfg, model.parameters(), cfg.base_lr(workers))
    return model, FlatParams(parameter_order(model, optimizer))


def run_async_rank(cfg: TrainConfig, env: Environment, data: Dataset | None = None
                   ) -> dict[str, Any] | None:
    """Run this process's part of an asynchronous job: server or worker, by rank."""
    servers = server_count(cfg)
    workers = env.world_size - servers
    if workers < 1:
        raise ShoalError(f"--servers {servers} leaves no worker among {env.world_size} ranks")
    data = data if data is not None else load_dataset(cfg.dataset, _data_options(cfg))
    if env.rank < servers:
        return _run_server(cfg, env, data, env.rank, servers, workers)
    _run_worker(cfg, env, data, env.rank - servers, servers, workers)
    return None


def keepalive(timeout: float) -> float:
    """How often an idle client pings its servers: a worker of hogwild (which only reports
    at its epochs' ends) or the coordinator must not look lost after ``timeout``."""
    return min(timeout / 3, 30.0)


def _data_options(cfg: TrainConfig) -> Any:
    from shoal.train.trainer import data_options

    return data_options(cfg)


# -- a worker -----------------------------------------------------------------------------------
def _run_worker(cfg: TrainConfig, env: Environment, data: Dataset, worker: int, servers: int,
                workers: int) -> None:
    from shoal.train.trainer import Trainer

    on_first_node = env.rank < env.local_world_size
    local_rank = env.local_rank - servers if on_first_node else env.local_rank
    local_workers = env.local_world_size - servers if on_first_node else env.local_world_size
    torch.set_num_threads(cfg.threads_per_worker or default_threads(max(1, local_workers)))
    store = job_store(env, cfg.timeout)
    mine = dataclasses.replace(env, rank=worker, world_size=workers,
                               local_rank=max(0, local_rank))
    # Workers exchange through host memory, never NCCL: several may share a GPU.
    device = pick_device(cfg.device, max(0, local_rank), max(1, local_workers), share=True)
    comm = Comm(mine, device, Timeline(keep_events=cfg.trace), peers=False)
    model, flat = _initial_model(cfg, data, workers)
    client = ServerClient(store, worker, shard_ranges(flat.numel, servers), timeout=cfg.timeout,
                          timeline=comm.timeline, count=comm.count,
                          keepalive=keepalive(cfg.timeout))
    comm.ps = client
    comm.store = store  # hogwild finds the shared file through it
    Trainer(cfg, comm, data).run()
    client.close()  # BYE: done, not lost (a worker that raised just exits: the job fails)


# -- a server -----------------------------------------------------------------------------------
def _run_server(cfg: TrainConfig, env: Environment, data: Dataset, server: int, servers: int,
                workers: int) -> dict[str, Any] | None:
    torch.set_num_threads(1)  # serving is copies and axpys; the workers need the cores
    strategy_cls = get_strategy(cfg.strategy)
    options = make_options(strategy_cls, cfg.strategy_options, workers)
    store = job_store(env, cfg.timeout)
    payload = load_checkpoint(cfg.resume_path) if cfg.resume_path is not None else None
    start = load_checkpoint(Path(cfg.init_from)) if cfg.init_from and payload is None else None
    model, flat = _initial_model(cfg, data, workers, start)
    ranges = shard_ranges(flat.numel, servers)
    lo, hi = ranges[server]
    shared_path = None
    if getattr(strategy_cls, "shared_memory", False):
        # hogwild: one float32 file every worker maps and steps in place; the coordinator
        # maps it too (evaluation, checkpoints). In the launcher's job folder when there is
        # one (removed even if this process is killed), else in /dev/shm.
        vector = flat.pack().detach().float().clone()
        if payload is not None:
            vector.copy_(payload["servers"][0]["center"])
        shared_path = create_shared_file(vector, env.error_dir)
        center = map_shared_file(shared_path, vector.numel(), torch.float32)
        store.set(PATH_KEY, shared_path)
    else:
        center = flat.pack().detach().float()[lo:hi].clone()
    rule_cls = getattr(strategy_cls, "Rule", None)
    rule = rule_cls(center, options) if rule_cls is not None else None
    coordinator: Coordinator | None = None
    if server == 0:
        coordinator = Coordinator(cfg, data, model, flat, store, ranges, workers, payload,
                                  start if start is not None and cfg.init_progress else None)
    shard = ShardServer(
        store, server, workers + (1 if server > 0 else 0), rule, center, timeout=cfg.timeout,
        max_staleness=getattr(options, "max_staleness", None),
        order=getattr(options, "order", "arrival"), workers=workers,
        pushers=strategy_cls.pushers(options, workers),
        on_report=coordinator.on_report if coordinator is not None else None)
    if payload is not None and shared_path is None:
        shard.load_state(payload["servers"][server])
    try:
        shard.start()
        if coordinator is not None:
            return coordinator.run(shard)
        shard.wait(None)
        return None
    finally:
        shard.close()
        if shared_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(shared_path)


# -- the coordinator ----------------------------------------------------------------------------
class Coordinator:
    """Server 0's records of an asynchronous run, from its workers' reports."""

    def __init__(self, cfg: TrainConfig, data: Dataset, model: torch.nn.Module,
                 flat: FlatParams, store: Any, ranges: list[tuple[int, int]], workers: int,
                 payload: dict[str, Any] | None, start: dict[str, Any] | None = None) -> None:
        """``payload``: the checkpoint a resumed run goes on with; ``start``: the one
        ``--init-from --init-progress`` goes on from (its position only)."""
        self.cfg, self.data, self.model, self.flat = cfg, data, model, flat
        self.ranges, self.workers = ranges, workers
        self.servers = len(ranges)
        self.plan = EpochPlan(len(data.train), cfg.global_batch(workers), workers, cfg.seed)
        # The records are the Recorder's, as in a synchronous run: its comm has no peers,
        # its timeline's totals are the workers' summed and its bytes theirs.
        self.comm = Comm(Environment(0, workers), torch.device("cpu"), Timeline())
        self.recorder = Recorder(cfg, self.comm, self.plan)
        self.state = RunState(self.comm, torch.Generator(), lr=cfg.base_lr(workers))
        self.reports: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.client = (ServerClient(store, workers, ranges[1:], timeout=cfg.timeout,
                                    servers=list(range(1, self.servers)),
                                    keepalive=keepalive(cfg.timeout))
                       if self.servers > 1 else None)
        self.live = set(range(workers))
        self.latest: dict[int, dict[str, Any]] = {}  # each worker's last report
        self.epochs: dict[int, dict[int, dict[str, Any]]] = {}
        self.checkpoints: dict[int, dict[int, dict[str, Any]]] = {}
        self.own: dict[int, Any] = {}  # each worker's last checkpoint state
        self.finals: dict[int, dict[str, Any]] = {}
        self.lost: dict[int, dict[str, Any]] = {}
        self.test = (float("nan"), float("nan"))
        self.saved_step = -1
        self.started_unix = time.time()
        source = payload if payload is not None else start
        self.progress: dict[str, Any] | None = None
        if payload is not None:
            self.own = dict(enumerate(payload["ranks"]))
        if source is not None:
            # A mid-epoch checkpoint's samples of that epoch come back in the workers' epoch
            # sums (which carry them), so the position counts them once.
            carried = sum(int(r["epoch_sums"][2]) for r in source["ranks"] if r is not None)
            self.progress = {**source["progress"],
                             "samples": source["progress"]["samples"] - carried}
            self.saved_step = self.progress["step"]

    def on_report(self, client: int, obj: Any) -> None:
        """A worker's report (called on its serving thread): queued for :meth:`run`."""
        self.reports.put((client, obj))

    # -- the run --------------------------------------------------------------------------
    def run(self, shard: ShardServer) -> dict[str, Any]:
        """Record the run until every worker has finished or been lost; the summary."""
        st, rec = self.state, self.recorder
        self.shard = shard
        if self.progress is not None:
            st.load_state_dict({"progress": self.progress, "rank": None})
        st.start()
        rec.begin(st, self.data.describe())
        rec.start_epoch(st)
        while self.live - self.finals.keys():
            try:
                client, obj = self.reports.get(timeout=0.2)
            except queue.Empty:
                self._note_lost(shard)
                continue
            self._take(client, obj)
            self._note_lost(shard)
        rec.end_steps()
        return self._finish(shard)

    def _take(self, worker: int, report: dict[str, Any]) -> None:
        self.latest[worker] = report
        kind = report["kind"]
        if kind == "epoch":
            self.epochs.setdefault(report["epoch"], {})[worker] = report
        elif kind == "checkpoint":
            self.checkpoints.setdefault(report["step"], {})[worker] = report
            self.own[worker] = report["own"]
        elif kind == "final":
            self.finals[worker] = report
        self._progress()

    def _note_lost(self, shard: ShardServer) -> None:
        """Workers whose pairs broke (killed, or silent past --timeout) leave the live set."""
        for worker, info in list(shard.lost.items()):
            if worker < self.workers and worker in self.live and worker not in self.finals:
                self.live.discard(worker)
                self.lost[worker] = self._loss_record(worker, info)
                print(f"shoal: lost worker {worker} at step {self.lost[worker]['step']} "
                      f"({info.get('error', 'connection lost')}); the others go on",
                      flush=True)
                self._progress()

    def _loss_record(self, worker: int, info: dict[str, Any]) -> dict[str, Any]:
        step = max(int(info.get("step", 0)), int(self.latest.get(worker, {}).get("step", 0)))
        trained = self._rows(worker, step)
        total = self._rows(worker, self.plan.steps_per_epoch * self.cfg.epochs)
        return {"worker": worker, "rank": self.servers + worker,
                "lost_after_s": max(0.0, float(info.get("time", time.time())) - self.started_unix),
                "step": step, "samples_trained": trained, "samples_not_trained": total - trained,
                "error": str(info.get("error", ""))}

    def _rows(self, worker: int, steps: int) -> int:
        """Rows of ``worker``'s shard in its first ``steps`` steps (the plan fixes them)."""
        per_epoch = self.plan.steps_per_epoch
        order = torch.arange(len(self.data.train))
        sizes = [len(self.plan.local(order, s, worker)[0]) for s in range(per_epoch)]
        full, rest = divmod(steps, per_epoch)
        return full * sum(sizes) + sum(sizes[:rest])

    def _progress(self) -> None:
        """Write what the reports so far complete: epoch records, then checkpoints."""
        while True:
            epoch = self.state.epoch + 1
            reports = self.epochs.get(epoch, {})
            if not self.live or not self.live <= reports.keys():
                break
            self._epoch_record(epoch, self.epochs.pop(epoch))
        for step in sorted(self.checkpoints):
            reports = self.checkpoints[step]
            if self.live and self.live <= reports.keys():
                del self.checkpoints[step]
                if step > self.saved_step:
                    self._save(step, reports)

    def _sum_workers(self, at: dict[int, dict[str, Any]] | None = None) -> None:
        """The recorder's comm and timeline hold the workers' totals, summed: as of the
        reports ``at`` (an epoch's, which may complete late, once a lost worker is noticed),
        else each worker's latest."""
        totals: Counter[str] = Counter()
        sent = 0
        for worker, latest in self.latest.items():
            report = (at or {}).get(worker, latest)
            totals.update(report["times"])
            sent += int(report["bytes"])
        tl = self.comm.timeline
        tl.carry_over({k: v - tl.totals.get(k, 0.0) for k, v in totals.items()})
        self.comm.bytes_sent = sent

    def _epoch_record(self, epoch: int, reports: dict[int, dict[str, Any]]) -> None:
        st, rec = self.state, self.recorder
        sums = torch.tensor([r["sums"] for r in reports.values()], dtype=torch.float64).sum(0)
        rec.add(sums[0], sums[1], int(sums[2]))
        self._sum_workers(reports)
        st.step = max(r["step"] for r in reports.values())
        st.samples += int(sums[2])
        st.lr = reports[min(reports)]["lr"]
        st.train_time_s = st.elapsed_s()
        st.epoch_step = self.plan.steps_per_epoch
        rec.step(st, int(sums[2]))
        rec.end_steps()
        st.epoch_done()
        if st.epoch % self.cfg.eval_every == 0 or st.epoch == self.cfg.epochs:
            started = time.perf_counter()
            self.test = self.evaluate(reports)
            rec.eval_s += time.perf_counter() - started
        rec.epoch(st, self.test if st.epoch % self.cfg.eval_every == 0
                  or st.epoch == self.cfg.epochs else (float("nan"), float("nan")))
        if st.epoch < self.cfg.epochs:
            rec.start_epoch(st)

    # -- the center -----------------------------------------------------------------------
    def center(self) -> torch.Tensor:
        """The whole flat center: this server's shard and the others' (pulled)."""
        full = torch.empty(self.ranges[-1][1], dtype=torch.float32)
        lo, hi = self.ranges[0]
        full[lo:hi] = self.shard.snapshot()[: hi - lo]
        if self.client is not None:
            self.client.pull(full, Header(PULL, self.workers))
        return full

    @torch.no_grad()
    def evaluate(self, reports: dict[int, dict[str, Any]] | None = None) -> tuple[float, float]:
        """Test loss and accuracy of the center (buffers: the reporting workers' mean)."""
        self.flat.unpack(self.center().to(self.flat.tensors[0].dtype))
        buffers = [r["buffers"] for r in (reports or {}).values() if r.get("buffers")]
        for name, buf in self.model.named_buffers():
            values = [b[name] for b in buffers if name in b]
            if values:
                buf.copy_(torch.stack(values).float().mean(0) if buf.is_floating_point()
                          else values[0])
        model = self.model
        model.eval()
        test = self.data.test
        loss_sum = correct = 0.0
        batch = max(256, 2 * self.cfg.batch_size)
        for start in range(0, len(test), batch):
            x, y = test.get_batch(torch.arange(start, min(start + batch, len(test))))
            out = model(x)
            loss_sum += float(F.cross_entropy(out, y, reduction="sum"))
            correct += float((out.argmax(1) == y).sum())
        model.train()
        return loss_sum / len(test), correct / len(test)

    # -- checkpoints ----------------------------------------------------------------------
    def _save(self, step: int, reports: dict[int, dict[str, Any]]) -> None:
        first = reports[min(reports)]
        full = self.center()
        self.flat.unpack(full.to(self.flat.tensors[0].dtype))
        servers = [self.shard.state()]
        if self.client is not None:
            servers += [self.client.fetch_state(s) for s in range(1, self.servers)]
        center = to_cpu(self.model.state_dict())  # the evaluation model, saved once
        payload = {
            "config": self.cfg.to_dict(), "global_batch": self.plan.global_batch,
            "world_size": self.workers, "progress": first["progress"],
            "scheduler": first["scheduler"],
            "ranks": [self.own.get(w) for w in range(self.workers)],
            "model": center, EVAL_MODEL: center, "servers": to_cpu(servers),
        }
        save_checkpoint(self.cfg.checkpoint_path, payload)
        self.saved_step = step

    # -- the end --------------------------------------------------------------------------
    def _finish(self, shard: ShardServer) -> dict[str, Any]:
        st, rec = self.state, self.recorder
        if not self.finals:
            raise ShoalError("every worker was lost: "
                             + "; ".join(f"worker {w}: {r['error'] or 'connection lost'}"
                                         for w, r in sorted(self.lost.items())))
        self._sum_workers()
        finals = self.finals
        st.step = max(r["step"] for r in finals.values())
        stopped = any(r["stopped"] for r in finals.values())
        reason = next((r["stopped_by"] for r in finals.values() if r["stopped_by"]), None)
        st.train_time_s = st.elapsed_s()
        if math.isnan(self.test[1]) and not stopped:
            self.test = self.evaluate(None)
        summary = rec.finish(st, stopped, reason, self.test, count_parameters(self.model))
        assert summary is not None
        if self.cfg.trace:
            lanes = [r["trace"] for _, r in sorted(finals.items()) if r.get("trace")]
            from shoal.core.timeline import chrome_trace

            write_trace(Path(self.cfg.out) / "trace.json", chrome_trace(lanes, {
                "model": self.cfg.model, "strategy": self.cfg.strategy,
                "workers": self.workers, "steps": st.step}))
        hist = shard.staleness
        updates = sum(hist.values())
        summary.update({
            "device": ", ".join(sorted({str(r.get("device", "cpu")) for r in finals.values()})),
            "servers": self.servers,
            "staleness": {"histogram": {str(k): v for k, v in sorted(hist.items())},
                          "updates": updates,
                          "max": max(hist) if hist else 0,
                          "mean": (sum(k * v for k, v in hist.items()) / updates
                                   if updates else 0.0)},
            "lost_workers": [self.lost[w] for w in sorted(self.lost)],
            "degraded": bool(self.lost),
        })
        write_json(Path(self.cfg.out) / "summary.json", summary)
        if self.client is not None:
            self.client.close()
        return summary
