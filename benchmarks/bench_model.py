"""The cost model of ``shoal plan --simulate`` against what can be measured here, with a
held-out check, then its predictions for clusters that cannot be run here.

1. Measure (``--out``; or ``--from`` an earlier ``bench_model.json``): real throughput
   (``shoal bench``'s runner: ``shoal train`` runs, ``--warmup`` untimed steps then
   ``--steps`` timed ones, weak scaling, batch 32 per worker, one thread per worker) of
   sync, local-sgd (tau 4), easgd (tau 4), async-sgd (one server) and groups (g = 2) at 1, 2
   and 4 workers: as local processes, and across the emulated cluster (network namespaces,
   ``tbf``) at 100 Mbit/s and 1 Gbit/s (one host per process, servers included; one worker
   alone runs locally). ``--repeats`` rounds of every point, each round after a calibration
   of the machine (:func:`shoal.plan.calibrate.calibrate`); needs root for the emulated
   points. The results are written after every run, so an interrupted sweep keeps them.
2. Fit and check (:mod:`model_fit`): a point's throughput is the best of its rounds (load
   from other jobs only ever slows a run down), the calibration the best of its rounds; the
   model's free parameters are fitted on the training points and every point is predicted,
   the held-out ones with parameters that never saw them.
3. Predict 64 and 256 nodes at 10 Gbit/s and 5 us (nominal link, one node = this machine's
   cores) for each strategy, with weak-scaling efficiency, and name those the model expects
   to beat the SC17 paper's 91.5%.

Writes ``bench_model.json`` into ``--out`` and prints the tables. Run (about 30 minutes):

    sudo .venv/bin/python benchmarks/bench_model.py --out runs/bench-model
    .venv/bin/python benchmarks/bench_model.py --from runs/bench-model/bench_model.json \\
        --out runs/bench-model-2   # fit and predict again, measuring nothing
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from model_fit import check_model, cluster_table, point_table

from shoal.config import TrainConfig
from shoal.core.timeline import COMM, WAIT
from shoal.emulate import can_emulate
from shoal.errors import ShoalError
from shoal.plan.calibrate import all_reduce_times, calibrate, collective_bytes, collectives_cost
from shoal.sweep.config import BenchConfig, Point
from shoal.sweep.measure import _results
from shoal.sweep.runner import Launcher, Runner, train_command
from shoal.sweep.spec import parse_strategies

#: The validated strategies (groups of 2 need 2 workers at least).
MEASURED = "sync,local-sgd:tau=4,easgd:tau=4,async-sgd,groups:groups=2"


def run_point(runner: Runner, cfg: BenchConfig, p: Point, repeat: int) -> dict[str, Any]:
    """Point ``p``'s samples/s after the warm-up, and (where its ranks log steps) a step's
    time split: ``busy_s`` (everything but communication and waiting) and ``comm_s``. An
    asynchronous strategy's workers log no step records of their own: the coordinator logs
    one per epoch, so its run has three epochs of half ``cfg.steps`` (the first is the
    warm-up; long epochs, so that an epoch's end, its records and reports, weighs little)
    and is timed between their records."""
    out = (cfg.out / "runs" / p.name(repeat)).resolve()
    args, warmup = train_command(cfg, p, out), cfg.warmup
    if p.servers:
        warmup = cfg.steps // 2
        args += ["--synthetic-samples", str(warmup * cfg.batch_size * p.world_size),
                 "--epochs", "3", "--log-every", str(warmup), "--checkpoint-every", str(10**9)]
    runner.train(args, p.processes, p.world_size, out, p.name(repeat))
    (out / "checkpoint.pt").unlink(missing_ok=True)
    summary, records = _results(out)
    kind = "epoch" if p.servers else "step"
    timed = [r for r in records if r["event"] == kind and r["step"] >= warmup]
    if len(timed) < 2:
        raise ShoalError(f"run in {out} logged no records after the warm-up")
    first, last = timed[0], timed[-1]
    steps = last["step"] - first["step"]
    result = {"samples_per_s": steps * summary["global_batch"]
              / (last["elapsed_s"] - first["elapsed_s"]), "steps": steps}
    if not p.servers:
        split = {k: sum(r["time_s"][k] for r in timed[1:]) / steps for k in timed[-1]["time_s"]}
        result.update(busy_s=sum(v for k, v in split.items() if k not in (COMM, WAIT)),
                      comm_s=split[COMM] + split[WAIT])
    return result


def raise_priority(nice: int) -> None:
    """Give this process's session, and that of every process it starts (an emulated
    host's torchrun runs in a session of its own), the scheduler's autogroup ``nice``: on a
    machine other jobs share, the runs then take the cores when they need them. A daemon
    thread looks for new processes twice a second (reading only the new ones' parents)."""
    parents: dict[int, int] = {}

    def descendants() -> set[int]:
        alive = {int(e) for e in os.listdir("/proc") if e.isdigit()}
        for pid in list(parents):
            if pid not in alive:
                del parents[pid]
        for pid in alive - parents.keys():
            with contextlib.suppress(OSError, ValueError, IndexError):
                parents[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1]
                                   .split()[1])
        mine, new = {os.getpid()}, {os.getpid()}
        while new:
            new = {pid for pid, parent in parents.items() if parent in new} - mine
            mine |= new
        return mine

    def loop() -> None:
        done: set[int] = set()
        while True:
            for pid in descendants():
                with contextlib.suppress(OSError):
                    sid = os.getsid(pid)
                    if sid not in done:
                        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
                        done.add(sid)
            time.sleep(0.5)

    mine = Path("/proc/self/autogroup")
    before = mine.read_text().rsplit(" ", 1)[1].strip()  # "/autogroup-N nice X"
    atexit.register(mine.write_text, before)  # this session's other processes: as they were
    threading.Thread(target=loop, daemon=True).start()


def emulated_collectives(out: Path, nbytes: int) -> tuple[float, float]:
    """The endpoint cost of the emulated cluster's links, ``(alpha, bytes per second)``: an
    all-reduce between two of its hosts at a rate no ``tbf`` holds back (100 Gbit/s), as
    :func:`shoal.plan.calibrate.measure_collectives` times two local processes. Its
    messages cross veth pairs and a bridge in 1500-byte frames, not loopback's 64 KB."""
    out.mkdir(parents=True, exist_ok=True)
    target = out / "collectives.json"
    with Launcher("100gbit", 120.0) as launcher:
        launcher.torchrun([str(Path(__file__).resolve()), "--collectives", str(target),
                           "--bytes", str(nbytes)], 2, out, "collectives")
    return collectives_cost(nbytes, *json.loads(target.read_text()))


def measure(a: argparse.Namespace, base: TrainConfig, result: dict[str, Any], save: Any) -> None:
    """Every point's runs, ``a.repeats`` rounds, each after a calibration; ``save()`` after
    every run."""
    networks = [None if n == "local" else n for n in a.networks.split(",") if n]
    if any(networks) and can_emulate() is not None:
        print(f"skipping the emulated networks: {can_emulate()}", file=sys.stderr)
        networks = [None]
    workers = [int(w) for w in a.workers.split(",")]
    specs = parse_strategies(a.strategies)
    first = result["repeats"]
    for r in range(first, first + a.repeats):  # rounds outside: a drift hits every point alike
        cal, params = calibrate(base, threads=1)
        result["params"] = params
        result["calibrations"].append({**cal.to_dict(), "load": os.getloadavg()[0]})
        print(f"round {r}: {1e6 * cal.compute_s_per_sample:.1f} us/sample, alpha "
              f"{1e6 * cal.alpha_host_s:.1f} us, {cal.host_bytes_per_s / 1e6:,.0f} MB/s",
              flush=True)
        if any(networks):
            alpha, rate = emulated_collectives(Path(a.out) / "collectives" / f"r{r}",
                                               collective_bytes(4 * params))
            result["calibrations"][-1].update(emulated_alpha_s=alpha, emulated_bytes_per_s=rate)
            print(f"  emulated links' endpoints: alpha {1e6 * alpha:.1f} us, "
                  f"{rate / 1e6:,.0f} MB/s", flush=True)
        for net in networks:
            cfg = BenchConfig(models=["lenet5"], strategies=specs, workers=workers, threads=[1],
                              scaling=["weak"], batch_size=a.batch, steps=a.steps,
                              warmup=a.warmup, repeats=a.repeats, reference=False,
                              emulate_bandwidth=net, out=Path(a.out) / (net or "local"),
                              run_timeout=300.0, quiet=True)
            todo = [Point("lenet5", s, "weak", w, 1) for w in workers for s in specs
                    if (net is None or w > 1) and int(dict(s.options).get("groups", 1)) <= w]
            with Runner(cfg) as runner:
                for p in todo:
                    run = {"network": net or "local", "strategy": p.strategy_label,
                           "workers": p.world_size, "round": r, "load": os.getloadavg()[0]}
                    try:
                        run.update(run_point(runner, cfg, p, r))
                    except ShoalError as exc:  # one failed run does not lose the others
                        print(f"  {run['network']} {p.strategy_label} w{p.world_size}: {exc}",
                              flush=True)
                        continue
                    result["runs"].append(run)
                    save()
                    time.sleep(a.pause)  # the machine's other jobs catch up
                    print(f"  {run['network']} {p.strategy_label} w{p.world_size} r{r}: "
                          f"{run['samples_per_s']:,.0f} samples/s (load {run['load']:.1f})",
                          flush=True)


def parser() -> argparse.ArgumentParser:
    """The benchmark's flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default=MEASURED)
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--networks", default="local,100mbit,1gbit")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nodes", default="64,256")
    p.add_argument("--bandwidth", default="10gbit")
    p.add_argument("--latency", default="5us")
    p.add_argument("--out", default="runs/bench-model")
    p.add_argument("--pause", type=float, default=0.0, metavar="S",
                   help="seconds to rest after each run (with --priority, other jobs' turn)")
    p.add_argument("--priority", type=int, default=None, metavar="NICE",
                   help="the runs' scheduler autogroup nice (-20..19; root for below 0): on a "
                        "machine other jobs share, -10 lets the runs take the cores")
    p.add_argument("--from", dest="source", default=None, metavar="JSON",
                   help="fit and predict the runs of an earlier bench_model.json instead of "
                        "measuring")
    p.add_argument("--add-to", dest="add_to", default=None, metavar="JSON",
                   help="measure --repeats more rounds and add them to an earlier "
                        "bench_model.json's (a quieter hour's runs join a busier one's)")
    p.add_argument("--collectives", default=None, help=argparse.SUPPRESS)  # under torchrun
    p.add_argument("--bytes", type=int, default=8 << 20, help=argparse.SUPPRESS)
    return p


def main() -> int:
    p = parser()
    a = p.parse_args()
    if a.collectives:  # a rank of emulated_collectives' job
        times = all_reduce_times([4, a.bytes], 20)
        if os.environ.get("RANK") == "0":
            Path(a.collectives).write_text(json.dumps(times))
        return 0
    if a.steps % a.warmup or a.steps % 2:
        p.error("--steps must be even and a multiple of --warmup")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    target = out / "bench_model.json"
    base = TrainConfig(model="lenet5", dataset="synthetic", synthetic_shape=(3, 32, 32),
                       batch_size=a.batch, threads_per_worker=1).validate()
    started = time.perf_counter()
    if a.priority is not None and not a.source:
        raise_priority(a.priority)
    if a.source:
        result = json.loads(Path(a.source).read_text())
    else:
        result = json.loads(Path(a.add_to).read_text()) if a.add_to else \
            {"batch": a.batch, "steps": a.steps, "warmup": a.warmup, "repeats": 0,
             "cores": len(os.sched_getaffinity(0)), "calibrations": [], "runs": []}
        if (result["batch"], result["steps"], result["warmup"]) != (a.batch, a.steps, a.warmup):
            p.error(f"--add-to {a.add_to} measured other --batch, --steps or --warmup")

        def save() -> None:
            target.write_text(json.dumps(result, indent=2))

        measure(a, base, result, save)
        result["repeats"] += a.repeats
        result["priority"] = a.priority
        node, _ = calibrate(base, threads=result["cores"])  # a node: this machine's cores
        result["node_calibration"] = node.to_dict()
    result["check"] = check_model(result)
    print(point_table(result["check"]))
    result["cluster"] = cluster_table(result, a.nodes, a.bandwidth, a.latency)
    result["seconds"] = result.get("seconds", 0.0) + time.perf_counter() - started
    target.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {target} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
