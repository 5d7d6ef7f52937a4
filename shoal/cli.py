"""The ``shoal`` command: ``shoal train``, ``shoal run``, ``shoal bench``, ``shoal report``,
``shoal list``.

Errors a user can fix print one line (``shoal: error: ...``) and exit with status 2; with
``--debug`` the traceback follows. Unexpected errors exit with status 1.

``shoal train``'s flags are made from :class:`~shoal.config.TrainConfig`'s fields and the
strategies' ``Options`` (:func:`shoal.schema.add_flag`). The file is about 400 lines because
it holds every subcommand's parser and hand-off, and the merging of a ``--config`` file with
the flags: each short, and read best next to :func:`main`, which maps errors to exit codes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from shoal.errors import ShoalError, Terminated, WorkerError
from shoal.schema import (
    add_flag,
    check_value,
    field_kind,
    field_types,
    flag_name,
    parse_ints,
    parse_names,
    parse_threads,
    show_value,
)

EXIT_USER_ERROR = 2
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130
#: ``shoal train`` stopped by SIGTERM (Slurm's preemption notice) after writing a checkpoint.
EXIT_TERMINATED = 143
#: An asynchronous run that completed without some of its workers (see shoal.train.server).
EXIT_DEGRADED = 3


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the problem."""

    def error(self, message: str) -> NoReturn:
        raise ShoalError(f"{self.prog}: {message} (see {self.prog} --help)")


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
    p = sub.add_parser("train", help="train a model data-parallel",
                       description="Train a model data-parallel on local workers or under "
                                   "torchrun / Slurm / mpirun. --strategy auto plans first "
                                   "(see shoal plan) and trains the winner.")
    return _add_train_flags(p)


def _plan_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan", help="find the fastest configuration to a target accuracy (Omnivore)",
        description="Measure candidate configurations of a training run in short trials "
                    "(strategy, groups or tau, momentum, learning rate, processes x threads), "
                    "predict each one's time to --target-accuracy and rank them; write "
                    "plan.json, plan.md and plan.png to --out. Takes shoal train's flags. "
                    "With --simulate, predict instead each strategy's throughput on clusters "
                    "that cannot be run here (a calibrated cost model; simulate.json).")
    from shoal.plan.model import add_simulate_flags

    _add_train_flags(p)
    add_simulate_flags(p)
    return p


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
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show tracebacks of errors")
    return p


def _bench_parser(sub: Any) -> argparse.ArgumentParser:
    from shoal.config import TrainConfig
    from shoal.sweep.config import BenchConfig

    settings, hints = {f.name: f for f in dataclasses.fields(TrainConfig)}, field_types(TrainConfig)

    def setting(name: str, help: str | None = None) -> None:
        """``shoal train``'s flag ``name`` (its type, checks, help), with the sweep's default."""
        add_flag(p, settings[name], hints[name], default=getattr(BenchConfig, name), help=help)

    p = sub.add_parser(
        "bench", help="scaling study: throughput, efficiency, communication share",
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
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="leave out the hand-written DDP loop")
    p.add_argument("--emulate-bandwidth", default=None, metavar="RATE",
                   help="run multi-worker points across emulated hosts (network namespaces, "
                        "needs root) joined by links of RATE, e.g. 100mbit or 1gbit")
    p.add_argument("--run-timeout", type=float, default=900.0,
                   help="seconds one training run may take before it is stopped (default 900)")
    p.add_argument("--out", default="runs/bench", help="output directory (default runs/bench)")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    return p


def _report_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "report", help="plot and tabulate runs",
        description="Plot loss and accuracy of runs against wall time and samples seen "
                    "(report.png) and tabulate their summary.json (report.md).")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="directories of shoal train runs")
    p.add_argument("--out", default="runs/report", help="output directory (default runs/report)")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    return p


def _run_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "run", help="run your own script on N local processes (no torchrun)",
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
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show tracebacks of errors")
    # REMAINDER: the script's own flags (even --workers or --debug) are the script's.
    p.add_argument("target", nargs=argparse.REMAINDER, metavar="SCRIPT | MODULE [ARGS ...]")
    return p


def _run(args: argparse.Namespace) -> None:
    import importlib.util
    import os

    from shoal.core.limits import check_threads
    from shoal.runtime import launch, run_main

    if not args.target:
        raise ShoalError("shoal run: give a SCRIPT or -m MODULE to run (see shoal run --help)")
    target, script_args = args.target[0], args.target[1:]
    if args.workers < 1:
        raise ShoalError(f"shoal run: --workers must be at least 1, got {args.workers}")
    if args.threads_per_worker is not None and args.threads_per_worker < 1:
        raise ShoalError("shoal run: --threads-per-worker must be at least 1, "
                         f"got {args.threads_per_worker}")
    check_threads("shoal run: --threads-per-worker", args.threads_per_worker)
    if args.module:
        sys.path.insert(0, os.getcwd())  # where `python -m` looks first, as the workers will
        try:
            found = importlib.util.find_spec(target) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.pop(0)
        if not found:
            raise ShoalError(f"shoal run: no module named {target!r}")
    elif not os.path.isfile(target):
        raise ShoalError(f"shoal run: no such file: {target}")
    launch(run_main, target, script_args, module=args.module, threads=args.threads_per_worker,
           workers=args.workers)


def _bench(args: argparse.Namespace, argv: Sequence[str]) -> None:
    from pathlib import Path

    from shoal.sweep.config import BenchConfig
    from shoal.sweep.runner import run_bench
    from shoal.sweep.spec import parse_strategies

    cfg = BenchConfig(
        models=args.models, strategies=parse_strategies(args.strategies, args.strategy_options),
        workers=args.workers, threads=args.threads_per_worker, scaling=parse_names(args.scaling),
        batch_size=args.batch_size, global_batch_size=args.global_batch_size,
        steps=args.steps, warmup=args.warmup, repeats=args.repeats, dataset=args.dataset,
        synthetic_shape=tuple(args.synthetic_shape), reference=args.reference,
        emulate_bandwidth=args.emulate_bandwidth, out=Path(args.out), lr=args.lr,
        momentum=args.momentum, schedule=args.schedule, epochs=args.epochs,
        target_accuracy=args.target_accuracy, budget=args.budget,
        run_timeout=args.run_timeout, quiet=args.quiet)
    if cfg.reference and not cfg.race and cfg.dataset != "synthetic":
        raise ShoalError("the DDP reference row trains on synthetic data; use --dataset "
                         "synthetic or --no-reference")
    run_bench(cfg, "shoal " + " ".join(argv))


def _plan(args: argparse.Namespace) -> int:
    from shoal.plan.model import run_simulate, simulate_keys

    simulation = simulate_keys(args)
    if simulation.pop("sim_simulate", False):
        return run_simulate(config_from_args(args), simulation)
    if simulation:
        flags = ", ".join("--" + k[4:].replace("_", "-") for k in sorted(simulation))
        raise ShoalError(f"shoal plan: {flags} belong(s) to --simulate; add --simulate")
    from shoal.plan import plan

    found = plan(config_from_args(args))
    print(found.files["md"].read_text())
    print(f"wrote {', '.join(str(p) for p in found.files.values())}")
    return 0


def _report(args: argparse.Namespace) -> None:
    from pathlib import Path

    from shoal.report import report

    files = report([Path(r) for r in args.runs], Path(args.out))
    print(files["md"].read_text())
    print(f"wrote {files['png']} and {files['md']}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shoal", description="Data-parallel training on PyTorch.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    from shoal import __version__

    parser.add_argument("--version", action="version", version=f"shoal {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _train_parser(sub)
    _plan_parser(sub)
    _run_parser(sub)
    _bench_parser(sub)
    _report_parser(sub)
    sub.add_parser("list", help="list models, datasets and strategies")
    return parser


def config_from_args(args: argparse.Namespace) -> Any:
    """Merge defaults, ``--config`` file and flags into a validated TrainConfig.

    A config file's values are checked as the flags are, strategy options by the chosen
    strategy's ``Options``; an error about a value from the file names the file and the key.
    """
    from shoal.config import TrainConfig
    from shoal.strategies import get_strategy, make_options

    values: dict[str, Any] = {}
    options: dict[str, Any] = {}
    given = vars(args)
    source, from_file = "", set()
    if "config" in given:
        source = f"config file {given['config']}"
        values, options = _config_file(given["config"], given)
        from_file = set(values) | set(options)
    for key, value in given.items():
        if key.startswith("opt_"):
            options[key[4:]] = value
            from_file.discard(key[4:])
        elif key not in ("command", "config", "debug"):
            values[key] = value
            from_file.discard(key)
    values["strategy_options"] = options
    try:
        cfg = TrainConfig.from_dict(values).validate()
        if from_file & set(options):  # the flags' are checked before workers start
            make_options(get_strategy(cfg.strategy), cfg.strategy_options, cfg.workers)
    except ShoalError as exc:
        raise _blame(exc, source, from_file) from exc
    return cfg


def _blame(exc: ShoalError, source: str, keys: set[str]) -> ShoalError:
    """``exc``, naming ``source`` and the key when it is about a value of one of ``keys``
    (``--seed must be ...`` -> ``config file run.yaml: seed must be ...``)."""
    message = str(exc)
    for key in sorted(keys):
        flag = flag_name(key)
        if message.startswith(flag + " "):
            return ShoalError(f"{source}: {key}{message[len(flag):]}")
    return exc


def _config_file(path: str, flags: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ``--config`` file's settings and strategy options, each value type-checked."""
    from shoal.config import TrainConfig, load_config_file
    from shoal.strategies import STRATEGIES, get_strategy, option_fields

    source = f"config file {path}"
    values = load_config_file(path)
    options = values.pop("strategy_options", None)
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise ShoalError(f"{source}: strategy_options must be a mapping of options, "
                         f"got {show_value(options)}")
    options = {str(k).replace("-", "_"): v for k, v in options.items()}
    # A file may give strategy options at the top level, as the flags do.
    option_names = {f.name for cls in STRATEGIES.values() for f in option_fields(cls)}
    for key in [k for k in values if k in option_names]:
        options[key] = values.pop(key)
    TrainConfig.from_dict(values, source)  # unknown keys, types of the settings
    # The options' types, by the strategy that will take them (a flag may choose it).
    from_file = {k: v for k, v in options.items() if f"opt_{k}" not in flags}
    if from_file:
        strategy = flags.get("strategy", values.get("strategy", TrainConfig.strategy))
        hints = field_types(get_strategy(strategy).Options)
        for key, value in from_file.items():
            if key in hints:  # the ranges: make_options, then naming the file
                check_value(value, hints[key], f"{source}: {key}", bounds=False,
                            kind=field_kind(get_strategy(strategy).Options, key))
    return values, options


def _list() -> None:
    from shoal.data import dataset_names
    from shoal.models import MODELS
    from shoal.strategies import STRATEGIES

    print("models:     " + ", ".join(sorted(MODELS)))
    print("datasets:   " + ", ".join(dataset_names()))
    print("strategies:")
    for name, cls in sorted(STRATEGIES.items()):
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        print(f"  {name:<12} {doc}")


def _stopped_by_sigterm(summary: dict[str, Any] | None) -> bool:
    """Say how to go on when SIGTERM stopped the run (rank 0 has the summary, others only
    the request) and whether it did."""
    from shoal.core.processes import stop_requested

    if summary is not None and summary.get("stopped_by") == "SIGTERM":
        print(f"shoal: stopped by SIGTERM at step {summary['steps']}; the checkpoint is saved, "
              "continue with the same command and --resume", file=sys.stderr, flush=True)
        return True
    return summary is None and stop_requested()


def _where() -> str:
    """``rank N: `` when this process is one rank of a job started by an outside launcher."""
    import os

    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK")
    return f"rank {rank}: " if rank is not None and world.isdigit() and int(world) > 1 else ""


def _one_line(message: str) -> str:
    """``message`` on one line: a path or value holding a line break is shown escaped."""
    return message.strip().replace("\r", "\\r").replace("\n", "\\n")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # until parsed: `shoal run x.py --debug` is the script's flag
    try:
        args = build_parser().parse_args(argv)
        debug = bool(getattr(args, "debug", False))
        if args.command == "train":
            cfg = config_from_args(args)
            if cfg.strategy == "auto":
                from shoal.plan import plan_and_train

                summary = plan_and_train(cfg)
            else:
                from shoal.train import train

                summary = train(cfg)
            if _stopped_by_sigterm(summary):
                return EXIT_TERMINATED
            if summary is not None and summary.get("degraded"):
                for lost in summary["lost_workers"]:
                    print(f"shoal: completed without worker {lost['worker']} (lost at step "
                          f"{lost['step']}, {lost.get('exit_status') or lost['error']}); "
                          f"{lost['samples_not_trained']} samples of its shard were not "
                          "trained on", file=sys.stderr)
                return EXIT_DEGRADED
        elif args.command == "plan":
            status = _plan(args)
            if status:
                return status
        elif args.command == "run":
            _run(args)
        elif args.command == "bench":
            _bench(args, argv)
        elif args.command == "report":
            _report(args)
        elif args.command == "list":
            _list()
        else:
            build_parser().print_help()
            return EXIT_USER_ERROR
        return 0
    except KeyboardInterrupt:
        print("shoal: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return EXIT_TERMINATED
    except ShoalError as exc:
        where = _where() if not isinstance(exc, WorkerError) else ""
        if debug:
            traceback.print_exc()
            if isinstance(exc, WorkerError) and exc.traceback:
                print(f"--- traceback on rank {exc.rank} ---\n{exc.traceback}", file=sys.stderr)
        if not exc.user_error:  # a worker's crash, a failed job: not the user's input
            hint = "" if debug or not isinstance(exc, WorkerError) else \
                " (run with --debug for the traceback)"
            print(f"shoal: error: {where}{_one_line(str(exc))}{hint}", file=sys.stderr)
            return EXIT_FAILURE
        print(f"shoal: error: {where}{_one_line(str(exc))}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Exception as exc:
        if debug:
            traceback.print_exc()
        first = (str(exc).strip().splitlines() or [""])[0]
        hint = "" if debug else " (run with --debug for the traceback)"
        print(f"shoal: error: {_where()}{type(exc).__name__}: {first}{hint}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
