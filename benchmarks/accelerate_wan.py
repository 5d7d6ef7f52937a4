"""Accelerate's own LocalSGD against shoal's DiLoCo in one Accelerate script, at 100 Mbit/s.

Two emulated hosts (``shoal.emulate.Cluster``: a network namespace each, their veth links
rate-limited with ``tbf``; needs root) run ``benchmarks/accelerate_wan_job.py`` under
torchrun, one process a host, once per coupling and repeat, the couplings alternating:

- ``ddp``: Accelerate's default, DDP's gradient all-reduce every step (shoal's ``sync``);
- ``localsgd``: ``accelerate.local_sgd.LocalSGD(accelerator, model, local_sgd_steps=tau)``;
- ``diloco``: ``shoal.integrations.accelerate.Coupling(..., "diloco", tau=tau)``;
- ``diloco-int4``: the same, streamed: ``fragments=2, overlap_steps=1, outer_precision="int4"``.

Every run takes the same number of AdamW steps on the same batches from the same weights.
Measured: the bytes host 0's link sent during the training loop (its veth's counter, read in
its namespace) and during the whole run (both hosts' counters, read from outside:
rendezvous, DDP's start broadcast and all); samples/s of the loop (both hosts); the trained
model's test accuracy and loss. The table gives medians and ratios to ``localsgd``; every run
and the medians go, one JSON object a line, to ``--out``. Run::

    sudo .venv/bin/python benchmarks/accelerate_wan.py --repeats 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from shoal.emulate import Cluster, terminate_as_exception

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "benchmarks" / "accelerate_wan_job.py"
COUPLINGS = ("ddp", "localsgd", "diloco", "diloco-int4")
LABELS = {"ddp": "DDP (Accelerate's default = shoal sync)",
          "localsgd": "Accelerate LocalSGD",
          "diloco": "shoal DiLoCo",
          "diloco-int4": "shoal DiLoCo streaming int4"}


def counters(cluster: Cluster, host: int) -> tuple[int, int]:
    """Bytes host ``host``'s link has sent and received (``ip -s -j link`` in its namespace).

    ``shoal.emulate`` has no reader of its links' counters; this is the one the benchmark needs.
    """
    res = subprocess.run(["ip", "-n", cluster.host(host), "-s", "-j", "link", "show", "dev",
                          cluster.ifname(host)], capture_output=True, text=True, timeout=30,
                         check=True)
    stats = json.loads(res.stdout)[0]["stats64"]
    return stats["tx"]["bytes"], stats["rx"]["bytes"]


def run(cluster: Cluster, name: str, a: argparse.Namespace) -> dict:
    """One run of the job with coupling ``name``: its numbers, and the whole run's bytes."""
    with tempfile.TemporaryDirectory() as out:
        result, log = Path(out) / "result.json", Path(out) / "log.txt"
        program = [str(JOB), "--coupling", name, "--steps", str(a.steps), "--tau", str(a.tau),
                   "--width", str(a.width), "--depth", str(a.depth),
                   "--batch-size", str(a.batch_size), "--lr", str(a.lr), "--json", str(result)]
        before = [counters(cluster, h) for h in range(cluster.hosts)]
        code = cluster.torchrun(program, timeout=a.timeout, log=log,
                                env={"OMP_NUM_THREADS": "1"})
        after = [counters(cluster, h) for h in range(cluster.hosts)]
        if code or not result.exists():
            raise SystemExit(f"{name}: exit {code}\n" + log.read_text()[-4000:])
        r = json.loads(result.read_text())
    r["run_sent"] = statistics.mean(b[0] - a0[0] for a0, b in zip(before, after, strict=True))
    r["load"] = os.getloadavg()[0]  # the machine's load at the run's end (a shared machine)
    return r


def medians(runs: list[dict]) -> dict:
    keys = ("loop_sent", "run_sent", "samples_per_s", "test_accuracy", "test_loss", "seconds",
            "load")
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def table(found: dict[str, dict]) -> str:
    """The markdown table: medians, and ratios to Accelerate's LocalSGD where it ran."""
    ref = found.get("localsgd")

    def ratio(name: str, key: str) -> str:
        return f"{found[name][key] / ref[key]:.2f}x" if ref and ref[key] else "-"

    lines = ["| coupling | MB sent by a host, loop | / LocalSGD | MB sent by a host, whole run "
             "| samples/s | / LocalSGD | test accuracy | test loss | loop s | load |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, m in found.items():
        lines.append(
            f"| {LABELS[name]} | {m['loop_sent'] / 1e6:,.2f} | {ratio(name, 'loop_sent')} | "
            f"{m['run_sent'] / 1e6:,.2f} | {m['samples_per_s']:,.0f} | "
            f"{ratio(name, 'samples_per_s')} | {100 * m['test_accuracy']:.1f}% | "
            f"{m['test_loss']:.3f} | {m['seconds']:.1f} | {m['load']:.1f} |")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--couplings", default=",".join(COUPLINGS),
                   help=f"comma-separated, of {', '.join(COUPLINGS)}")
    p.add_argument("--repeats", type=int, default=3, help="runs of each coupling (median)")
    p.add_argument("--rate", default="100mbit", help="each host's link rate, each way")
    p.add_argument("--steps", type=int, default=80, help="optimizer steps on every process")
    p.add_argument("--tau", type=int, default=8, help="LocalSGD's local_sgd_steps, DiLoCo's tau")
    p.add_argument("--width", type=int, default=768, help="the MLP's hidden width")
    p.add_argument("--depth", type=int, default=3, help="the MLP's hidden layers")
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    p.add_argument("--timeout", type=float, default=300, help="seconds a run may take")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "accelerate_wan.jsonl",
                   help="JSON lines appended here")
    a = p.parse_args(argv)
    a.couplings = a.couplings.split(",")
    unknown = [c for c in a.couplings if c not in COUPLINGS]
    if unknown:
        p.error(f"--couplings: unknown {unknown[0]!r}; choose from {', '.join(COUPLINGS)}")
    if a.repeats < 1 or a.steps < 1 or a.tau < 1:
        p.error("--repeats, --steps and --tau must be at least 1")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    config = {k: v for k, v in vars(a).items() if k != "out"}
    rows: dict[str, list[dict]] = {c: [] for c in a.couplings}
    with terminate_as_exception(), Cluster(hosts=2, rate=a.rate) as cluster, \
            a.out.open("a") as out:
        for repeat in range(a.repeats):  # the couplings alternate: the load drifts alike
            for name, runs in rows.items():
                runs.append(run(cluster, name, a))
                line = {"date": stamp, "repeat": repeat, **runs[-1]}
                out.write(json.dumps(line) + "\n")
                out.flush()
                print(json.dumps(line), file=sys.stderr, flush=True)
        found = {name: medians(runs) for name, runs in rows.items()}
        out.write(json.dumps({"date": stamp, "machine": platform.node(), "config": config,
                              "medians": found}) + "\n")
    params = rows[a.couplings[0]][0]["parameters"]
    print(f"\n2 emulated hosts at {a.rate}, MLP of {params:,} parameters on digits, "
          f"{a.steps} AdamW steps, batch {a.batch_size} a host, tau {a.tau}; "
          f"median of {a.repeats}\n")
    print(table(found))


if __name__ == "__main__":
    main()
