"""``shoal bench``: scaling studies over workers x strategies x models (x threads per worker).

Every configuration is a real ``shoal train`` run (a subprocess) for ``warmup + steps`` steps;
throughput is rank 0's samples over wall-clock time between the step records at the end of
warm-up and at the last step, the time split comes from the same records. The hand-written
DDP loop of :mod:`shoal.bench.reference` runs as one more row, so every table shows shoal next
to PyTorch itself. Each point is repeated and reported as median and range. With
``emulate_bandwidth`` multi-worker runs go across hosts of an emulated cluster
(:mod:`shoal.emulate`), one worker per host.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.core.env import default_threads
from shoal.errors import ShoalError

REFERENCE = "ddp-reference"
SCALINGS = ("weak", "strong")
CSV_FIELDS = ("model", "strategy", "scaling", "workers", "threads", "threads_label",
              "global_batch", "repeats", "samples_per_s", "samples_per_s_min",
              "samples_per_s_max", "efficiency", "comm_fraction", "wait_fraction", "bytes_per_sample",
              "runs")


@dataclass(frozen=True)
class StrategySpec:
    """A strategy and the options it runs with in the benchmark (``local-sgd:tau=4``)."""

    name: str
    options: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        return f"{self.name}:{opts}" if opts else self.name

    def flags(self) -> list[str]:
        """``shoal train`` flags for the options (``tau=4`` -> ``--tau 4``)."""
        out = ["--strategy", self.name]
        for key, value in self.options:
            flag = "--" + key.replace("_", "-")
            if value.lower() in ("true", "false"):
                out.append(flag if value.lower() == "true" else "--no-" + flag[2:])
            else:
                out += [flag, value]
        return out


def parse_strategies(text: str, common: str = "") -> list[StrategySpec]:
    """``sync,local-sgd:tau=4,lr_outer=0.7,easgd:tau=16`` -> three specs.

    A comma-separated item without ``=`` starts a new strategy; ``name:key=value`` starts one
    with an option; a bare ``key=value`` adds an option to the strategy before it.
    ``common`` options (``tau=4``) go to every strategy that takes them.
    """
    from shoal.strategies import get_strategy, option_fields

    specs: list[tuple[str, dict[str, str]]] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, colon, rest = item.partition(":")
        if colon or "=" not in item:
            if "=" in name:
                raise ShoalError(f"--strategies: {item!r} must start with a strategy name")
            specs.append((name, {}))
            item = rest
            if not item:
                continue
        if not specs:
            raise ShoalError(f"--strategies: option {item!r} comes before any strategy")
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ShoalError(f"--strategies: expected key=value, got {item!r}")
        specs[-1][1][key.replace("-", "_")] = value
    if not specs:
        raise ShoalError("--strategies is empty")
    shared = _options(common, "--strategy-options")
    out = []
    for name, opts in specs:
        if name == REFERENCE:
            raise ShoalError(f"{REFERENCE} is added by shoal bench itself (--no-reference "
                             "leaves it out)")
        cls = get_strategy(name)
        takes = {f.name for f in option_fields(cls)}
        for key in opts:
            if key not in takes:
                raise ShoalError(f"strategy {name} does not take option {key!r} "
                                 f"(it takes {', '.join(sorted(takes)) or 'none'})")
        merged = {k: v for k, v in shared.items() if k in takes} | opts
        out.append(StrategySpec(name, tuple(sorted(merged.items()))))
    return out


def _options(text: str, what: str) -> dict[str, str]:
    opts = {}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ShoalError(f"{what}: expected key=value, got {item!r}")
        opts[key.replace("-", "_")] = value
    return opts


@dataclass
class BenchConfig:
    """One sweep. ``batch_size`` is per worker for weak scaling; strong scaling keeps the
    global batch at ``global_batch_size`` (default: ``batch_size`` x the most workers)."""

    models: list[str] = field(default_factory=lambda: ["lenet5"])
    strategies: list[StrategySpec] = field(default_factory=lambda: [StrategySpec("sync")])
    workers: list[int] = field(default_factory=lambda: [1, 2])
    threads: list[int | None] = field(default_factory=lambda: [None])  # None: cores // workers
    scaling: list[str] = field(default_factory=lambda: ["weak", "strong"])
    batch_size: int = 32
    global_batch_size: int | None = None
    steps: int = 40
    warmup: int = 10
    repeats: int = 3
    dataset: str = "synthetic"
    synthetic_shape: tuple[int, ...] = (3, 32, 32)
    reference: bool = True
    emulate_bandwidth: str | None = None
    out: Path = Path("runs/bench")
    lr: float = 0.02
    momentum: float = 0.9
    timeout: float = 900.0
    train_args: list[str] = field(default_factory=list)
    quiet: bool = False

    def validate(self) -> BenchConfig:
        for name in ("batch_size", "steps", "warmup", "repeats"):
            value = getattr(self, name)
            if value < 1:
                raise ShoalError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if not self.workers or any(w < 1 for w in self.workers):
            raise ShoalError(f"--workers must be positive numbers, got {self.workers}")
        if any(t is not None and t < 1 for t in self.threads):
            raise ShoalError(f"--threads-per-worker must be positive or auto, got {self.threads}")
        bad = [s for s in self.scaling if s not in SCALINGS]
        if bad or not self.scaling:
            raise ShoalError(f"--scaling must be weak, strong or both, got {','.join(self.scaling)}")
        if not self.models:
            raise ShoalError("--models is empty")
        if self.emulate_bandwidth is not None:
            from shoal.emulate import can_emulate, rate_bits

            rate_bits(self.emulate_bandwidth)
            why = can_emulate()
            if why is not None:
                raise ShoalError(f"--emulate-bandwidth: cannot emulate a cluster here: {why}")
        if "strong" in self.scaling:
            g = self.strong_global_batch()
            for w in self.workers:
                if g % w:
                    raise ShoalError(f"strong scaling: the global batch {g} does not divide "
                                     f"among {w} workers; set --global-batch-size")
        return self

    def strong_global_batch(self) -> int:
        return self.global_batch_size or self.batch_size * max(self.workers)

    def per_worker_batch(self, scaling: str, workers: int) -> int:
        return self.batch_size if scaling == "weak" else self.strong_global_batch() // workers


@dataclass(frozen=True)
class Point:
    """One configuration of the sweep."""

    model: str
    strategy: StrategySpec | None  # None: the DDP reference loop
    scaling: str
    workers: int
    threads: int | None

    @property
    def strategy_label(self) -> str:
        return self.strategy.label if self.strategy is not None else REFERENCE

    def threads_for(self) -> int:
        return self.threads or default_threads(self.workers)

    def name(self, repeat: int) -> str:
        label = self.strategy_label.replace(":", "_").replace(",", "_").replace("=", "")
        return (f"{self.model}-{label}-{self.scaling}-w{self.workers}-t{self.threads_for()}"
                f"-r{repeat}")


def _shoal_cmd(cfg: BenchConfig, p: Point, out: Path, local_workers: bool) -> list[str]:
    assert p.strategy is not None
    batch = cfg.per_worker_batch(p.scaling, p.workers)
    total = cfg.warmup + cfg.steps
    cmd = ["-m", "shoal", "train", "--model", p.model, "--dataset", cfg.dataset,
           *p.strategy.flags(), "--batch-size", str(batch),
           "--threads-per-worker", str(p.threads_for()), "--epochs", "1000",
           "--stop-at-step", str(total), "--checkpoint-every", str(total),
           "--eval-every", "1000", "--schedule", "constant", "--lr", str(cfg.lr),
           "--momentum", str(cfg.momentum),
           "--log-every", str(math.gcd(cfg.warmup, cfg.steps)), "--progress", "none",
           "--out", str(out), "--overwrite", "--device", "cpu"]
    if cfg.dataset == "synthetic":
        cmd += ["--synthetic-shape", "x".join(map(str, cfg.synthetic_shape)),
                "--synthetic-samples", str((total + 1) * batch * p.workers)]
    if local_workers:
        cmd += ["--workers", str(p.workers)]
    return cmd + list(cfg.train_args)


def measure_run(out: Path, warmup: int) -> dict[str, float]:
    """Throughput and time split of a finished ``shoal train`` run after ``warmup`` steps."""
    try:
        summary = json.loads((out / "summary.json").read_text())
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                   if line.strip()]
    except (OSError, ValueError) as exc:
        raise ShoalError(f"benchmark run in {out} left no readable results: {exc}") from None
    steps = [r for r in records if r["event"] == "step"]
    first = next((r for r in steps if r["step"] >= warmup), None)
    last = steps[-1] if steps else None
    if first is None or last is None or last["step"] <= first["step"]:
        raise ShoalError(f"benchmark run in {out} logged no steps after the warm-up")
    samples = (last["step"] - first["step"]) * summary["global_batch"]
    split: dict[str, float] = {}
    for r in steps:
        if r["step"] > first["step"]:
            for k, v in r["time_s"].items():
                split[k] = split.get(k, 0.0) + v
    total = sum(split.values()) or 1.0
    return {"samples_per_s": samples / (last["elapsed_s"] - first["elapsed_s"]),
            "comm_fraction": split.get("comm", 0.0) / total,
            "wait_fraction": split.get("wait", 0.0) / total,
            "bytes_per_sample": summary.get("bytes_per_sample") or 0.0,
            "global_batch": summary["global_batch"]}


class Runner:
    """Runs points locally, or across an emulated cluster kept up per number of workers."""

    def __init__(self, cfg: BenchConfig) -> None:
        self.cfg = cfg
        self._clusters: dict[int, Any] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _cluster(self, workers: int) -> Any:
        from shoal.emulate import Cluster

        if workers not in self._clusters:
            assert self.cfg.emulate_bandwidth is not None
            self._clusters[workers] = self._stack.enter_context(
                Cluster(workers, self.cfg.emulate_bandwidth))
        return self._clusters[workers]

    def _emulated(self, p: Point) -> bool:
        return self.cfg.emulate_bandwidth is not None and p.workers > 1

    def run(self, p: Point, repeat: int) -> dict[str, float]:
        out = (self.cfg.out / "runs" / p.name(repeat)).resolve()
        if p.strategy is None:
            return self._reference(p, out)
        if self._emulated(p):
            out.mkdir(parents=True, exist_ok=True)
            code = self._cluster(p.workers).torchrun(_shoal_cmd(self.cfg, p, out, False),
                                                     timeout=self.cfg.timeout, log=out / "torchrun.log")
            if code:
                raise ShoalError(f"benchmark run {p.name(repeat)} failed on the emulated "
                                 f"cluster (exit {code}); see {out / 'torchrun.log'}")
        else:
            self._subprocess([sys.executable, *_shoal_cmd(self.cfg, p, out, True)], p, repeat)
        result = measure_run(out, self.cfg.warmup)
        (out / "checkpoint.pt").unlink(missing_ok=True)  # only the records are worth keeping
        return result

    def _subprocess(self, cmd: list[str], p: Point, repeat: int) -> None:
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=self.cfg.timeout)
        except subprocess.TimeoutExpired:
            raise ShoalError(f"benchmark run {p.name(repeat)} did not finish in "
                             f"{self.cfg.timeout:.0f} s") from None
        if res.returncode != 0:
            last = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ShoalError(f"benchmark run {p.name(repeat)} failed: {last}")

    def _reference(self, p: Point, out: Path) -> dict[str, float]:
        from shoal.bench.reference import Workload, run_reference

        cfg = self.cfg
        batch = cfg.per_worker_batch(p.scaling, p.workers)
        w = Workload(model=p.model, shape=tuple(cfg.synthetic_shape), batch=batch,
                     steps=cfg.warmup + cfg.steps, warmup=cfg.warmup, lr=cfg.lr,
                     momentum=cfg.momentum)
        out.mkdir(parents=True, exist_ok=True)
        result_file = out / "reference.json"
        if self._emulated(p):
            args = ["-m", "shoal.bench.reference", "--model", p.model,
                    "--shape", "x".join(map(str, w.shape)), "--batch", str(batch),
                    "--steps", str(w.steps), "--warmup", str(w.warmup), "--lr", str(w.lr),
                    "--momentum", str(w.momentum), "--threads", str(p.threads_for()),
                    "--out", str(result_file)]
            code = self._cluster(p.workers).torchrun(args, timeout=cfg.timeout,
                                                     log=out / "torchrun.log")
            if code:
                raise ShoalError(f"the DDP reference loop failed on the emulated cluster (exit {code}); "
                                 f"see {out / 'torchrun.log'}")
            result = json.loads(result_file.read_text())
        else:
            result = run_reference(w, p.workers, p.threads_for(), str(result_file))
        return {"samples_per_s": result["samples_per_s"], "global_batch": batch * p.workers}


def points(cfg: BenchConfig) -> list[Point]:
    """The sweep's configurations: shoal's strategies, then the reference, per setting."""
    out = []
    for model in cfg.models:
        for scaling in cfg.scaling:
            for threads in cfg.threads:
                for workers in cfg.workers:
                    out += [Point(model, s, scaling, workers, threads) for s in cfg.strategies]
                    if cfg.reference:
                        out.append(Point(model, None, scaling, workers, threads))
    return out


def summarize(p: Point, results: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Median and range of a point's repeats."""
    thr = [r["samples_per_s"] for r in results]
    comm = [r["comm_fraction"] for r in results if "comm_fraction" in r]
    wait = [r["wait_fraction"] for r in results if "wait_fraction" in r]
    sent = [r["bytes_per_sample"] for r in results if "bytes_per_sample" in r]
    return {
        "model": p.model, "strategy": p.strategy_label, "scaling": p.scaling,
        "workers": p.workers, "threads": p.threads_for(),
        "threads_label": "auto" if p.threads is None else str(p.threads),
        "global_batch": int(results[0]["global_batch"]), "repeats": len(results),
        "samples_per_s": statistics.median(thr), "samples_per_s_min": min(thr),
        "samples_per_s_max": max(thr),
        "comm_fraction": statistics.median(comm) if comm else None,
        "wait_fraction": statistics.median(wait) if wait else None,
        "bytes_per_sample": statistics.median(sent) if sent else None,
        "runs": ";".join(f"{v:.1f}" for v in thr),
    }


def add_efficiency(rows: list[dict[str, Any]]) -> None:
    """Scaling efficiency: samples/s over (workers x the one-worker samples/s) of the same
    model, strategy, scaling and threads setting; ``None`` without a one-worker row."""
    base = {(r["model"], r["strategy"], r["scaling"], r["threads_label"]): r["samples_per_s"]
            for r in rows if r["workers"] == 1}
    for r in rows:
        one = base.get((r["model"], r["strategy"], r["scaling"], r["threads_label"]))
        r["efficiency"] = r["samples_per_s"] / (r["workers"] * one) if one else None


def _pct(v: float | None) -> str:
    return "" if v is None else f"{100 * v:.0f}%"


def _bytes(v: float | None) -> str:
    return "" if v is None else f"{v:,.0f}"


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The results as a markdown table (throughput median with the repeats' range)."""
    lines = ["| model | strategy | scaling | workers | threads/worker | global batch | "
             "samples/s (median) | range | efficiency | comm | wait | bytes/sample |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        eff = "" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
        lines.append(
            f"| {r['model']} | {r['strategy']} | {r['scaling']} | {r['workers']} | "
            f"{r['threads']} | {r['global_batch']} | {r['samples_per_s']:,.0f} | "
            f"{r['samples_per_s_min']:,.0f}–{r['samples_per_s_max']:,.0f} | {eff} | "
            f"{_pct(r['comm_fraction'])} | {_pct(r['wait_fraction'])} | "
            f"{_bytes(r.get('bytes_per_sample'))} |")
    return "\n".join(lines) + "\n"


def write_outputs(cfg: BenchConfig, rows: list[dict[str, Any]], command: str) -> dict[str, Path]:
    """``bench.csv``, ``bench.md`` and ``bench.png`` in ``cfg.out``."""
    from shoal.bench.plots import bench_figure

    cfg.out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": cfg.out / "bench.csv", "md": cfg.out / "bench.md", "png": cfg.out / "bench.png"}
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in CSV_FIELDS})
    import torch

    where = f"emulated hosts at {cfg.emulate_bandwidth} per link" if cfg.emulate_bandwidth \
        else "local worker processes"
    head = (f"# shoal bench\n\n`{command}`\n\n{len(os.sched_getaffinity(0))} CPU cores, {where}, "
            f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M %Z')}; {cfg.steps} "
            f"steps after {cfg.warmup} warm-up, median of {cfg.repeats}. Efficiency: samples/s "
            "over workers x one worker's samples/s. comm / wait: shares of rank 0's step time.\n\n")
    paths["md"].write_text(head + markdown_table(rows))
    title = f"{', '.join(cfg.models)}; {where}; median of {cfg.repeats}"
    bench_figure(rows, paths["png"], title)
    return paths


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
    from shoal.bench.plots import require_matplotlib

    cfg.validate()
    require_matplotlib()  # before minutes of running, not after
    todo = points(cfg)
    results: dict[Point, list[dict[str, float]]] = {p: [] for p in todo}
    n, total = 0, len(todo) * cfg.repeats
    from shoal.emulate import terminate_as_exception

    # SIGTERM too unwinds through the runner, which tears down any emulated cluster.
    with terminate_as_exception(), Runner(cfg) as runner:
        # Repeats in the outer loop: a drift in the machine's speed hits every point alike.
        for repeat in range(cfg.repeats):
            for p in todo:
                n += 1
                with _say(cfg.quiet, f"[{n}/{total}] {p.name(repeat)}"):
                    results[p].append(runner.run(p, repeat))
    rows = [summarize(p, results[p]) for p in todo]
    add_efficiency(rows)
    paths = write_outputs(cfg, rows, command)
    if not cfg.quiet:
        print("\n" + markdown_table(rows))
        print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return rows
