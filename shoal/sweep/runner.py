"""Running a sweep: every point a real ``shoal train`` run (a subprocess), or the DDP reference.

Each configuration trains for ``warmup + steps`` steps and is repeated; the hand-written DDP
loop of :mod:`shoal.sweep.reference` runs as one more row, so every table shows shoal next to
PyTorch itself. With ``emulate_bandwidth``, multi-worker runs go across hosts of an emulated
cluster (:mod:`shoal.emulate`), one worker per host.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shoal.core.files import make_output_dir
from shoal.core.guard import guarded_command
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
from shoal.sweep.tables import HOSTS_FIELD, markdown_table, write_outputs

out_log = logging.getLogger("shoal.out")


def train_command(cfg: BenchConfig, p: Point, out: Path) -> list[str]:
    """The ``shoal train`` arguments of point ``p``'s run, writing to ``out`` (the launcher
    adds ``--workers`` where the run starts its own workers).

    A throughput point trains ``warmup + steps`` steps; a race point ``cfg.epochs`` epochs,
    tested after each and checkpointed only at the end (a checkpoint is not part of the race).
    The strategy's own settings come last, so they override the sweep's.
    """
    assert p.strategy is not None
    batch = cfg.per_worker_batch(p.scaling, p.world_size)
    cmd = ["--model", p.model, "--dataset", cfg.dataset,
           "--batch-size", str(batch), "--threads-per-worker", str(p.threads_for()),
           "--schedule", cfg.schedule, "--lr", str(cfg.lr), "--momentum", str(cfg.momentum),
           "--progress", "none", "--out", str(out), "--overwrite", "--device", "cpu"]
    if cfg.race:
        cmd += ["--epochs", str(cfg.epochs), "--eval-every", "1", "--checkpoint-every",
                str(10**9), "--log-every", "10"]
        if cfg.eval_every_steps:
            cmd += ["--eval-every-steps", str(cfg.eval_every_steps)]
    else:
        total = cfg.warmup + cfg.steps
        cmd += ["--epochs", "1000", "--stop-at-step", str(total), "--checkpoint-every", str(total),
                "--eval-every", "1000", "--log-every", str(math.gcd(cfg.warmup, cfg.steps))]
    if cfg.dataset == "synthetic":
        cmd += ["--synthetic-shape", "x".join(map(str, cfg.synthetic_shape))]
        if not cfg.race:  # enough samples for the timed steps, all in one epoch
            cmd += ["--synthetic-samples", str((cfg.warmup + cfg.steps + 1) * batch * p.world_size)]
    return cmd + p.strategy.flags()


class Launcher:
    """Starts ``shoal train`` jobs locally (a subprocess that spawns its workers) or, with
    ``emulate_bandwidth``, across an emulated cluster (one host per process, the cluster
    kept up per host count; ``slow`` and ``links``: uneven hosts, as :class:`Cluster` takes
    them); every job bounded by ``timeout`` seconds. A context manager: leaving it tears the
    clusters down."""

    def __init__(self, emulate_bandwidth: str | None = None, timeout: float = 900.0,
                 slow: dict[int, float] | None = None, links: dict[int, str] | None = None
                 ) -> None:
        self.emulate_bandwidth, self.timeout = emulate_bandwidth, timeout
        self.slow, self.links = slow or {}, links or {}
        self._clusters: dict[int, Cluster] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _cluster(self, hosts: int) -> Cluster:
        if hosts not in self._clusters:
            assert self.emulate_bandwidth is not None
            self._clusters[hosts] = self._stack.enter_context(
                Cluster(hosts, self.emulate_bandwidth, self.slow, self.links))
        return self._clusters[hosts]

    def emulated(self, workers: int) -> bool:
        """Whether a job of ``workers`` workers runs on the emulated cluster (one worker
        alone runs locally: it has no network to cross)."""
        return self.emulate_bandwidth is not None and workers > 1

    def train(self, args: list[str], processes: int, workers: int, out: Path, name: str) -> None:
        """``python -m shoal train ARGS`` (which must write to ``out``): locally with
        ``--workers workers``, or under torchrun across ``processes`` emulated hosts."""
        self.job(["-m", "shoal", "train", *args], processes, workers, out, name)

    def job(self, program: list[str], processes: int, workers: int, out: Path, name: str,
            secrets: dict[str, str] | None = None) -> None:
        """``python PROGRAM`` as a job of ``workers`` workers: locally one process given
        ``--workers workers`` (it spawns them), or under torchrun across ``processes``
        emulated hosts (each one a rank). ``secrets``: environment variables for the job's
        processes, passed in their environment (never on a command line, which anyone on
        the machine can read)."""
        out.mkdir(parents=True, exist_ok=True)
        if self.emulated(workers):
            self.torchrun(program, processes, out, name, secrets)
            return
        # guarded: the job (and its workers) dies with this process, even by kill -9
        cmd = guarded_command([sys.executable, *program, "--workers", str(workers)])
        env = {**os.environ, **secrets} if secrets else None
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout,
                                 env=env)
        except subprocess.TimeoutExpired:
            raise ShoalError(f"benchmark run {name} did not finish in {self.timeout:.0f} s") from None
        if res.returncode != 0:
            # A collapsed run's line (exit 4) is its last on stdout.
            last = (res.stderr.strip().splitlines() or res.stdout.strip().splitlines()
                    or ["(no output)"])[-1]
            raise ShoalError(f"benchmark run {name} failed: {last}")

    def torchrun(self, program: list[str], hosts: int, out: Path, name: str,
                 secrets: dict[str, str] | None = None) -> None:
        """``torchrun ... PROGRAM`` across ``hosts`` emulated hosts, its output in
        ``out/torchrun.log``."""
        code = self._cluster(hosts).torchrun(program, timeout=self.timeout,
                                             log=out / "torchrun.log", env=secrets)
        if code:
            raise ShoalError(f"benchmark run {name} failed on the emulated cluster (exit "
                             f"{code}); see {out / 'torchrun.log'}")


class Runner(Launcher):
    """Runs the points of a sweep, locally or across an emulated cluster."""

    def __init__(self, cfg: BenchConfig) -> None:
        super().__init__(cfg.emulate_bandwidth, cfg.run_timeout, cfg.emulate_slow,
                         cfg.emulate_link_rate)
        self.cfg = cfg

    def run(self, p: Point, repeat: int) -> dict[str, Any]:
        """Run point ``p`` once; its measurements (:func:`~shoal.sweep.measure.measure_run`,
        or :func:`~shoal.sweep.measure.measure_race` in a race)."""
        out = (self.cfg.out / "runs" / p.name(repeat)).resolve()
        if p.strategy is None:
            return self._reference(p, out, p.name(repeat))
        self.train(train_command(self.cfg, p, out), p.processes, p.world_size, out,
                   p.name(repeat))
        result = measure_race(out, self.cfg.target_accuracy) if self.cfg.race \
            else measure_run(out, self.cfg.warmup)
        (out / "checkpoint.pt").unlink(missing_ok=True)  # only the records are worth keeping
        return result

    def _reference(self, p: Point, out: Path, name: str) -> dict[str, float]:
        cfg = self.cfg
        batch = cfg.per_worker_batch(p.scaling, p.world_size)
        w = Workload(model=p.model, shape=tuple(cfg.synthetic_shape), batch=batch,
                     steps=cfg.warmup + cfg.steps, warmup=cfg.warmup, lr=cfg.lr,
                     momentum=cfg.momentum)
        out.mkdir(parents=True, exist_ok=True)
        result_file = out / "reference.json"
        if self.emulated(p.world_size):
            self.torchrun(["-m", "shoal.sweep.reference", *w.flags(), "--threads",
                           str(p.threads_for()), "--out", str(result_file)], p.processes, out,
                          name)
            result = json.loads(result_file.read_text())
        else:
            result = run_reference(w, p.world_size, p.threads_for(), str(result_file))
        return {"samples_per_s": result["samples_per_s"], "global_batch": batch * p.world_size}


@contextlib.contextmanager
def _say(quiet: bool, text: str) -> Iterator[None]:
    t0 = time.perf_counter()
    if not quiet:
        out_log.info(text, extra={"end": ""})
    yield
    if not quiet:
        out_log.info(f" {time.perf_counter() - t0:.1f} s")


def run_bench(cfg: BenchConfig, command: str = "shoal bench") -> list[dict[str, Any]]:
    """Run the sweep, write its files and return the rows."""
    from shoal.plots import require_matplotlib

    cfg.validate()
    require_matplotlib()  # before minutes of running, not after
    make_output_dir(cfg.out)  # so is an --out that cannot be written
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
    if cfg.emulate_bandwidth is not None:
        for p, row in zip(todo, rows, strict=True):
            row[HOSTS_FIELD] = cfg.hosts_label(p)
    paths = write_outputs(cfg, rows, command, results)
    if not cfg.quiet:
        out_log.info("\n" + markdown_table(rows, cfg))
        out_log.info(f"wrote {', '.join(str(p) for p in paths.values())}")
    return rows
