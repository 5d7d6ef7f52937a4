"""The ``shoal`` command: ``shoal train``, ``shoal plan``, ``shoal run``, ``shoal join``,
``shoal bench``, ``shoal report``, ``shoal list``: each subcommand's hand-off, and :func:`main`, which maps
errors to exit codes.

Errors a user can fix print one line (``shoal: error: ...``, the one prefix whatever the
subcommand) and exit with status 2; with ``--debug`` the traceback follows. Unexpected
errors exit with status 1. The parsers are in :mod:`shoal.cli.parsers`, the merging of a
``--config`` file with the flags in :mod:`shoal.cli.settings`.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from shoal.cli.early import (
    adopt_job_processes,
    end_job_processes,
    quiet_native_warnings,
    run_forked,
    runs_a_job,
    start_server_early,
    stop_server,
)
from shoal.cli.parsers import build_parser, command_of
from shoal.cli.settings import config_from_args
from shoal.core.guard import skip_exit_collection
from shoal.core.logs import install as install_logging
from shoal.core.secret import use_secret_file
from shoal.errors import ShoalError, Terminated, WorkerError
from shoal.schema import parse_names

EXIT_USER_ERROR = 2
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130
#: ``shoal train`` stopped by SIGTERM (Slurm's preemption notice) after writing a checkpoint.
EXIT_TERMINATED = 143
#: An asynchronous run that completed without some of its workers (see shoal.train.server).
EXIT_DEGRADED = 3
#: A run that collapsed to chance or learned nothing (see shoal.train.health), unless
#: --allow-collapse.
EXIT_COLLAPSED = 4


def _run(args: argparse.Namespace) -> None:
    import importlib.util
    import os

    from shoal.core.limits import check_threads
    from shoal.runtime import launch, run_main

    if not args.target:
        raise ShoalError("give a SCRIPT or -m MODULE to run (see shoal run --help)")
    target, script_args = args.target[0], args.target[1:]
    if args.workers < 1:
        raise ShoalError(f"--workers must be at least 1, got {args.workers}")
    if args.threads_per_worker is not None and args.threads_per_worker < 1:
        raise ShoalError(f"--threads-per-worker must be at least 1, got {args.threads_per_worker}")
    check_threads("--threads-per-worker", args.threads_per_worker)
    if args.module:
        sys.path.insert(0, os.getcwd())  # where `python -m` looks first, as the workers will
        try:
            found = importlib.util.find_spec(target) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.pop(0)
        if not found:
            raise ShoalError(f"no module named {target!r}")
    elif not os.path.isfile(target):
        raise ShoalError(f"no such file: {target}")
    launch(run_main, target, script_args, module=args.module, threads=args.threads_per_worker,
           workers=args.workers)


def _bench(args: argparse.Namespace, argv: Sequence[str]) -> None:
    from pathlib import Path

    from shoal.core.hostspec import link_rates, slow_hosts
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
        emulate_slow=slow_hosts(args.emulate_slow) if args.emulate_slow else {},
        emulate_link_rate=(link_rates(args.emulate_link_rate, "--emulate-link-rate")
                           if args.emulate_link_rate else {}),
        momentum=args.momentum, schedule=args.schedule, epochs=args.epochs,
        target_accuracy=args.target_accuracy, budget=args.budget,
        eval_every_steps=args.eval_every_steps, run_timeout=args.run_timeout, quiet=args.quiet)
    if cfg.reference and not cfg.race and cfg.dataset != "synthetic":
        raise ShoalError("the DDP reference row trains on synthetic data; use --dataset "
                         "synthetic or --no-reference")
    run_bench(cfg, "shoal " + " ".join(argv))


def _simulate_keys(args: argparse.Namespace) -> dict[str, Any]:
    """Take the ``--simulate`` flags out of ``args`` (so the rest are ``shoal train``'s)."""
    found = {k: v for k, v in vars(args).items() if k.startswith("sim_")}
    for k in found:
        delattr(args, k)
    return found


def _plan(args: argparse.Namespace) -> int:
    from shoal.plan.simulate import run_simulate

    simulation = _simulate_keys(args)
    if simulation.pop("sim_simulate", False):
        return run_simulate(config_from_args(args), simulation)
    if simulation:
        flags = ", ".join("--" + k[4:].replace("_", "-") for k in sorted(simulation))
        raise ShoalError(f"{flags} belong(s) to --simulate; add --simulate")
    from shoal.plan import plan

    found = plan(config_from_args(args))
    print(found.files["md"].read_text())
    print(f"wrote {', '.join(str(p) for p in found.files.values())}")
    if found.winner is None:
        raise ShoalError(f"planning found no configuration that trains: see {found.files['md']}")
    return 0


def _report(args: argparse.Namespace) -> None:
    from pathlib import Path

    from shoal.report import report

    files = report([Path(r) for r in args.runs], Path(args.out))
    print(files["md"].read_text())
    print(f"wrote {files['png']} and {files['md']}")


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
    from shoal.core.stop import stop_requested

    if summary is not None and summary.get("stopped_by") == "SIGTERM":
        go_on = "continue with the same command and --resume"
        if _changed_compute_groups(summary):
            go_on = ("an --elastic run of compute groups that lost or gained workers does not "
                     "resume yet: start from it with --init-from")
        print(f"shoal: stopped by SIGTERM at step {summary['steps']}; the checkpoint is saved, "
              f"{go_on}", file=sys.stderr, flush=True)
        return True
    return summary is None and stop_requested()


def _changed_compute_groups(summary: dict[str, Any]) -> bool:
    """Whether ``summary`` is of a run of compute groups of several workers whose
    membership changed (its checkpoint does not resume yet)."""
    changes = summary.get("membership_changes") or []
    if summary.get("strategy") != "groups" or not changes:
        return False
    started = summary["workers"] + sum(len(c.get("left", [])) - len(c.get("joined", []))
                                       for c in changes)
    return int((summary.get("strategy_options") or {}).get("groups", 1)) < started


def _where() -> str:
    """``rank N: `` when this process is one rank of a job started by an outside launcher."""
    import os

    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK")
    return f"rank {rank}: " if rank is not None and world.isdigit() and int(world) > 1 else ""


def _one_line(message: str) -> str:
    """``message`` on one line: a path or value holding a line break is shown escaped."""
    return message.strip().replace("\r", "\\r").replace("\n", "\\n")


def _train(args: argparse.Namespace) -> int:
    """``shoal train`` (planning first with ``--strategy auto``); its exit status."""
    cfg = config_from_args(args)
    if cfg.strategy == "auto":
        from shoal.plan import plan_and_train

        summary = plan_and_train(cfg)
    else:
        from shoal.train import train

        summary = train(cfg)
    if _stopped_by_sigterm(summary):
        return EXIT_TERMINATED
    from shoal.train.stopping import COLLAPSED  # torch is loaded by now, not before the checks

    if summary is not None and not cfg.allow_collapse and (
            summary.get("collapsed") or summary.get("stopped_by") == COLLAPSED):
        return EXIT_COLLAPSED  # its line replaced done: (shoal.train.health)
    if summary is not None and summary.get("degraded"):
        for lost in summary["lost_workers"]:
            print(f"shoal: completed without worker {lost['worker']} (lost at step "
                  f"{lost['step']}, {lost.get('exit_status') or lost['error']}); "
                  f"{lost['samples_not_trained']} samples of its shard were not "
                  "trained on", file=sys.stderr)
        return EXIT_DEGRADED
    return 0


def _error(exc: ShoalError, debug: bool) -> int:
    """Print ``exc`` as the one line ``shoal: error: ...`` (with ``--debug``, the traceback
    before it); its exit status. A worker's crash suggests ``--debug`` only where the
    worker left a traceback (not one killed by a signal)."""
    worker = isinstance(exc, WorkerError)
    if debug:
        traceback.print_exc()
        if worker and exc.traceback:
            print(f"--- traceback on rank {exc.rank} ---\n{exc.traceback}", file=sys.stderr)
    if not exc.user_error:  # a worker's crash, a failed job: not the user's input
        hint = "" if debug or not (worker and exc.traceback) else \
            " (run with --debug for the traceback)"
        print(f"shoal: error: {'' if worker else _where()}{_one_line(str(exc))}{hint}",
              file=sys.stderr)
        return EXIT_FAILURE
    print(f"shoal: error: {'' if worker else _where()}{_one_line(str(exc))}", file=sys.stderr)
    return EXIT_USER_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    """The ``shoal`` command on ``argv`` (this process's own arguments where ``None``); its
    exit status."""
    own = argv is None  # the process is this command's (not a caller's who passes argv)
    if own:
        skip_exit_collection()
    argv = list(sys.argv[1:] if argv is None else argv)
    job = own and runs_a_job(argv)
    if job:
        adopt_job_processes()
        quiet_native_warnings(argv)
    early = own and start_server_early(argv)
    try:
        code = run_forked(argv) if early else None
        return _main(argv) if code is None else code
    finally:
        if early:
            stop_server()
        if job:
            end_job_processes()


def _main(argv: list[str]) -> int:
    """:func:`main` on ``argv``: the subcommand's hand-off, errors mapped to exit codes."""
    debug = "--debug" in argv  # until parsed: `shoal run x.py --debug` is the script's flag
    install_logging()  # shoal's notices on stderr, its results on stdout, as print's were
    try:
        args, extra = build_parser(command_of(argv)).parse_known_args(argv)
        debug = bool(getattr(args, "debug", False))
        if debug:
            install_logging(debug=True)
        if extra:  # the subcommand's own help knows its flags
            command = f"shoal {args.command}" if args.command else "shoal"
            raise ShoalError(f"unrecognized arguments: {' '.join(extra)} (see {command} --help)")
        if args.command in ("train", "plan", "join", "run") and args.secret_file is not None:
            use_secret_file(args.secret_file)  # the job's processes find it in SHOAL_SECRET
        if args.command == "train":
            return _train(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "join":
            from pathlib import Path

            from shoal.train.join import join_job

            return join_job(None if args.out is None else Path(args.out), args.store)
        if args.command == "run":
            _run(args)
        elif args.command == "bench":
            _bench(args, argv)
        elif args.command == "report":
            _report(args)
        elif args.command == "list":
            _list()
        else:
            build_parser("").print_help()
            return EXIT_USER_ERROR
        return 0
    except KeyboardInterrupt:
        print("shoal: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return EXIT_TERMINATED
    except BrokenPipeError:  # `shoal list | head`: the reader left; end quietly, as cat does
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        return EXIT_FAILURE
    except ShoalError as exc:
        return _error(exc, debug)
    except Exception as exc:
        if debug:
            traceback.print_exc()
        first = (str(exc).strip().splitlines() or [""])[0]
        hint = "" if debug else " (run with --debug for the traceback)"
        print(f"shoal: error: {_where()}{type(exc).__name__}: {first}{hint}", file=sys.stderr)
        return EXIT_FAILURE


__all__ = ["EXIT_DEGRADED", "EXIT_FAILURE", "EXIT_INTERRUPTED", "EXIT_TERMINATED",
           "EXIT_USER_ERROR", "build_parser", "config_from_args", "main"]
