"""The cost model of ``shoal plan --simulate`` against what can be measured here, then its
predictions for clusters that cannot be run here.

1. Calibrate the model on this machine (:func:`shoal.plan.calibrate.calibrate`: LeNet-5's compute
   per sample at batch 32 with one thread, a local Gloo all-reduce's latency and bandwidth).
2. Measure real throughput (``shoal bench``'s runner: ``shoal train`` runs, ``--warmup``
   untimed steps then ``--steps`` timed ones, weak scaling, batch 32 per worker, one thread
   per worker) of sync, local-sgd (tau 4), easgd (tau 4), async-sgd (one server) and
   groups (g = 2) at 1, 2 and 4 workers: as local processes, and across the emulated
   cluster (network namespaces, ``tbf``) at 100 Mbit/s and 1 Gbit/s (one host per process,
   servers included; one worker alone runs locally). Needs root for the emulated points.
3. Predict every point with the model (the workers share this machine's cores: compute per
   worker is slowed by ``max(1, workers / cores)``; the emulated links add the calibrated
   endpoint cost, ``--host-cost``) and report each point's error and the largest.
4. Predict 64 and 256 nodes at 10 Gbit/s and 5 us (nominal link, one node = this machine's
   cores) for each strategy, with weak-scaling efficiency, and name those the model expects
   to beat the SC17 paper's 91.5%.

Writes ``bench_model.json`` into ``--out`` and prints the tables. Run (about 10 minutes):

    sudo flock -x /work/bench.lock .venv/bin/python benchmarks/bench_model.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from shoal.config import TrainConfig
from shoal.emulate import can_emulate
from shoal.errors import ShoalError
from shoal.plan.calibrate import calibrate
from shoal.plan.cost import Calibration, Network
from shoal.plan.simulate import SC17_EFFICIENCY, parse_bandwidth, parse_latency, predict, workloads
from shoal.sweep.config import BenchConfig, Point
from shoal.sweep.measure import measure_run
from shoal.sweep.runner import Runner, train_command
from shoal.sweep.spec import parse_strategies

#: The validated strategies (groups of 2 need 2 workers at least).
MEASURED = "sync,local-sgd:tau=4,easgd:tau=4,async-sgd,groups:groups=2"
#: The strategies predicted for the clusters that cannot be run here.
PREDICTED = ("sync,local-sgd:tau=4,local-sgd:tau=16,easgd:tau=4,easgd:tau=16,diloco:tau=16,"
             "async-sgd,async-sgd:servers=16,async-easgd:tau=4,async-easgd:tau=4,servers=16,"
             "groups:groups=4,groups:groups=16,servers=16")


def run_point(runner: Runner, cfg: BenchConfig, p: Point, repeat: int) -> float:
    """Point ``p``'s samples/s after the warm-up. An asynchronous strategy's workers log no
    step records of their own: the coordinator logs one per epoch, so its run has epochs of
    ``cfg.warmup`` steps (the first is the warm-up) and is timed between their records."""
    if not p.servers:
        return runner.run(p, repeat)["samples_per_s"]
    out = (cfg.out / "runs" / p.name(repeat)).resolve()
    epoch = cfg.warmup * cfg.batch_size * p.world_size
    args = [*train_command(cfg, p, out), "--synthetic-samples", str(epoch),
            "--epochs", str((cfg.warmup + cfg.steps) // cfg.warmup), "--log-every",
            str(cfg.warmup), "--checkpoint-every", str(10**9)]
    runner.train(args, p.processes, p.world_size, out, p.name(repeat))
    (out / "checkpoint.pt").unlink(missing_ok=True)
    return measure_run(out, cfg.warmup)["samples_per_s"]


def measure(networks: list[str | None], workers: list[int], a: argparse.Namespace
            ) -> list[dict[str, Any]]:
    """Every point's measured throughput (median of ``a.repeats``)."""
    rows = []
    specs = parse_strategies(a.strategies)
    for net in networks:
        cfg = BenchConfig(models=["lenet5"], strategies=specs, workers=workers, threads=[1],
                          scaling=["weak"], batch_size=a.batch, steps=a.steps, warmup=a.warmup,
                          repeats=a.repeats, reference=False, emulate_bandwidth=net,
                          out=Path(a.out) / (net or "local"), run_timeout=300.0, quiet=True)
        counts = [w for w in workers if net is None or w > 1]  # one worker alone: local
        todo = [Point("lenet5", s, "weak", w, 1) for w in counts for s in specs
                if int(dict(s.options).get("groups", 1)) <= w]
        results: dict[Point, list[float]] = {p: [] for p in todo}
        with Runner(cfg) as runner:
            for r in range(a.repeats):  # repeats outside: a drift hits every point alike
                for p in todo:
                    t0 = time.perf_counter()
                    try:
                        thr = run_point(runner, cfg, p, r)
                    except ShoalError as exc:  # one failed point does not lose the others
                        print(f"  {net or 'local'} {p.strategy_label} w{p.world_size}: {exc}",
                              flush=True)
                        continue
                    results[p].append(thr)
                    print(f"  {net or 'local'} {p.strategy_label} w{p.world_size} r{r}: "
                          f"{thr:,.0f} samples/s ({time.perf_counter() - t0:.1f} s)", flush=True)
        for p, thr in results.items():
            if not thr:
                continue
            rows.append({"network": net or "local", "strategy": p.strategy_label,
                         "workers": p.world_size, "measured": statistics.median(thr),
                         "runs": thr})
    return rows


def add_predictions(rows: list[dict[str, Any]], cal: Calibration, params: int, batch: int,
                    spec: str) -> None:
    """Each row's predicted samples/s and its error against the measurement."""
    loads = {s.label: w for s, w in zip(parse_strategies(spec), workloads(spec, {}), strict=True)}
    for r in rows:
        net = Network() if r["network"] == "local" else \
            Network(parse_bandwidth(r["network"]), 0.0, host_cost=True)
        p = predict(loads[r["strategy"]], r["workers"], batch, params, cal, net,
                    shared_cores=cal.cores)
        r.update(predicted=p.samples_per_s, error=(p.samples_per_s - r["measured"]) / r["measured"],
                 bound=p.bound, comm_fraction=p.comm_s / p.step_s)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default=MEASURED)
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--networks", default="local,100mbit,1gbit")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--nodes", default="64,256")
    p.add_argument("--bandwidth", default="10gbit")
    p.add_argument("--latency", default="5us")
    p.add_argument("--out", default="runs/bench-model")
    p.add_argument("--from", dest="source", default=None, metavar="JSON",
                   help="re-predict the measured points of an earlier bench_model.json "
                        "(its calibration) instead of measuring")
    a = p.parse_args()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    networks = [None if n == "local" else n for n in a.networks.split(",") if n]
    if any(networks) and can_emulate() is not None:
        print(f"skipping the emulated networks: {can_emulate()}", file=sys.stderr)
        networks = [None]
    workers = [int(w) for w in a.workers.split(",")]
    if a.steps % a.warmup:
        p.error("--steps must be a multiple of --warmup (the asynchronous runs' epochs)")
    base = TrainConfig(model="lenet5", dataset="synthetic", synthetic_shape=(3, 32, 32),
                       batch_size=a.batch, threads_per_worker=1).validate()
    started = time.perf_counter()
    if a.source:
        old = json.loads(Path(a.source).read_text())
        cal = Calibration.from_dict(old["calibration"], a.source)
        after = Calibration.from_dict(old["calibration_after"], a.source)
        params, rows = old["params"], old["points"]
    else:
        cal, params = calibrate(base, threads=1)
    print(f"calibration (1 thread): {1e6 * cal.compute_s_per_sample:.1f} us/sample, alpha "
          f"{1e6 * cal.alpha_host_s:.1f} us, {cal.host_bytes_per_s / 1e6:,.0f} MB/s; "
          f"{params:,} parameters", flush=True)
    if not a.source:
        rows = measure(networks, workers, a)
        # the machine after the runs, too: the calibration's drift is part of the error
        after, _ = calibrate(base, threads=1)
    add_predictions(rows, cal, params, a.batch, a.strategies)
    worst = max(rows, key=lambda r: abs(r["error"]))
    print("\n| network | strategy | workers | measured samples/s | predicted | error |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['network']} | {r['strategy']} | {r['workers']} | {r['measured']:,.0f} | "
              f"{r['predicted']:,.0f} | {100 * r['error']:+.1f}% |")
    within = sum(abs(r["error"]) <= 0.2 for r in rows)
    print(f"\nmax |error| {100 * abs(worst['error']):.1f}% ({worst['network']} "
          f"{worst['strategy']} w{worst['workers']}); {within}/{len(rows)} points within 20%; "
          f"compute after the runs {1e6 * after.compute_s_per_sample:.1f} us/sample")

    # -- the clusters that cannot be run here -----------------------------------------------
    if a.source and "node_calibration" in old:
        node = Calibration.from_dict(old["node_calibration"], a.source)
    else:  # a node: this machine's cores, one worker
        node, _ = calibrate(base, threads=cal.cores)
    net = Network(parse_bandwidth(a.bandwidth), parse_latency(a.latency))
    nodes = [int(n) for n in a.nodes.split(",")]
    labels = [s.label for s in parse_strategies(PREDICTED)]
    big = []
    for label, w in zip(labels, workloads(PREDICTED, {}), strict=True):
        for n in nodes:
            q = predict(w, n, a.batch, params, node, net)
            big.append({"strategy": w.label, "spec": label, "nodes": n,
                        "samples_per_s": q.samples_per_s, "efficiency": q.efficiency,
                        "comm_fraction": q.comm_s / q.step_s, "bound": q.bound})
    print(f"\nPredicted at {a.bandwidth}, {a.latency} (nominal), batch {a.batch} per node, "
          f"{1e6 * node.compute_s_per_sample:.1f} us/sample with {node.threads} threads:\n")
    print("| strategy | " + " | ".join(f"{n} nodes: samples/s | efficiency" for n in nodes) + " |")
    print("|---|" + "---:|---:|" * len(nodes))
    by = {(r["strategy"], r["nodes"]): r for r in big}
    names = list(dict.fromkeys(r["strategy"] for r in big))
    for name in names:
        cells = [f"{by[name, n]['samples_per_s']:,.0f} | {100 * by[name, n]['efficiency']:.1f}%"
                 for n in nodes]
        print(f"| {name} | " + " | ".join(cells) + " |")
    beats = {n: [s for s in names if by[s, n]["efficiency"] >= SC17_EFFICIENCY] for n in nodes}
    for n in nodes:
        print(f"beat SC17's {100 * SC17_EFFICIENCY:.1f}% at {n} nodes: "
              + (", ".join(beats[n]) or "none"))
    result = {"calibration": cal.to_dict(), "calibration_after": after.to_dict(),
              "node_calibration": node.to_dict(), "params": params, "batch": a.batch,
              "steps": a.steps, "warmup": a.warmup, "repeats": a.repeats,
              "cores": len(os.sched_getaffinity(0)), "points": rows,
              "max_abs_error": abs(worst["error"]), "within_20pct": within,
              "cluster": {"bandwidth": a.bandwidth, "latency": a.latency, "rows": big,
                          "beats_sc17": {str(n): b for n, b in beats.items()}},
              "seconds": time.perf_counter() - started}
    (out / "bench_model.json").write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out / 'bench_model.json'} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
