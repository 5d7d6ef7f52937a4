"""Running a sweep: every point a real ``shoal train`` run (a subprocess), or the DDP reference.

Each configuration trains for ``warmup + steps`` steps and is repeated; the hand-written DDP
loop of :mod:`shoal.sweep.reference` runs as one more row, so every table shows shoal next to
PyTorch itself. With ``emulate_bandwidth``, multi-worker runs go across hosts of an emulated
cluster (:mod:`shoal.emulate`), one worker per host.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shoal.emulate import Cluster, terminate_as_exception
from shoal.errors import ShoalError
from shoal.sweep.config import BenchConfig, Point, points
from shoal.sweep.measure import (
    add_efficiency,
    add_speedup,
    default_budget,
    measure_race,
    measure_run,
    summarize,
    summarize_race,
)
from shoal.sweep.reference import Workload, run_reference
from shoal.sweep.tables import markdown_table, write_outputs


def train_command(cfg: BenchConfig, p: Point, out: Path, local_workers: bool) -> list[str]:
    """The ``python`` arguments of point ``p``'s ``shoal train`` run, writing to ``out``;
    ``local_workers``: it starts its own workers (``--workers``) rather than run under torchrun.

    A throughput point trains ``warmup + steps`` steps; a race point ``cfg.epochs`` epochs,
    tested after each and checkpointed only at the end (a checkpoint is not part of the race).
    The strategy's own settings come last, so they override the sweep's.
    """
    assert p.strategy is not None
    batch = cfg.per_worker_batch(p.scaling, p.world_size)
    cmd = ["-m", "shoal", "train", "--model", p.model, "--dataset", cfg.dataset,
           "--batch-size", str(batch), "--threads-per-worker", str(p.threads_for()),
           "--schedule", cfg.schedule, "--lr", str(cfg.lr), "--momentum", str(cfg.momentum),
           "--progress", "none", "--out", str(out), "--overwrite", "--device", "cpu"]
    if cfg.race:
        cmd += ["--epochs", str(cfg.epochs), "--eval-every", "1", "--checkpoint-every",
                str(10**9), "--log-every", "10"]
    else:
        total = cfg.warmup + cfg.steps
        cmd += ["--epochs", "1000", "--stop-at-step", str(total), "--checkpoint-every", str(total),
                "--eval-every", "1000", "--log-every", str(math.gcd(cfg.warmup, cfg.steps))]
    if cfg.dataset == "synthetic":
        cmd += ["--synthetic-shape", "x".join(map(str, cfg.synthetic_shape))]
        if not cfg.race:  # enough samples for the timed steps, all in one epoch
            cmd += ["--synthetic-samples", str((cfg.warmup + cfg.steps + 1) * batch * p.world_size)]
    if local_workers:
        cmd += ["--workers", str(p.world_size)]
    return cmd + p.strategy.flags()


class Runner:
    """Runs points locally, or across an emulated cluster kept up per world size."""

    def __init__(self, cfg: BenchConfig) -> None:
        self.cfg = cfg
        self._clusters: dict[int, Cluster] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _cluster(self, hosts: int) -> Cluster:
        if hosts not in self._clusters:
            assert self.cfg.emulate_bandwidth is not None
            self._clusters[hosts] = self._stack.enter_context(
                Cluster(hosts, self.cfg.emulate_bandwidth))
        return self._clusters[hosts]

    def _emulated(self, p: Point) -> bool:
        return self.cfg.emulate_bandwidth is not None and p.world_size > 1

    def run(self, p: Point, repeat: int) -> dict[str, Any]:
        """Run point ``p`` once; its measurements (:func:`~shoal.sweep.measure.measure_run`,
        or :func:`~shoal.sweep.measure.measure_race` in a race)."""
        out = (self.cfg.out / "runs" / p.name(repeat)).resolve()
        if p.strategy is None:
            return self._reference(p, out)
        if self._emulated(p):
            out.mkdir(parents=True, exist_ok=True)
            code = self._cluster(p.processes).torchrun(
                train_command(self.cfg, p, out, False), timeout=self.cfg.run_timeout,
                log=out / "torchrun.log")
            if code:
                raise ShoalError(f"benchmark run {p.name(repeat)} failed on the emulated "
                                 f"cluster (exit {code}); see {out / 'torchrun.log'}")
        else:
            self._subprocess([sys.executable, *train_command(self.cfg, p, out, True)], p, repeat)
        result = measure_race(out, self.cfg.target_accuracy) if self.cfg.race \
            else measure_run(out, self.cfg.warmup)
        (out / "checkpoint.pt").unlink(missing_ok=True)  # only the records are worth keeping
        return result

    def _subprocess(self, cmd: list[str], p: Point, repeat: int) -> None:
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=self.cfg.run_timeout)
        except subprocess.TimeoutExpired:
            raise ShoalError(f"benchmark run {p.name(repeat)} did not finish in "
                             f"{self.cfg.run_timeout:.0f} s") from None
        if res.returncode != 0:
            last = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ShoalError(f"benchmark run {p.name(repeat)} failed: {last}")

    def _reference(self, p: Point, out: Path) -> dict[str, float]:
        cfg = self.cfg
        batch = cfg.per_worker_batch(p.scaling, p.world_size)
        w = Workload(model=p.model, shape=tuple(cfg.synthetic_shape), batch=batch,
                     steps=cfg.warmup + cfg.steps, warmup=cfg.warmup, lr=cfg.lr,
                     momentum=cfg.momentum)
        out.mkdir(parents=True, exist_ok=True)
        result_file = out / "reference.json"
        if self._emulated(p):
            args = ["-m", "shoal.sweep.reference", *w.flags(),
                    "--threads", str(p.threads_for()), "--out", str(result_file)]
            code = self._cluster(p.processes).torchrun(args, timeout=cfg.run_timeout,
                                                        log=out / "torchrun.log")
            if code:
                raise ShoalError(f"the DDP reference loop failed on the emulated cluster (exit {code}); "
                                 f"see {out / 'torchrun.log'}")
            result = json.loads(result_file.read_text())
        else:
            result = run_reference(w, p.world_size, p.threads_for(), str(result_file))
        return {"samples_per_s": result["samples_per_s"], "global_batch": batch * p.world_size}


@contextlib.contextmanager
def _say(quiet: bool, text: str) -> Iterator[None]:
    t0 = time.perf_counter()
    if not quiet:
        print(text, end="", flush=True)
    yield
    if not quiet:
        print(f" {time.perf_counter() - t0:.1f} s", flush=True)


def run_bench(cfg: BenchConfig, command: str = "shoal bench") -> list[dict[str, Any]]:
    """Run the sweep, write its files and return the rows."""
    from shoal.plots import require_matplotlib

    cfg.validate()
    require_matplotlib()  # before minutes of running, not after
    todo = points(cfg)
    results: dict[Point, list[dict[str, Any]]] = {p: [] for p in todo}
    n, total = 0, len(todo) * cfg.repeats
    # SIGTERM too unwinds through the runner, which tears down any emulated cluster.
    with terminate_as_exception(), Runner(cfg) as runner:
        # Repeats in the outer loop: a drift in the machine's speed hits every point alike.
        for repeat in range(cfg.repeats):
            for p in todo:
                n += 1
                with _say(cfg.quiet, f"[{n}/{total}] {p.name(repeat)}"):
                    results[p].append(runner.run(p, repeat))
    if cfg.race:
        budget = cfg.budget or default_budget(results)
        rows = [summarize_race(p, results[p], budget) for p in todo]
        add_speedup(rows)
    else:
        rows = [summarize(p, results[p]) for p in todo]
        add_efficiency(rows)
    paths = write_outputs(cfg, rows, command, results)
    if not cfg.quiet:
        print("\n" + markdown_table(rows, cfg))
        print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return rows
