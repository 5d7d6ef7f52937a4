"""What one ``shoal bench`` sweep runs: its settings (:class:`BenchConfig`) and its points."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from shoal.core.env import default_threads
from shoal.core.limits import check_processes, check_threads
from shoal.errors import ShoalError
from shoal.schema import MAX_DURATION_S
from shoal.sweep.spec import REFERENCE, StrategySpec

SCALINGS = ("weak", "strong")


@dataclass
class BenchConfig:
    """One sweep, as ``shoal bench``'s flags give it (``workers``: the ``--workers`` list of
    world sizes). ``batch_size`` is per worker for weak scaling; strong scaling keeps the
    global batch at ``global_batch_size`` (default: ``batch_size`` x the largest world size)."""

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
    #: Uneven emulated hosts: host -> fraction of one core (``--emulate-slow``), host -> its
    #: own link rate (``--emulate-link-rate``).
    emulate_slow: dict[int, float] = field(default_factory=dict)
    emulate_link_rate: dict[int, str] = field(default_factory=dict)
    out: Path = Path("runs/bench")
    lr: float = 0.02
    momentum: float = 0.9
    run_timeout: float = 900.0  # seconds one training run may take
    quiet: bool = False
    schedule: str = "constant"
    #: A race (time to accuracy) instead of a throughput sweep: every point trains this many
    #: epochs, tested after each; measured: time to ``target_accuracy``, test accuracy at
    #: ``budget`` seconds (default: when the quickest point finished), final accuracy.
    epochs: int | None = None
    target_accuracy: float | None = None
    budget: float | None = None
    #: A race also tests every this many global batches' samples (every strategy alike).
    eval_every_steps: int | None = None

    @property
    def race(self) -> bool:
        """Whether the sweep measures time to accuracy (``--epochs``) rather than throughput."""
        return self.epochs is not None

    def validate(self) -> BenchConfig:
        for name in ("batch_size", "steps", "warmup", "repeats"):
            value = getattr(self, name)
            if value < 1:
                raise ShoalError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if not 0 < self.run_timeout <= MAX_DURATION_S:  # a wait of the runner's: bounded
            raise ShoalError(f"--run-timeout must be a positive number of seconds, at most a "
                             f"week ({MAX_DURATION_S:.0f}), got {self.run_timeout:g}")
        if not self.workers or any(w < 1 for w in self.workers):
            raise ShoalError(f"--workers must be positive numbers, got {self.workers}")
        if any(t is not None and t < 1 for t in self.threads):
            raise ShoalError(f"--threads-per-worker must be positive or auto, got {self.threads}")
        for t in self.threads:
            check_threads("--threads-per-worker", t)
        if self.emulate_bandwidth is None:  # emulated hosts: the cluster checks its own
            check_processes(f"--workers {max(self.workers)}", max(self.workers))
        bad = [s for s in self.scaling if s not in SCALINGS]
        if bad or not self.scaling:
            raise ShoalError(f"--scaling must be weak, strong or both, got {','.join(self.scaling)}")
        if not self.models:
            raise ShoalError("--models is empty")
        self._validate_race()
        self._validate_emulated()
        if "strong" in self.scaling:
            g = self.strong_global_batch()
            for world_size in self.workers:
                if g % world_size:
                    raise ShoalError(f"strong scaling: the global batch {g} does not divide "
                                     f"among {world_size} workers; set --global-batch-size")
        return self

    def _validate_emulated(self) -> None:
        uneven = [flag for flag, given in (("--emulate-slow", self.emulate_slow),
                                           ("--emulate-link-rate", self.emulate_link_rate)) if given]
        if self.emulate_bandwidth is None:
            if uneven:
                raise ShoalError(f"{uneven[0]} sets a host of the emulated cluster: give "
                                 "--emulate-bandwidth too")
            return
        from shoal.core.cpulimit import can_throttle
        from shoal.core.hostspec import rate_bits
        from shoal.emulate import Cluster, can_emulate

        rate_bits(self.emulate_bandwidth)
        for spec in self.strategies:
            if spec.topology(1).shared_memory:
                raise ShoalError(f"--emulate-bandwidth: {spec.name} shares memory on one "
                                 "host; sweep it without --emulate-bandwidth")
        for p in points(self):  # the hosts named exist in every emulated point's cluster
            if p.world_size > 1:
                try:
                    Cluster(p.processes, self.emulate_bandwidth, self.emulate_slow,
                            self.emulate_link_rate)
                except ShoalError as exc:
                    raise ShoalError(f"{exc} for {p.strategy_label} with {p.world_size} "
                                     "workers") from None
        why = can_emulate() or (can_throttle() if self.emulate_slow else None)
        if why is not None:
            raise ShoalError(f"--emulate-bandwidth: cannot emulate a cluster here: {why}")

    def hosts_label(self, p: Point) -> str:
        """Who runs on each emulated host of point ``p`` and how fast: its share of a core
        (``full``: unthrottled) and its link where it is not ``--emulate-bandwidth``'s."""
        if self.emulate_bandwidth is None or p.world_size == 1:
            return "local"
        hosts = []
        for i in range(p.processes):
            role = f"s{i}" if i < p.servers else f"w{i - p.servers}"
            speed = f"{self.emulate_slow[i]:g} core" if i in self.emulate_slow else "full"
            link = f" @{self.emulate_link_rate[i]}" if i in self.emulate_link_rate else ""
            hosts.append(f"{role} {speed}{link}")
        return ", ".join(hosts)

    def _validate_race(self) -> None:
        if self.epochs is not None and self.epochs < 1:
            raise ShoalError(f"--epochs must be at least 1, got {self.epochs}")
        for name, value in (("target_accuracy", self.target_accuracy), ("budget", self.budget),
                            ("eval_every_steps", self.eval_every_steps)):
            if value is not None and not self.race:
                raise ShoalError(f"--{name.replace('_', '-')} measures a race: give --epochs too")
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ShoalError(f"--target-accuracy must be in (0, 1], got {self.target_accuracy}")
        if self.eval_every_steps is not None and self.eval_every_steps < 1:
            raise ShoalError(f"--eval-every-steps must be at least 1, got {self.eval_every_steps}")
        if self.budget is not None and not self.budget > 0:
            raise ShoalError(f"--budget must be a positive number of seconds, got {self.budget}")

    def strong_global_batch(self) -> int:
        return self.global_batch_size or self.batch_size * max(self.workers)

    def per_worker_batch(self, scaling: str, world_size: int) -> int:
        return self.batch_size if scaling == "weak" else self.strong_global_batch() // world_size


@dataclass(frozen=True)
class Point:
    """One configuration of the sweep."""

    model: str
    strategy: StrategySpec | None  # None: the DDP reference loop
    scaling: str
    world_size: int
    threads: int | None

    @property
    def strategy_label(self) -> str:
        return self.strategy.label if self.strategy is not None else REFERENCE

    def threads_for(self) -> int:
        return self.threads or default_threads(self.world_size)

    @property
    def servers(self) -> int:
        """Parameter-server processes beside the workers (an asynchronous strategy's)."""
        return 0 if self.strategy is None else self.strategy.topology(self.world_size).servers

    @property
    def processes(self) -> int:
        """Processes of the run, servers included; on an emulated cluster each has a host
        of its own (a parameter server behind its own link, as on a real cluster)."""
        return self.world_size + self.servers

    def name(self, repeat: int) -> str:
        label = self.strategy_label.replace(":", "_").replace(",", "_").replace("=", "")
        return (f"{self.model}-{label}-{self.scaling}-w{self.world_size}-t{self.threads_for()}"
                f"-r{repeat}")


def points(cfg: BenchConfig) -> list[Point]:
    """The sweep's configurations: shoal's strategies, then the reference, per setting."""
    out = []
    for model in cfg.models:
        for scaling in cfg.scaling:
            for threads in cfg.threads:
                for world_size in cfg.workers:
                    out += [Point(model, s, scaling, world_size, threads) for s in cfg.strategies]
                    if cfg.reference and not cfg.race:  # the reference loop does not test
                        out.append(Point(model, None, scaling, world_size, threads))
    return out
