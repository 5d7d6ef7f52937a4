"""``shoal plan --simulate``: each strategy's throughput and weak-scaling efficiency on
clusters that cannot be run here, from the cost model (:mod:`shoal.strategies.cost`) calibrated on
this machine (:mod:`shoal.plan.calibrate`).

Compute is ``c * b`` for ``b`` samples, ``c`` measured with the real model; every node is
a machine of its own (benchmarks/bench_model.py also predicts nodes that share one, the
emulated cluster's, with :class:`~shoal.strategies.cost.Machine`). The network's ``alpha`` and
``beta`` are ``--latency`` and
``1 / --bandwidth`` taken at their nominal values, or with ``--host-cost`` plus this
machine's calibrated endpoint cost (how the emulated cluster of this machine is predicted:
its hosts are this machine's processes behind a rate-limited link); without
``--bandwidth``, the calibrated cost alone. The output is each strategy's throughput
(samples/s) and weak-scaling efficiency ``throughput(p) / (p * throughput(1))``, where
``throughput(1)`` is one worker training alone (``1 / c`` samples per second).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.core.files import check_output_dir, make_output_dir
from shoal.errors import ShoalError
from shoal.strategies.communication import Pattern
from shoal.strategies.cost import APART, Calibration, Machine, Network, pattern_of, step_cost

log = logging.getLogger("shoal.plan")
out_log = logging.getLogger("shoal.out")  # its results

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


# -- the strategies ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _pattern(strategy: str, options: tuple[tuple[str, Any], ...], nodes: int) -> Pattern | None:
    """:func:`pattern_of`, once for each strategy, options and number of workers: a fit of
    the cost model asks for it at every point of every grid point it tries (checking the
    options, type hints and all, took most of a fit's time)."""
    return pattern_of(strategy, dict(options), nodes)


@dataclass(frozen=True)
class Workload:
    """A strategy with its options (a dict of them, checked when the pattern is asked for)."""

    strategy: str
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, strategy: str, **options: Any) -> Workload:
        """``strategy`` with ``options``, checked; a one-line error for a strategy whose
        pattern the cost model cannot price."""
        w = cls(strategy, tuple(sorted(options.items())))
        if w.pattern(1) is None:
            from shoal.strategies import STRATEGIES

            priced = [n for n, c in STRATEGIES.items() if c.communication(c.Options(), 1)]
            raise ShoalError(f"the cost model has no formula for strategy {strategy!r} "
                             f"(it models {', '.join(priced)})")
        return w

    def pattern(self, nodes: int) -> Pattern | None:
        if all(isinstance(v, (str, int, float, bool, type(None))) for _, v in self.options):
            return _pattern(self.strategy, self.options, nodes)
        return pattern_of(self.strategy, dict(self.options), nodes)

    @property
    def settings(self) -> Any:
        """The strategy's options object."""
        from shoal.strategies import get_strategy, make_options

        return make_options(get_strategy(self.strategy), dict(self.options))

    @property
    def values(self) -> dict[str, Any]:
        """The strategy's options by name, defaults included (its options' fields)."""
        o = self.settings
        return {f.name: getattr(o, f.name) for f in dataclasses.fields(o)}

    @property
    def label(self) -> str:
        """The strategy and the knobs it has: ``local-sgd tau=16``, ``groups g=8 k=2``."""
        v, text = self.values, self.strategy
        if "tau" in v:
            text += f" tau={self.pattern(1).every}"
        if "groups" in v:
            text += f" g={v['groups']}"
        if "servers" in v:
            text += f" k={v['servers']}"
        if v.get("compress", "none") != "none":
            text += f" {v['compress']}"
        if v.get("fragments", 1) > 1 or v.get("overlap_steps", 0):
            text += f" F={v['fragments']} H={v['overlap_steps']}"
        return text + (" no-overlap" if v.get("overlap", True) is False else "")


def workloads(spec: str, given: dict[str, Any]) -> list[Workload]:
    """The workloads of ``--strategies`` (``sync,local-sgd:tau=16,groups:groups=8``): each
    option from the spec, else the run's flag (``--tau``, ``--groups``, ``--servers``), else
    the strategy's default."""
    from shoal.schema import field_types, parse_text
    from shoal.strategies import get_strategy, option_fields
    from shoal.sweep.spec import parse_strategies

    out = []
    for s in parse_strategies(spec):
        cls = get_strategy(s.name)
        fields, hints = {f.name: f for f in option_fields(cls)}, field_types(cls.Options)
        values = {k: v for k, v in given.items() if k in fields and v is not None}
        try:
            values.update({k: parse_text(fields[k], hints[k], v) for k, v in s.options
                           if k in fields})  # the run settings a spec may hold are not options
            Workload(s.name, tuple(sorted(values.items()))).settings  # noqa: B018 (checks)
        except ShoalError as exc:
            raise ShoalError(f"--strategies: {s.label}: {exc}") from None
        out.append(Workload.of(s.name, **values))
    return out


# -- the predictions --------------------------------------------------------------------------
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
        w, pattern = self.workload, self.workload.pattern(self.nodes)
        return {"label": w.label, "strategy": w.strategy, "tau": pattern.every,
                "groups": w.values.get("groups", 1), "servers": pattern.servers,
                "nodes": self.nodes, "batch_per_worker": self.batch, "step_s": self.step_s,
                "compute_s": self.compute_s, "comm_s": self.comm_s,
                "comm_fraction": self.comm_s / self.step_s, "samples_per_s": self.samples_per_s,
                "efficiency": self.efficiency, "bound": self.bound,
                "bytes_per_step": self.bytes_per_step}


def predict(w: Workload, nodes: int, batch: int, params: int, cal: Calibration, net: Network,
            machine: Machine = APART) -> Prediction:
    """Predict ``w`` on ``nodes`` workers of ``batch`` samples each, for a model of
    ``params`` float32 parameters, the processes on ``machine`` (by default a
    machine each)."""
    if nodes < 1 or batch < 1:
        raise ShoalError(f"the model needs at least one node and one sample, got {nodes}, {batch}")
    cost = step_cost(w.pattern(nodes), nodes, cal.compute_s_per_sample * batch, 4.0 * params,
                     net.link(cal), machine)
    thr = nodes * batch / cost.step_s
    alone = 1.0 / cal.compute_s_per_sample  # one worker's samples per second, by itself
    return Prediction(w, nodes, batch, cost.step_s, cost.compute_s, thr, thr / (nodes * alone),
                      cost.bound, cost.bytes_per_step)


# -- the command ------------------------------------------------------------------------------
def _nodes(text: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ShoalError(f"--nodes must be positive node counts like 64,256, got {text!r}")
    return values


def _calibration(cfg: Any, source: str | None) -> tuple[Calibration, int]:
    """The calibration of ``--calibration source`` (a simulate.json) and the model's
    parameters, or both measured now."""
    from shoal.plan.calibrate import calibrate, model_of, parameters

    if not source:
        log.info("shoal: calibrating: timing the model and a local all-reduce ...")
        return calibrate(cfg)
    try:
        values = json.loads(Path(source).read_text())
    except (OSError, ValueError) as exc:
        raise ShoalError(f"--calibration {source}: cannot read it: {exc}") from None
    if not isinstance(values, dict):
        raise ShoalError(f"--calibration {source}: expected a JSON object")
    cal = Calibration.from_dict(values, f"--calibration {source}")
    return cal, parameters(model_of(cfg)[0])


def run_simulate(cfg: Any, opts: dict[str, Any]) -> int:
    """``shoal plan --simulate``: calibrate (or read ``--calibration``), predict every
    strategy on every node count, print the table and write ``simulate.json`` into
    ``cfg.out`` (refusing to replace one without ``--overwrite``). ``opts``: the
    ``--simulate`` flags, by their ``sim_`` names. Returns the exit status."""
    from shoal.train.records import write_json

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
    cal, params = _calibration(cfg, opts.get("sim_calibration"))
    rows = [predict(w, p, cfg.batch_size, params, cal, net) for w in loads for p in nodes]
    result = simulation_record(cfg, params, cal, net, rows)
    out_log.info(simulation_table(result))
    make_output_dir(out)
    write_json(target, result)
    out_log.info(f"wrote {target}")
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
