"""Streaming and compressed exchanges on an emulated slow cluster: plain DiLoCo against
fragments + overlap, at fp32, bf16 and int4, side by side in one run.

Each configuration trains on ``--hosts`` network-namespace hosts joined by links of ``--rates``
(``shoal.emulate``; needs root) through torchrun, one worker a host: the 1.9M-parameter MLP
(``benchmarks/models.py:mlp_1024x2``) on synthetic 784-feature data through ``shoal train``,
and the character-level transformer of ``examples/char_lm.py``. The table gives, per worker
and exchange round, the bytes sent; the most bytes a worker had in flight at once; the share
of training time blocked on communication (exposed: launching an exchange, waiting on its
handle; for char_lm the larger worker's, run with ``--measure-wait`` so that a slower peer's
lag is its own column, peer wait); samples/s; the final quality (test accuracy and loss;
validation bits/char); and the load average at each run's end; median over ``--repeats``,
the configurations alternating. Run:

    sudo .venv/bin/python benchmarks/bench_stream.py --rates 100mbit,10mbit --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from shoal.emulate import Cluster, terminate_as_exception

REPO = Path(__file__).resolve().parent.parent
#: name -> (fragments, overlap steps as a function of tau / fragments, precision)
CONFIGS = {
    "plain fp32": (1, 0, "fp32"), "plain bf16": (1, 0, "bf16"), "plain int4": (1, 0, "int4"),
    "stream fp32": (4, -1, "fp32"), "stream bf16": (4, -1, "bf16"), "stream int4": (4, -1, "int4"),
}


def flags(config: str, tau: int) -> list[str]:
    fragments, overlap, precision = CONFIGS[config]
    overlap = tau // fragments - 1 if overlap < 0 else overlap
    return ["--tau", str(tau), "--fragments", str(fragments), "--overlap-steps", str(overlap),
            "--outer-precision", precision]


def run_mlp(cluster: Cluster, config: str, a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        program = ["-m", "shoal", "train", "--out", out, "--progress", "none",
                   "--model", "benchmarks/models.py:mlp_1024x2", "--dataset", "synthetic",
                   "--synthetic-shape", "784", "--synthetic-samples", str(a.mlp_steps * 2 * a.mlp_batch),
                   "--synthetic-noise", "12", "--batch-size", str(a.mlp_batch), "--epochs", "1",
                   "--strategy", "diloco", "--threads-per-worker", "1", *flags(config, a.mlp_tau)]
        code = cluster.torchrun(program, timeout=900, log=Path(out) / "log.txt")
        if code:
            sys.exit(f"{config}: exit {code}\n" + (Path(out) / "log.txt").read_text()[-3000:])
        s = json.loads((Path(out) / "summary.json").read_text())
    rounds = s["steps"] / a.mlp_tau
    start = 4 * s["parameters"]  # the start's broadcast, the same for all
    return {"bytes_round": (s["bytes_sent"] / s["workers"] - start) / rounds,
            "peak": s["peak_bytes_in_flight"], "exposed": s["comm_fraction"],
            "samples_per_s": s["samples_per_s"], "quality": s["test_accuracy"],
            "loss": s["test_loss"]}


def run_char_lm(cluster: Cluster, config: str, a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        result = Path(out) / "result.json"
        program = [str(REPO / "examples" / "char_lm.py"), "--steps", str(a.lm_steps),
                   "--eval-every", str(a.lm_steps), "--json", str(result),
                   *(["--measure-wait"] if getattr(a, "measure_wait", True) else []),
                   "--width", str(a.lm_width), "--layers", str(a.lm_layers),
                   "--batch-size", str(a.lm_batch), "--threads", "1", *flags(config, a.lm_tau)]
        code = cluster.torchrun(program, timeout=900, log=Path(out) / "log.txt",
                                env={"OMP_NUM_THREADS": "1"})
        if code:
            sys.exit(f"{config}: exit {code}\n" + (Path(out) / "log.txt").read_text()[-3000:])
        r = json.loads(result.read_text())
    return {"bytes_round": r["bytes_sent"] / (r["steps"] / a.lm_tau), "peak": r["peak_bytes_in_flight"],
            "exposed": max(r["exposed_comm_by_rank"]), "wait": max(r["wait_by_rank"]),
            "samples_per_s": r["samples_per_s"], "quality": r["bits_per_char"], "loss": None,
            "load": os.getloadavg()[0]}


def table(task: str, rate: str, rows: dict[str, list[dict]]) -> None:
    """Medians; exposed comm and peer wait are the most of any worker's (char_lm)."""
    quality = "bits/char" if task == "char_lm" else "test accuracy (loss)"
    print(f"\n{task}, {rate}, median of {len(next(iter(rows.values())))}\n")
    print(f"| exchange | bytes/worker/round | peak bytes in flight | exposed comm | peer wait | "
          f"samples/s | {quality} | load |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for config, runs in rows.items():
        m = {k: statistics.median(r[k] for r in runs) for k in runs[0] if runs[0][k] is not None}
        q = f"{m['quality']:.3f}" + (f" ({m['loss']:.3f})" if "loss" in m else "")
        wait = f"{100 * m['wait']:.1f}%" if "wait" in m else ""
        load = "-".join(f"{r['load']:.1f}" for r in runs) if "load" in m else ""
        print(f"| {config} | {m['bytes_round'] / 1e3:,.0f} kB | {m['peak'] / 1e3:,.0f} kB | "
              f"{100 * m['exposed']:.1f}% | {wait} | {m['samples_per_s']:,.0f} | {q} | {load} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="100mbit,10mbit")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--tasks", default="mlp,char_lm")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--mlp-steps", type=int, default=160)
    p.add_argument("--mlp-batch", type=int, default=128, help="per worker")
    p.add_argument("--mlp-tau", type=int, default=40)
    p.add_argument("--lm-steps", type=int, default=400)
    p.add_argument("--lm-tau", type=int, default=20)
    p.add_argument("--lm-width", type=int, default=64)
    p.add_argument("--lm-layers", type=int, default=2)
    p.add_argument("--lm-batch", type=int, default=32, help="per worker")
    p.add_argument("--json", help="also write every run's numbers here")
    a = p.parse_args()
    runners = {"mlp": run_mlp, "char_lm": run_char_lm}
    found: dict = {}
    for rate in a.rates.split(","):
        with terminate_as_exception(), Cluster(hosts=a.hosts, rate=rate) as cluster:
            for task in a.tasks.split(","):
                rows: dict[str, list[dict]] = {c: [] for c in a.configs.split(",")}
                for _ in range(a.repeats):  # configurations alternate: load drifts alike
                    for config, runs in rows.items():
                        runs.append(runners[task](cluster, config, a))
                        print(f"{task} {rate} {config}: {runs[-1]}", file=sys.stderr, flush=True)
                found[f"{task} {rate}"] = rows
                table(task, rate, rows)
    if a.json:
        Path(a.json).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
