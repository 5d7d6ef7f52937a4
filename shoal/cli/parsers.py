"""The ``shoal`` command's parsers: one per subcommand, ``shoal train``'s (and ``shoal
plan``'s) flags made from :class:`~shoal.config.TrainConfig`'s fields and the strategies'
``Options`` (:func:`shoal.schema.add_flag`)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, NoReturn

from shoal.errors import ShoalError
from shoal.schema import add_flag, field_types, parse_ints, parse_names, parse_threads

#: Every subcommand and its line in ``shoal --help``.
COMMANDS = {
    "train": "train a model data-parallel",
    "plan": "find the fastest configuration to a target accuracy (Omnivore)",
    "run": "run your own script on N local processes (no torchrun)",
    "join": "add a worker to a running --elastic job",
    "bench": "scaling study: throughput, efficiency, communication share",
    "report": "plot and tabulate runs",
    "list": "list models, datasets and strategies",
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the problem (``main`` prints it after
    ``shoal: error:``), and a value that begins with ``-`` and a digit, a dot, ``inf`` or
    ``nan`` is a value (``--plan-budget -5m``, ``--lr -1e5``), which the flag's own check
    then names, not an unknown option."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d|\.\d|inf|nan)", re.IGNORECASE)

    def error(self, message: str) -> NoReturn:
        raise ShoalError(f"{message} (see {self.prog} --help)")


def _add_strategy_options(group: argparse._ArgumentGroup) -> None:
    """One flag per field of every registered strategy's options (``tau`` -> ``--tau``),
    noting the strategies that take it."""
    from shoal.strategies import STRATEGIES, option_fields

    users: dict[str, list[str]] = {}
    first: dict[str, tuple[Any, type]] = {}
    for cls in STRATEGIES.values():
        for f in option_fields(cls):
            users.setdefault(f.name, []).append(cls.name)
            first.setdefault(f.name, (f, cls.Options))
    for name, (f, options) in first.items():
        add_flag(group, f, field_types(options)[name], dest=f"opt_{name}", negatable=True,
                 note=f"[{', '.join(users[name])}]")


def _train_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help=COMMANDS["train"],
                       description="Train a model data-parallel on local workers or under "
                                   "torchrun / Slurm / mpirun. --strategy auto plans first "
                                   "(see shoal plan) and trains the winner.")
    return _add_train_flags(p)


def _plan_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan", help=COMMANDS["plan"],
        description="Measure candidate configurations of a training run in short trials "
                    "(strategy, groups or tau, momentum, learning rate, processes x threads), "
                    "predict each one's time to --target-accuracy and rank them; write "
                    "plan.json, plan.md and plan.png to --out. Takes shoal train's flags. "
                    "With --simulate, predict instead each strategy's throughput on clusters "
                    "that cannot be run here (a calibrated cost model; simulate.json).")
    _add_train_flags(p)
    _add_simulate_flags(p)
    return p


def _add_simulate_flags(parser: argparse.ArgumentParser) -> None:
    """``shoal plan``'s flags for ``--simulate`` (their ``dest`` start with ``sim_``)."""
    from shoal.plan.simulate import DEFAULT_STRATEGIES

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


def _add_train_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A flag per TrainConfig field, under the field's section heading."""
    from shoal.config import TrainConfig

    hints = field_types(TrainConfig)
    group: Any = p
    for f in dataclasses.fields(TrainConfig):
        if "section" in f.metadata:
            first, group = group is p, p.add_argument_group(f.metadata["section"])
            if first:
                group.add_argument("--config", default=argparse.SUPPRESS,
                                   help="YAML or JSON file of settings (flags override)")
        if f.name == "strategy_options":
            _add_strategy_options(group)
        elif f.metadata.get("flag", True):
            add_flag(group, f, hints[f.name])
    _add_secret_flag(p)
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show tracebacks of errors")
    return p


def _add_secret_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--secret-file", metavar="PATH", default=None,
                   help="a file only you can read holding the job's secret (hex), which seals "
                        "its store: the same for every rank (torchrun, srun, mpirun) and "
                        "shoal join; default: SHOAL_SECRET, else shoal's launcher makes one "
                        "(docs/launching.md#security)")


def _bench_parser(sub: Any) -> argparse.ArgumentParser:
    from shoal.config import TrainConfig
    from shoal.sweep.config import BenchConfig

    settings, hints = {f.name: f for f in dataclasses.fields(TrainConfig)}, field_types(TrainConfig)

    def setting(name: str, help: str | None = None) -> None:
        """``shoal train``'s flag ``name`` (its type, checks, help), with the sweep's default."""
        add_flag(p, settings[name], hints[name], default=getattr(BenchConfig, name), help=help)

    p = sub.add_parser(
        "bench", help=COMMANDS["bench"],
        description="Run `shoal train` for a fixed number of steps after warm-up for every "
                    "combination of models x strategies x workers (x threads per worker), plus "
                    "a hand-written PyTorch DDP loop, each repeated; write bench.csv, bench.md "
                    "and bench.png to --out.")
    p.add_argument("--models", type=parse_names, default=["lenet5"], metavar="M1,M2",
                   help="models to train (default lenet5)")
    p.add_argument("--strategies", default="sync", metavar="SPEC",
                   help="comma-separated strategies, each with its options: "
                        "sync,local-sgd:tau=4,easgd:tau=16,alpha=0.5 (default sync)")
    p.add_argument("--strategy-options", default="", metavar="K=V,...",
                   help="options for every strategy that takes them, e.g. tau=4")
    p.add_argument("--workers", type=parse_ints, default=[1, 2], metavar="N1,N2",
                   help="worker counts (default 1,2)")
    p.add_argument("--threads-per-worker", type=parse_threads, default=[None], metavar="T1,T2",
                   help="intra-op threads per worker; auto = cores // workers (default auto)")
    p.add_argument("--scaling", default="weak,strong", metavar="weak,strong",
                   help="weak: --batch-size per worker; strong: the global batch fixed "
                        "(default both)")
    setting("batch_size", "per worker, for weak scaling")
    setting("global_batch_size", "for strong scaling (default: --batch-size x the most workers)")
    p.add_argument("--steps", type=int, default=40, help="timed steps (default 40)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    p.add_argument("--repeats", type=int, default=3, help="runs per point (default 3)")
    setting("dataset")
    setting("synthetic_shape")
    setting("lr")
    setting("momentum", "SGD momentum of every run and of the reference (default 0.9; 0 for "
                        "the EASGD paper's plain local steps)")
    setting("schedule")
    _add_race_flags(p)
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="leave out the hand-written DDP loop")
    _add_emulation_flags(p)
    p.add_argument("--run-timeout", type=float, default=900.0,
                   help="seconds one training run may take before it is stopped (default 900)")
    p.add_argument("--out", default="runs/bench", help="output directory (default runs/bench)")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    return p


def _add_race_flags(p: argparse.ArgumentParser) -> None:
    """``shoal bench``'s race: time to accuracy instead of throughput."""
    race = p.add_argument_group(
        "a race: time to accuracy instead of throughput",
        "With --epochs, every point trains that many epochs on --dataset (digits works), "
        "tested after each epoch; the table gives the time to --target-accuracy, the test "
        "accuracy at --budget seconds, and the speed-up over the first strategy. A strategy "
        "may set its own run settings: async-sgd:momentum=0.")
    race.add_argument("--epochs", type=int, default=None, metavar="E",
                      help="race: epochs each point trains")
    race.add_argument("--target-accuracy", type=float, default=None, metavar="A",
                      help="race: the test accuracy to reach, in (0, 1], e.g. 0.95")
    race.add_argument("--budget", type=float, default=None, metavar="S",
                      help="race: compare test accuracy after S seconds of training (default: "
                           "when the quickest point finished)")
    race.add_argument("--eval-every-steps", type=int, default=None, metavar="STEPS",
                      help="race: also test every STEPS global batches' samples, every "
                           "strategy alike (an asynchronous run: its center, at the workers' "
                           "samples summed, not at the slowest worker's epochs)")


def _add_emulation_flags(p: argparse.ArgumentParser) -> None:
    """``shoal bench``'s emulated cluster: the link, slow hosts, a host's own link."""
    p.add_argument("--emulate-bandwidth", default=None, metavar="RATE",
                   help="run multi-worker points across emulated hosts (network namespaces, "
                        "needs root) joined by links of RATE, e.g. 100mbit or 1gbit")
    p.add_argument("--emulate-slow", default=None, metavar="HOST:FRACTION[,...]",
                   help="with --emulate-bandwidth: hold a host's processes to a fraction of one "
                        "core (1:0.25: host 1 at a quarter of a core; a cgroup, needs root)")
    p.add_argument("--emulate-link-rate", default=None, metavar="HOST:RATE[,...]",
                   help="with --emulate-bandwidth: a host's own link rate (1:10mbit)")


def _report_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "report", help=COMMANDS["report"],
        description="Plot loss and accuracy of runs against wall time and samples seen "
                    "(report.png) and tabulate their summary.json (report.md).")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="directories of shoal train runs")
    p.add_argument("--out", default="runs/report", help="output directory (default runs/report)")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    return p


def _join_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "join", help=COMMANDS["join"],
        description="Start a new worker that joins the --elastic job running in OUT (its "
                    "--out) at its next step or round: it takes the model and every other "
                    "state from a live worker and trains the rest with the others until the "
                    "job ends (docs/elastic.md).")
    p.add_argument("out", metavar="OUT", nargs="?", default=None,
                   help="the running job's output directory")
    p.add_argument("--store", metavar="HOST:PORT", default=None,
                   help="instead of OUT: the store of a torchrun, srun or mpirun job, as its "
                        "rank 0 prints it (a "
                        "host that does not see OUT; the secret in SHOAL_SECRET or "
                        "--secret-file)")
    _add_secret_flag(p)
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show tracebacks of errors")
    return p


def _run_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "run", help=COMMANDS["run"],
        usage="shoal run [-h] [--workers N] [--threads-per-worker T] [--debug] "
              "(SCRIPT | -m MODULE) [ARGS ...]",
        description="Run SCRIPT (or -m MODULE) as __main__ in N local processes joined as one "
                    "job, as torchrun would: inside, shoal.init() and shoal.strategy(...) join "
                    "it. Everything after SCRIPT goes to the script. When a rank fails, all "
                    "stop and its error is printed as one line.")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="processes to start (default 1)")
    p.add_argument("--threads-per-worker", type=int, default=None, metavar="T",
                   help="intra-op threads per worker (default: cores // workers)")
    p.add_argument("-m", dest="module", action="store_true",
                   help="the target is a module, run as `python -m MODULE` would")
    _add_secret_flag(p)
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show tracebacks of errors")
    # REMAINDER: the script's own flags (even --workers or --debug) are the script's.
    p.add_argument("target", nargs=argparse.REMAINDER, metavar="SCRIPT | MODULE [ARGS ...]")
    return p


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``shoal`` parser; with ``command``, only that subcommand's flags (the others
    listed by name): the train and plan flags import every strategy, and torch with them
    (2 s), which ``--version``, ``--help`` or ``shoal join`` need not wait for."""
    parser = _Parser(prog="shoal", description="Data-parallel training on PyTorch.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    from shoal import __version__

    parser.add_argument("--version", action="version", version=f"shoal {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    builders = {"train": _train_parser, "plan": _plan_parser, "run": _run_parser,
                "join": _join_parser, "bench": _bench_parser, "report": _report_parser}
    for name, help in COMMANDS.items():
        if name in builders and command in (None, name):
            builders[name](sub)
        else:
            sub.add_parser(name, help=help)
    return parser


def command_of(argv: list[str]) -> str:
    """The subcommand ``argv`` names (its first word that is not a flag); ``""`` for none."""
    return next((a for a in argv if not a.startswith("-")), "")
