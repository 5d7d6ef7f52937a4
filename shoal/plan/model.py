"""A cost model for clusters that cannot be run here: ``shoal plan --simulate``.

An alpha-beta model (Hockney): a message of ``n`` bytes costs ``alpha + n * beta``, where
``alpha`` is the latency of a message and ``1 / beta`` the bandwidth of a node's link (each
way). A worker's step is its compute plus the communication its strategy exposes:

- compute: ``c * b`` for ``b`` samples, ``c`` measured on this machine with the real model
  (a few timed forward/backward/optimizer steps). Workers that share a machine's cores are
  slowed by ``max(1, workers / cores)`` (the validation runs many workers on two cores).
- ``sync``: a ring all-reduce of the ``n``-byte gradient every step,
  ``2 (p - 1) / p * n * beta + 2 (p - 1) * alpha`` (DDP's one bucket for small models: no
  overlap with backward is assumed).
- ``local-sgd``, ``diloco``: the same all-reduce of the parameters every ``tau`` steps,
  exposed (the next step needs the average).
- ``easgd``, ``eamsgd``: the all-reduce every ``tau`` steps, hidden behind the round's
  other ``tau - 1`` steps (``--overlap``, the default): a round takes
  ``c_step + max((tau - 1) c_step, allreduce)``.
- the parameter-server family (``async-sgd``, ``async-msgd`` every step; ``async-easgd``,
  ``async-measgd`` every ``tau``): each exchange pushes and pulls the flat vector,
  ``2 alpha + 2 n beta`` through the worker's link. The ``k`` servers' links carry every
  worker's traffic, ``n / k`` bytes per shard and direction per exchange, so they serve at
  most ``k / (n beta)`` exchanges per second: when the workers ask for more, they queue and a
  worker's cycle becomes ``pushers * n * beta / k``.
- ``groups`` (``g`` groups of ``s = p / g``): a ring all-reduce inside the group, the
  leader's push and pull (``g`` pushers), and the group's broadcast of the parameters
  (``n beta + ceil(log2 s) alpha``).

``alpha`` and ``beta`` are calibrated on this machine from a Gloo all-reduce between two
local processes (``alpha_host``, ``beta_host``: what the endpoints' software costs here);
a network's ``--bandwidth`` and ``--latency`` are taken at their nominal values, or with
``--host-cost`` added to the calibrated ones (how the emulated cluster of this machine is
predicted: its hosts are this machine's processes behind a rate-limited link).

The output is each strategy's throughput (samples/s) and weak-scaling efficiency
``throughput(p) / (p * throughput(1))``, where ``throughput(1)`` is one worker training
alone (``1 / c`` samples per second, no communication).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.core.files import check_output_dir, make_output_dir
from shoal.core.guard import die_with_parent
from shoal.errors import ShoalError

#: The SC17 paper's weak-scaling efficiency (You, Buluc & Demmel: 91.5% on 4,253 KNL cores).
SC17_EFFICIENCY = 0.915
#: The strategies ``--simulate`` predicts unless ``--strategies`` names others.
DEFAULT_STRATEGIES = "sync,local-sgd,easgd,diloco,async-sgd,async-easgd,groups:groups=4"
#: ``simulate.json``'s schema version.
SCHEMA = 1

_RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME = re.compile(r"^(\d+(?:\.\d+)?)\s*(ns|us|µs|ms|s)$", re.IGNORECASE)
_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}

#: How each strategy communicates (its class's name in the model).
SYNC, PERIODIC, OVERLAPPED, SERVER, GROUPS = "sync", "periodic", "overlapped", "server", "groups"
KINDS = {"sync": SYNC, "local-sgd": PERIODIC, "diloco": PERIODIC, "easgd": OVERLAPPED,
         "eamsgd": OVERLAPPED, "async-sgd": SERVER, "async-msgd": SERVER,
         "async-easgd": SERVER, "async-measgd": SERVER, "groups": GROUPS}


# -- units ------------------------------------------------------------------------------------
def parse_bandwidth(text: str) -> float:
    """``10gbit``, ``100mbit``, ``1gbit`` (bits per second, as ``tc`` writes them) -> bytes
    per second; a one-line error otherwise."""
    m = _RATE.match(str(text).strip())
    if not m or float(m.group(1)) <= 0:
        raise ShoalError(f"--bandwidth must be a rate like 10gbit, 100mbit or 1gbit, got {text!r}")
    return float(m.group(1)) * _RATE_UNITS[m.group(2).lower()] / 8.0


def parse_latency(text: str) -> float:
    """``5us``, ``1ms``, ``0.2ms``, ``0s`` -> seconds; a one-line error otherwise."""
    m = _TIME.match(str(text).strip())
    if not m:
        raise ShoalError(f"--latency must be a time like 5us, 50us or 1ms, got {text!r}")
    return float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]


def show_rate(bytes_per_s: float) -> str:
    """Bytes per second as bits: ``1.25e9`` -> ``10 Gbit/s``."""
    bits = 8 * bytes_per_s
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits:.3g} bit/s"


# -- the formulas -----------------------------------------------------------------------------
def ring_allreduce_s(p: int, nbytes: float, beta: float, alpha: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``p`` nodes: ``2 (p-1)/p * nbytes * beta +
    2 (p-1) * alpha`` (reduce-scatter then all-gather, ``p - 1`` messages each)."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) / p * nbytes * beta + 2 * (p - 1) * alpha


def broadcast_s(p: int, nbytes: float, beta: float, alpha: float) -> float:
    """A (pipelined) broadcast of ``nbytes`` to ``p`` nodes: ``nbytes * beta +
    ceil(log2 p) * alpha``."""
    if p <= 1:
        return 0.0
    return nbytes * beta + math.ceil(math.log2(p)) * alpha


def exchange_s(nbytes: float, beta: float, alpha: float) -> float:
    """One worker's push and pull of the flat vector with nobody else in the way:
    ``2 alpha + 2 nbytes beta`` (its own link carries all of it, however many shards)."""
    return 2 * alpha + 2 * nbytes * beta


def server_cycle_s(pushers: int, nbytes: float, beta: float, servers: int) -> float:
    """The shortest time between two exchanges of one pusher when the servers' links are
    saturated: ``pushers`` exchanges of ``nbytes / servers`` per shard and direction."""
    return pushers * nbytes * beta / servers


# -- calibration ------------------------------------------------------------------------------
@dataclass
class Calibration:
    """What this machine measured: compute per sample of the model (with ``threads``
    threads per worker), and a local Gloo all-reduce's latency and bandwidth."""

    compute_s_per_sample: float
    threads: int
    alpha_host_s: float  #: latency of a message between two local processes
    host_bytes_per_s: float  #: bytes per second between two local processes (loopback)
    cores: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    source: str = "measured"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str) -> Calibration:
        """A calibration from a file (``simulate.json``'s ``calibration`` or the same
        keys at the top level); a one-line error naming ``source`` otherwise."""
        values = values.get("calibration", values)
        need = ("compute_s_per_sample", "threads", "alpha_host_s", "host_bytes_per_s")
        try:
            numbers = {k: float(values[k]) for k in need}
        except (KeyError, TypeError, ValueError):
            raise ShoalError(f"{source}: a calibration needs numbers {', '.join(need)}") from None
        if not all(math.isfinite(v) and v >= 0 for v in numbers.values()) \
                or numbers["host_bytes_per_s"] <= 0 or numbers["compute_s_per_sample"] <= 0:
            raise ShoalError(f"{source}: calibration values must be positive numbers")
        return cls(numbers["compute_s_per_sample"], max(1, int(numbers["threads"])),
                   numbers["alpha_host_s"], numbers["host_bytes_per_s"],
                   int(values.get("cores", len(os.sched_getaffinity(0)))), source)


def measure_compute(model: Any, input_shape: Sequence[int], num_classes: int, batch: int,
                    threads: int, steps: int = 8, warmup: int = 3) -> float:
    """Seconds per sample of a training step (forward, backward, SGD step with momentum) of
    ``model`` on random inputs of ``batch`` samples with ``threads`` threads: the median
    of ``steps`` timed steps after ``warmup``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(batch, *input_shape)
        y = torch.randint(0, num_classes, (batch,))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        loss_fn = torch.nn.CrossEntropyLoss()
        times = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return statistics.median(times) / batch


def _collective_worker(rank: int, parent: int, init: str, sizes: list[int], reps: int,
                       out: str) -> None:
    """One of the two processes of :func:`measure_collectives` (started by ``parent``)."""
    die_with_parent(parent)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        medians = []
        for n in sizes:
            t = torch.ones(max(1, n // 4))
            for _ in range(3):
                dist.all_reduce(t)
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - t0)
            medians.append(statistics.median(times))
        if rank == 0:
            Path(out).write_text(json.dumps(medians))
    finally:
        dist.destroy_process_group()


def measure_collectives(nbytes: int, reps: int = 20) -> tuple[float, float]:
    """``(alpha, bytes per second)`` between two local processes, from the median time of a
    Gloo all-reduce of 4 bytes (``2 alpha``, the ring's two messages for ``p = 2``) and of
    ``nbytes`` (``2 alpha + nbytes / bandwidth``)."""
    import torch.multiprocessing as mp

    nbytes = max(int(nbytes), 1 << 20)
    with tempfile.TemporaryDirectory(prefix="shoal-calibrate-") as tmp:
        out = os.path.join(tmp, "times.json")
        init = "file://" + os.path.join(tmp, "store")
        mp.start_processes(_collective_worker, args=(os.getpid(), init, [4, nbytes], reps, out), nprocs=2,
                           start_method="spawn")
        small, large = json.loads(Path(out).read_text())
    alpha = small / 2
    return alpha, nbytes / max(large - small, 1e-9)


def calibrate(cfg: Any, threads: int | None = None) -> tuple[Calibration, int]:
    """Measure ``cfg``'s model (compute per sample at its ``--batch-size``, with ``threads``
    or ``--threads-per-worker`` or all cores) and this machine's collectives; also return
    the model's parameter count."""
    model, shape, classes = _model_of(cfg)
    cores = len(os.sched_getaffinity(0))
    threads = threads or cfg.threads_per_worker or cores
    compute = measure_compute(model, shape, classes, cfg.batch_size, threads)
    alpha, host = measure_collectives(4 * _params(model))
    return Calibration(compute, threads, alpha, host, cores), _params(model)


def _model_of(cfg: Any) -> tuple[Any, tuple[int, ...], int]:
    from shoal.data import load_dataset
    from shoal.models import build_model
    from shoal.train.trainer import data_options

    data = load_dataset(cfg.dataset, data_options(cfg))
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    return model, tuple(data.input_shape), data.num_classes


def _params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# -- the cluster and the strategies -----------------------------------------------------------
@dataclass(frozen=True)
class Network:
    """Each node's link: ``bytes_per_s`` each way (``None``: no link, the processes of this
    machine, whose calibrated cost is the whole cost) and ``latency_s`` per message.
    ``host_cost``: add this machine's calibrated endpoint cost (latency and per-byte time of
    Gloo between two local processes) to the link's, as when the nodes are processes of this
    machine behind an emulated link; off, a given link is taken at its nominal values."""

    bytes_per_s: float | None = None
    latency_s: float = 0.0
    host_cost: bool = False

    @property
    def _host(self) -> bool:
        return self.host_cost or not self.bytes_per_s

    def alpha(self, cal: Calibration) -> float:
        """Seconds per message."""
        return self.latency_s + (cal.alpha_host_s if self._host else 0.0)

    def beta(self, cal: Calibration) -> float:
        """Seconds per byte."""
        link = 1.0 / self.bytes_per_s if self.bytes_per_s else 0.0
        return link + (1.0 / cal.host_bytes_per_s if self._host else 0.0)


@dataclass(frozen=True)
class Workload:
    """A strategy with its knobs: ``tau`` (periodic and elastic ones), ``groups``,
    ``servers`` (the parameter server's shards), ``overlap`` (EASGD's hidden all-reduce)."""

    strategy: str
    tau: int = 4
    groups: int = 1
    servers: int = 1
    overlap: bool = True

    @property
    def kind(self) -> str:
        try:
            return KINDS[self.strategy]
        except KeyError:
            raise ShoalError(f"the cost model has no formula for strategy {self.strategy!r} "
                             f"(it models {', '.join(KINDS)})") from None

    @property
    def label(self) -> str:
        knobs = {SYNC: "", PERIODIC: f" tau={self.tau}", OVERLAPPED: f" tau={self.tau}",
                 GROUPS: f" g={self.groups} k={self.servers}"}
        if self.kind == SERVER:
            every = f" tau={self.tau}" if self.strategy in ("async-easgd", "async-measgd") else ""
            return f"{self.strategy}{every} k={self.servers}"
        text = self.strategy + knobs[self.kind]
        return text + (" no-overlap" if self.kind == OVERLAPPED and not self.overlap else "")

    @property
    def period(self) -> int:
        """Steps between two exchanges (1 for those that talk every step)."""
        if self.kind in (PERIODIC, OVERLAPPED) or self.strategy in ("async-easgd", "async-measgd"):
            return max(1, self.tau)
        return 1


@dataclass
class Prediction:
    """The model's answer for one workload on ``nodes`` workers."""

    workload: Workload
    nodes: int
    batch: int  #: samples per worker per step
    step_s: float  #: a worker's average time per step
    compute_s: float  #: of which compute
    samples_per_s: float
    efficiency: float
    bound: str  #: what limits it: compute, network or server
    bytes_per_step: float  #: bytes a worker sends per step, on average

    @property
    def comm_s(self) -> float:
        return max(0.0, self.step_s - self.compute_s)

    def to_dict(self) -> dict[str, Any]:
        w = self.workload
        return {"label": w.label, "strategy": w.strategy, "tau": w.period, "groups": w.groups,
                "servers": w.servers if w.kind in (SERVER, GROUPS) else 0, "nodes": self.nodes,
                "batch_per_worker": self.batch, "step_s": self.step_s, "compute_s": self.compute_s,
                "comm_s": self.comm_s, "comm_fraction": self.comm_s / self.step_s,
                "samples_per_s": self.samples_per_s, "efficiency": self.efficiency,
                "bound": self.bound, "bytes_per_step": self.bytes_per_step}


def predict(w: Workload, nodes: int, batch: int, params: int, cal: Calibration, net: Network,
            shared_cores: int | None = None) -> Prediction:
    """Predict ``w`` on ``nodes`` workers of ``batch`` samples each, for a model of
    ``params`` float32 parameters. ``shared_cores``: the workers share one machine of that
    many cores (each is slowed by ``max(1, nodes / cores)``); ``None``: one machine each."""
    if nodes < 1 or batch < 1:
        raise ShoalError(f"the model needs at least one node and one sample, got {nodes}, {batch}")
    n = 4.0 * params
    a, b = net.alpha(cal), net.beta(cal)
    slow = max(1.0, nodes / shared_cores) if shared_cores else 1.0
    c = cal.compute_s_per_sample * batch * slow
    tau, kind, bound = w.period, w.kind, "compute"
    sent = 0.0
    if nodes == 1 and kind not in (SERVER, GROUPS):
        step, sent = c, 0.0
    elif kind == SYNC:
        comm = ring_allreduce_s(nodes, n, b, a)
        step, sent = c + comm, 2 * (nodes - 1) / nodes * n
    elif kind == PERIODIC:
        comm = ring_allreduce_s(nodes, n, b, a)
        step, sent = c + comm / tau, 2 * (nodes - 1) / nodes * n / tau
    elif kind == OVERLAPPED:
        comm = ring_allreduce_s(nodes, n, b, a)
        round_s = c + max((tau - 1) * c, comm) if w.overlap else tau * c + comm
        step, sent = round_s / tau, 2 * (nodes - 1) / nodes * n / tau
    elif kind == SERVER:
        free = tau * c + exchange_s(n, b, a)
        busy = server_cycle_s(nodes, n, b, w.servers)
        step, sent = max(free, busy) / tau, n / tau
        if busy > free:
            bound = "server"
    else:  # GROUPS
        g = max(1, min(w.groups, nodes))
        size = math.ceil(nodes / g)
        inside = ring_allreduce_s(size, n, b, a) + broadcast_s(size, n, b, a)
        free = c + inside + exchange_s(n, b, a)
        busy = server_cycle_s(g, n, b, w.servers)
        step = max(free, busy)
        sent = 2 * (size - 1) / size * n + 2 * n / size  # the leader's push and broadcast, shared
        if busy > free:
            bound = "server"
    if bound == "compute" and step - c > c:
        bound = "network"
    thr = nodes * batch / step
    one = batch / (cal.compute_s_per_sample * batch)
    return Prediction(w, nodes, batch, step, c, thr, thr / (nodes * one), bound, sent)


def workloads(spec: str, given: dict[str, Any]) -> list[Workload]:
    """The workloads of ``--strategies`` (``sync,local-sgd:tau=16,groups:groups=8``): each
    knob from the spec, else the run's flag (``--tau``, ``--groups``, ``--servers``), else
    the strategy's default."""
    from shoal.strategies import get_strategy
    from shoal.sweep.spec import parse_strategies

    out = []
    for s in parse_strategies(spec):
        opts = {**{k: v for k, v in given.items() if v is not None}, **dict(s.options)}
        defaults = get_strategy(s.name).Options()
        w = Workload(s.name)
        try:
            w = Workload(
                s.name, tau=_knob(opts, "tau", getattr(defaults, "tau", 4)),
                groups=_knob(opts, "groups", getattr(defaults, "groups", 1)),
                servers=_knob(opts, "servers", getattr(defaults, "servers", 1)),
                overlap=str(opts.get("overlap", getattr(defaults, "overlap", True))).lower()
                not in ("false", "0", "no"))
        except ValueError as exc:
            raise ShoalError(f"--strategies: {s.label}: {exc}") from None
        w.kind  # noqa: B018  (a one-line error for a strategy without a formula)
        out.append(w)
    return out


def _knob(opts: dict[str, Any], key: str, default: Any) -> int:
    value = opts.get(key, default)
    if isinstance(value, str) and value.startswith("auto"):
        value = value.partition(":")[2] or 16  # --tau auto starts at 16 (AdaComm)
    number = int(value)
    if number < 1:
        raise ValueError(f"{key} must be at least 1, got {value}")
    return number


# -- the command ------------------------------------------------------------------------------
def add_simulate_flags(parser: argparse.ArgumentParser) -> None:
    """``shoal plan``'s flags for ``--simulate`` (their ``dest`` start with ``sim_``)."""
    g = parser.add_argument_group(
        "simulation (--simulate: predict clusters that cannot be run here)",
        "An alpha-beta cost model, calibrated on this machine, predicts each strategy's "
        "throughput and weak-scaling efficiency on --nodes nodes; writes simulate.json to --out.")
    g.add_argument("--simulate", dest="sim_simulate", action="store_true", default=False,
                   help="predict with the cost model instead of planning with trials")
    g.add_argument("--nodes", dest="sim_nodes", default=argparse.SUPPRESS, metavar="N1,N2",
                   help="node counts to predict (one worker per node; default 4,16,64,256)")
    g.add_argument("--bandwidth", dest="sim_bandwidth", default=argparse.SUPPRESS, metavar="RATE",
                   help="each node's link, each way: 10gbit, 100mbit, 1gbit (default: none, "
                        "the processes of this machine)")
    g.add_argument("--latency", dest="sim_latency", default=argparse.SUPPRESS, metavar="TIME",
                   help="latency of a message on the link: 5us, 1ms (default 0us)")
    g.add_argument("--strategies", dest="sim_strategies", default=argparse.SUPPRESS,
                   metavar="SPEC", help="strategies with their knobs, as shoal bench's "
                                        f"--strategies (default {DEFAULT_STRATEGIES})")
    g.add_argument("--host-cost", dest="sim_host_cost", action=argparse.BooleanOptionalAction,
                   default=argparse.SUPPRESS,
                   help="add this machine's measured per-message and per-byte cost of Gloo "
                        "to --bandwidth's and --latency's (default off: the link's nominal "
                        "values; always on without --bandwidth)")
    g.add_argument("--calibration", dest="sim_calibration", default=argparse.SUPPRESS, metavar="FILE",
                   help="take the calibration from FILE (a simulate.json) instead of measuring")


def simulate_keys(args: argparse.Namespace) -> dict[str, Any]:
    """Take the ``--simulate`` flags out of ``args`` (so the rest are ``shoal train``'s)."""
    found = {k: v for k, v in vars(args).items() if k.startswith("sim_")}
    for k in found:
        delattr(args, k)
    return found


def _nodes(text: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ShoalError(f"--nodes must be positive node counts like 64,256, got {text!r}")
    return values


def run_simulate(cfg: Any, args: argparse.Namespace | dict[str, Any]) -> int:
    """``shoal plan --simulate``: calibrate (or read ``--calibration``), predict every
    strategy on every node count, print the table and write ``simulate.json`` into
    ``cfg.out`` (refusing to replace one without ``--overwrite``). Returns the exit status."""
    from shoal.train.records import write_json

    opts = args if isinstance(args, dict) else vars(args)
    nodes = _nodes(opts.get("sim_nodes", "4,16,64,256"))
    bandwidth = opts.get("sim_bandwidth")
    net = Network(parse_bandwidth(bandwidth) if bandwidth else None,
                  parse_latency(opts.get("sim_latency") or "0us"),
                  bool(opts.get("sim_host_cost", False)))
    loads = workloads(opts.get("sim_strategies") or DEFAULT_STRATEGIES, cfg.strategy_options)
    out = Path(cfg.out)
    check_output_dir(out)  # before the calibration's minute
    target = out / "simulate.json"
    if target.exists() and not cfg.overwrite:
        raise ShoalError(f"{out} already holds a simulate.json; pass --overwrite to replace it")
    source = opts.get("sim_calibration")
    if source:
        try:
            values = json.loads(Path(source).read_text())
        except (OSError, ValueError) as exc:
            raise ShoalError(f"--calibration {source}: cannot read it: {exc}") from None
        if not isinstance(values, dict):
            raise ShoalError(f"--calibration {source}: expected a JSON object")
        cal = Calibration.from_dict(values, f"--calibration {source}")
        model, _, _ = _model_of(cfg)
        params = _params(model)
    else:
        print("shoal: calibrating: timing the model and a local all-reduce ...", file=sys.stderr,
              flush=True)
        cal, params = calibrate(cfg)
    rows = [predict(w, p, cfg.batch_size, params, cal, net) for w in loads for p in nodes]
    result = simulation_record(cfg, params, cal, net, rows)
    print(simulation_table(result))
    make_output_dir(out)
    write_json(target, result)
    print(f"wrote {target}")
    return 0


def simulation_record(cfg: Any, params: int, cal: Calibration, net: Network,
                      rows: Sequence[Prediction]) -> dict[str, Any]:
    """``simulate.json``: the run, the network, the calibration and every prediction."""
    largest = max((r.nodes for r in rows), default=0)
    beats = sorted({r.workload.label for r in rows
                    if r.nodes == largest and r.efficiency >= SC17_EFFICIENCY})
    return {
        "schema": SCHEMA, "model": cfg.model, "dataset": cfg.dataset,
        "batch_per_worker": cfg.batch_size, "params": params, "bytes": 4 * params,
        "network": {"bytes_per_s": net.bytes_per_s, "latency_s": net.latency_s,
                    "host_cost": net.host_cost,
                    "bandwidth": show_rate(net.bytes_per_s) if net.bytes_per_s else None},
        "effective": {"alpha_s": net.alpha(cal), "beta_s_per_byte": net.beta(cal),
                      "bytes_per_s": 1.0 / net.beta(cal)},
        "calibration": cal.to_dict(), "sc17_efficiency": SC17_EFFICIENCY,
        "beats_sc17_at": largest, "beats_sc17": beats,
        "predictions": [r.to_dict() for r in rows],
    }


def simulation_table(result: dict[str, Any]) -> str:
    """The predictions as a markdown table, with the calibration above it."""
    cal, eff = result["calibration"], result["effective"]
    link = result["network"]["bandwidth"] or "this machine's loopback"
    lines = [f"model {result['model']} ({result['params']:,} parameters, "
             f"{result['bytes'] / 1e6:.2f} MB), batch {result['batch_per_worker']} per worker; "
             f"compute {1e6 * cal['compute_s_per_sample']:.1f} us/sample with {cal['threads']} "
             f"thread(s) ({cal['source']}); link {link}, latency "
             f"{1e6 * result['network']['latency_s']:g} us; effective alpha "
             f"{1e6 * eff['alpha_s']:.1f} us, bandwidth {show_rate(eff['bytes_per_s'])}", "",
             "| strategy | nodes | samples/s | efficiency | step (ms) | comm | bound |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in result["predictions"]:
        lines.append(f"| {r['label']} | {r['nodes']} | {r['samples_per_s']:,.0f} | "
                     f"{100 * r['efficiency']:.1f}% | {1e3 * r['step_s']:.2f} | "
                     f"{100 * r['comm_fraction']:.0f}% | {r['bound']} |")
    beats = result["beats_sc17"]
    lines += ["", f"Expected to beat SC17's {100 * SC17_EFFICIENCY:.1f}% weak-scaling efficiency "
              f"at {result['beats_sc17_at']} nodes: " + (", ".join(beats) if beats else "none")]
    return "\n".join(lines)


__all__ = ["Calibration", "Network", "Prediction", "Workload", "add_simulate_flags",
           "broadcast_s", "calibrate", "exchange_s", "parse_bandwidth", "parse_latency",
           "predict", "ring_allreduce_s", "run_simulate", "server_cycle_s", "workloads"]
