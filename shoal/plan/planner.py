"""``shoal plan``: run Omnivore's search (:mod:`shoal.plan.search`) with real trials, and
write what it found: ``plan.json``, ``plan.md`` and ``plan.png``.

A trial trains the user's run with one candidate's strategy, knob, workers and threads,
momentum and learning rate: the run's global batch and its learning-rate schedule over the
run's ``--epochs``, for ``trial_epochs`` epochs' worth of steps (``--stop-at-step``), tested
four times (``--eval-every-steps``); it reports the test accuracy and elapsed time of each
test. Trials in the job's own layout run one after another in a planning session
(:mod:`shoal.plan.session`: the workers start once); the others are real ``shoal train``
jobs (:class:`~shoal.sweep.runner.Launcher`: local worker processes, or the hosts of an
emulated cluster). The trials' files live in ``OUT/trials/`` (their checkpoints removed):
``shoal report OUT/trials/*`` plots them.

A re-plan (``--replan-every``) plans a run that goes on from a checkpoint (``--init-from
--init-progress``): every trial starts there, trains ``trial_epochs`` from it, and its curve
counts epochs and seconds from there, starting at the run's accuracy there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.config import TrainConfig
from shoal.core.files import read_json
from shoal.core.trust import private_dir
from shoal.data import EpochPlan, load_dataset
from shoal.errors import ShoalError
from shoal.plan.budget import auto_budget, probe_trial
from shoal.plan.outcome import start_of, trial_curve, trial_speed
from shoal.plan.search import Omnivore, Plan, SearchSettings, explain
from shoal.plan.session import PlanningSession
from shoal.plan.trials import HARDWARE, Candidate, Phase, Trial
from shoal.schema import parse_duration
from shoal.strategies import get_strategy
from shoal.strategies.cost import fitted_link, step_cost
from shoal.sweep.runner import Launcher
from shoal.train.launch import job_topology
from shoal.train.probe import trial_epochs
from shoal.train.records import write_json
from shoal.train.trainer import data_options

out_log = logging.getLogger("shoal.out")

#: The strategies ``shoal plan`` considers unless told otherwise.
CANDIDATES = ("sync", "local-sgd", "easgd", "diloco", "groups")
#: Asynchronous strategies the planner tunes as it tunes a periodic one (their knob: ``tau``),
#: when asked (``--plan-candidates``), in jobs of their own: the center's elastic averaging.
ASYNC_PERIODIC = ("async-easgd", "async-measgd")
#: Errors of a trial that mean its settings diverged, not that something is broken.
DIVERGED = ("non-finite", "loss became")


@dataclass
class PlanOptions:
    """The planner's settings, from the run's (``--target-accuracy``, ``--plan-budget``,
    ``--plan-candidates``, ``--trial-epochs``), checked."""

    target: float  #: test accuracy to reach, in (0, 1]
    budget_s: float | None  #: wall time the trials may take (``None``: auto, after sync's trial)
    candidates: tuple[str, ...]
    trial_epochs: float | None  #: epochs per trial (a fraction: part of an epoch; None: default)

    @classmethod
    def of(cls, cfg: TrainConfig) -> PlanOptions:
        if cfg.target_accuracy is None:
            raise ShoalError("planning needs --target-accuracy A: the test accuracy to reach")
        for name in cfg.plan_candidates:
            if name not in ("sync", "groups", *ASYNC_PERIODIC) and not _periodic(name):
                raise ShoalError(f"--plan-candidates: the planner does not tune {name} (it tunes "
                                 f"sync, groups and the periodic strategies: "
                                 f"{', '.join(CANDIDATES)}, eamsgd, {', '.join(ASYNC_PERIODIC)})")
        if cfg.trial_epochs is not None and cfg.trial_epochs > cfg.epochs:
            raise ShoalError(f"--trial-epochs {cfg.trial_epochs} is more than --epochs "
                             f"{cfg.epochs}")
        budget = None if cfg.plan_budget == "auto" else parse_duration(cfg.plan_budget,
                                                                       "--plan-budget")
        return cls(cfg.target_accuracy, budget, cfg.plan_candidates, cfg.trial_epochs)


def _periodic(name: str) -> bool:
    from shoal.strategies import PeriodicStrategy

    return issubclass(get_strategy(name), PeriodicStrategy)


class Planner:
    """Plans ``cfg`` (its model, data, workers, batch, epochs; its strategy is replaced)."""

    def __init__(self, cfg: TrainConfig, options: PlanOptions, launcher: Launcher, out: Path,
                 workers: int, show: bool = True, incumbent: Trial | None = None,
                 probe: dict[str, Any] | None = None, session: Any = None,
                 host_processes: int = 1) -> None:
        self.cfg, self.options, self.launcher, self.out = cfg, options, launcher, out
        self.workers, self.show = workers, show
        #: The processes of each host, where the job spans hosts of several each and their
        #: memory can sum (each periodic family is also tried one replica a host); else 1.
        self.host_processes = host_processes
        data = load_dataset(cfg.dataset, data_options(cfg))
        self.global_batch = cfg.global_batch(workers)
        self.steps_per_epoch = EpochPlan(len(data.train), self.global_batch, workers,
                                         cfg.seed).steps_per_epoch
        self.trial_epochs = trial_epochs(cfg.epochs, self.steps_per_epoch, options.trial_epochs)
        #: Where the trials start (a re-plan: the checkpoint's step and wall time), and the
        #: configuration training until then, measured first.
        self.start = start_of(cfg)
        self.incumbent = incumbent
        #: ``--strategy auto``'s probe of sync (its ``probe.json`` and ``comm_fraction``):
        #: sync's speed in the job's layout, measured already, where the trials start.
        self.probe = probe
        chance = 1.0 / data.num_classes
        numeric = cfg.momentum if not isinstance(cfg.momentum, str) else None
        self.settings = SearchSettings(
            target=options.target, epochs=cfg.epochs - self.start.step / self.steps_per_epoch,
            chance=max(chance, self.start.accuracy), budget_s=options.budget_s or math.inf, lr=cfg.base_lr(1),
            momentum=numeric, trial_cost_s=incumbent.cost_s if incumbent is not None else 0.0)
        self._count = 0
        self._bar: Any = None
        self.measured: list[Trial] = []  # every trial so far
        self.startups: list[float] = []  # the jobs' start-ups (and ends) measured so far
        #: The trials in the job's own layout run one after another in one set of workers
        #: (``session``: the job's own ranks, and no launcher: nothing else runs).
        self.session = session or PlanningSession(
            launcher, dataclasses.replace(cfg, out=str(out / "trials")), workers,
            (out / "trials" / "sessions").resolve(), timeout=launcher.timeout)

    # -- candidates and their run settings --------------------------------------------------
    def starts(self) -> tuple[list[Candidate], list[Candidate]]:
        """``sync`` in each process layout (the job's workers; where the job is local and has
        several, also one process with all their threads: Omnivore's batching of a machine's
        cores), and every other family (its knob set by the walk); where the job's hosts have
        several processes each (:attr:`host_processes`), each periodic family also one
        replica a host (``--host-sync``: synchronous inside a host, the strategy between
        hosts), walked as the family is."""
        from shoal.core.env import default_threads

        w, threads = self.workers, self.cfg.threads_per_worker
        syncs = [Candidate("sync", (), w, threads)]
        if w > 1 and self.launcher is not None and not self.launcher.emulated(w):
            syncs.append(Candidate("sync", (), 1, default_threads(1)))
        names = [n for n in self.options.candidates if n != "sync" and self.fits(n)]
        families = [Candidate(name, (("groups" if name == "groups" else "tau", 1),),
                              self.workers_of(name), threads) for name in names]
        if 1 < self.host_processes < w:
            families += [Candidate(name, (("host_sync", True), ("tau", 1)), w, threads)
                         for name in names if _periodic(name)]
        return syncs, families

    def fits(self, strategy: str) -> bool:
        """Whether ``strategy`` can be tried: always under shoal's launcher; inside a job, one
        with servers needs two workers beside them, and not under ``--elastic`` (an
        asynchronous elastic job's ranks are kept by processes of their own there)."""
        return self.launcher is not None or not detached(strategy) or (
            self.workers_of(strategy) > 1 and not self.cfg.elastic)

    def workers_of(self, strategy: str) -> int:
        """The workers a candidate of ``strategy`` trains on: the job's; inside a job (no
        launcher, :mod:`shoal.plan.injob`), one whose workers meet through parameter servers
        gives its servers ranks of the job's."""
        if self.launcher is not None or not detached(strategy):
            return self.workers
        cls = get_strategy(strategy)
        return self.workers - cls.servers(cls.Options())

    def config(self, c: Candidate, out: Path, **changes: Any) -> TrainConfig:
        """The run settings of candidate ``c`` writing to ``out`` (a trial's: ``changes``)."""
        cfg = self.cfg
        momentum = c.momentum if c.momentum is not None else cfg.momentum
        return dataclasses.replace(
            cfg, strategy=c.strategy, strategy_options=dict(c.options), workers=None,
            threads_per_worker=c.threads, momentum=momentum,
            nesterov=cfg.nesterov and momentum != 0, momentum_auto=None,
            lr=c.lr if c.lr is not None else cfg.lr, global_batch_size=self.global_batch,
            out=str(out), resume=None, overwrite=True, replan_every=None, **changes)

    # -- a trial ----------------------------------------------------------------------------
    def in_session(self, c: Candidate) -> bool:
        """Whether ``c``'s trial runs in the planning session (inside a job: every trial; else
        the job's layout, a synchronous strategy) rather than as a job of its own."""
        return self.launcher is None or self.in_layout(c)

    def in_layout(self, c: Candidate) -> bool:
        """Whether ``c`` is a synchronous strategy on the job's workers and threads."""
        return (c.workers == self.workers and c.threads == self.cfg.threads_per_worker
                and not detached(c.strategy))

    def speed_only(self, c: Candidate, phase: Phase) -> bool:
        """Whether ``c``'s trial measures its speed only: an asynchronous candidate on the
        walk toward asynchrony, which needs its time per epoch only (a few steps of a job of
        its own, untested)."""
        return phase == HARDWARE and detached(c.strategy)

    def length(self, c: Candidate, scale: int = 1) -> dict[str, Any]:
        """Where ``c``'s trial stops, and how often it is tested (``--stop-at-step``,
        ``--eval-every-steps``): ``trial_epochs`` of steps, tested four times; a periodic
        strategy's at least two of its periods, tested at whole periods (its time per epoch
        is then measured over whole periods, averaging included). An asynchronous
        strategy's center is tested by its server each time the workers' samples add up to
        that many more global batches (a step of each worker is a share of one). A trial
        that would stop on an epoch's last step goes one step further (a run stopped there
        stops before the epoch's test, as a resumed run would); one as long as the run
        trains it all. ``scale``: a refinement's trial, that many times as long."""
        spe, begin = self.steps_per_epoch, self.start.step
        steps = max(4, round(self.trial_epochs * scale * spe))
        every = max(1, steps // 4)
        if c.period > 1:  # a periodic strategy's, async's too
            every = c.period * max(1, every // c.period)
            steps = max(steps, 2 * every)
            steps = -(-steps // every) * every
        stop = begin + steps
        if stop >= self.cfg.epochs * spe:  # the whole run: it tests at its end
            return {"stop_at_step": None, "eval_every_steps": every}
        return {"stop_at_step": stop + 1 if stop % spe == 0 else stop, "eval_every_steps": every}

    def steps(self, c: Candidate, phase: Phase) -> int:
        """The steps ``c``'s trial trains (:meth:`length`, or a speed-only trial's)."""
        if self.speed_only(c, phase):  # two of its periods at least: both exchange
            quarter = round(self.trial_epochs * self.steps_per_epoch / 4)
            return max(min(self.steps_per_epoch, max(8, quarter)),
                       2 * c.period if c.period > 1 else 0)
        stop = self.length(c, phase.scale)["stop_at_step"]
        return (stop if stop is not None else self.cfg.epochs * self.steps_per_epoch) - self.start.step

    def estimate(self, c: Candidate, phase: Phase) -> float | None:
        """``c``'s trial cost from the cost model (:mod:`shoal.strategies.cost`), fitted to the
        fastest tested trial in the job's layout so far (``None``: none yet): its compute per
        step, and the link on which its own pattern communicated what it measured. ``c``'s
        step computes the same and exchanges on that link as its pattern says. A job of its
        own adds a start-up (the longest one measured, else 10 s)."""
        tested = [t for t in self.measured if t.ok and t.curve and self.in_layout(t.candidate)
                  and t.comm_fraction is not None]
        if not tested:
            return None
        ref = min(tested, key=lambda t: t.epoch_s)
        step, share = ref.epoch_s / self.steps_per_epoch, float(ref.comm_fraction or 0.0)
        measured, pattern = ref.candidate.pattern(), c.pattern()
        if measured is None or pattern is None:
            return None
        link = fitted_link(measured, ref.candidate.workers, step * share)
        cost = self.steps(c, phase) * step_cost(pattern, c.workers, step * (1 - share), 1.0,
                                                link).step_s
        if not self.in_session(c):
            cost += max(self.startups, default=10.0)
        return cost

    def trial(self, c: Candidate, phase: Phase) -> Trial:
        """Run candidate ``c``'s trial (in the session, or a job of its own); what it
        measured."""
        self._count += 1
        name = f"{self._count:02d}-" + "".join(ch if ch.isalnum() or ch in "-.=" else "_"
                                              for ch in c.label())
        # Only this user can enter trials/: a trial's settings file and results are read
        # back, so nobody else may plant or swap them.
        out = (private_dir(self.out / "trials", "the trials' folder") / name).resolve()
        speed_only = self.speed_only(c, phase)
        # Speed only: a quarter of the trial's steps (at least 8, at most an epoch; two
        # periods at least), untested.
        length = ({"stop_at_step": self.start.step + self.steps(c, phase), "eval_every_steps": None}
                  if speed_only else self.length(c, phase.scale))
        cfg = self.config(c, out, **length, eval_every=1, checkpoint_every=10**9,
                          progress="none", log_every=10, max_restarts=0, trace=False,
                          tensorboard=False, profile=None)
        started = time.monotonic()
        trial = Trial(c, speed_only=speed_only)
        try:
            if self.in_session(c):
                out.mkdir(parents=True, exist_ok=True)
                trial.startup_s = self.session.run(cfg)
            else:
                run_config(self.launcher, cfg, c.workers, name)
            self._measure(trial, out, started)
        except ShoalError as exc:
            message = str(exc)
            trial.diverged = any(d in message for d in DIVERGED)
            trial.error = None if trial.diverged else message
        finally:
            (out / "checkpoint.pt").unlink(missing_ok=True)
        trial.cost_s = time.monotonic() - started
        if self.options.budget_s is None and not self.measured:  # auto: sync's trial sets it
            self.settings.budget_s, line = auto_budget(trial, self.settings.epochs)
            self._say_line(line)
        self.measured.append(trial)
        self._say(trial)
        return trial

    def _measure(self, trial: Trial, out: Path, started: float) -> None:
        """What ``trial``'s finished run in ``out`` measured (its summary.json and
        metrics.jsonl); a missing or malformed file fails the trial with one line, as a
        failed run does, and the search goes on."""
        summary = read_json(out / "summary.json", "trial's summary")
        try:
            if trial.speed_only:
                trial.epoch_s = trial_speed(summary, out, self.start, self.steps_per_epoch)
            else:
                trial.curve, trial.epoch_s = trial_curve(out, self.start, self.steps_per_epoch,
                                                    self.cfg.eval_every)
            share = summary.get("comm_fraction")
            trial.comm_fraction = float(share) if share is not None else None
            if not self.in_session(trial.candidate):  # the job's time before and after training
                self.startups.append(max(0.0, time.monotonic() - started
                                         - float(summary["wall_time_s"]) + self.start.wall_s))
        except (AttributeError, KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            raise ShoalError(f"trial in {out} left malformed results ({type(exc).__name__}: "
                             f"{exc})") from None

    def _say(self, t: Trial) -> None:
        what = ("diverged" if t.diverged else f"failed: {t.error}" if t.error else
                f"{t.epoch_s:.2f} s/epoch (speed only)" if t.speed_only else
                f"{t.epoch_s:.2f} s/epoch, {100 * t.accuracy:.1f}% after {t.curve[-1][0]:.3g} epochs")
        if self._bar is not None:
            self._bar.update(min(t.cost_s, self._bar.total - self._bar.n))
        self._say_line(f"trial {self._count}: {t.candidate.label()}: {what} ({t.cost_s:.0f} s)")

    def _say_line(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)
        elif self.show:
            out_log.info(line)

    # -- the search -------------------------------------------------------------------------
    def run(self) -> Plan:
        """Search, write ``plan.json``, ``plan.md`` and ``plan.png`` into ``out``."""
        self.out.mkdir(parents=True, exist_ok=True)
        if self.show and sys.stderr.isatty() and self.options.budget_s is not None:
            from tqdm import tqdm

            self._bar = tqdm(total=self.options.budget_s, unit="s", desc="planning",
                             dynamic_ncols=True, file=sys.stderr,
                             bar_format="{desc} {bar} {n:.0f}/{total:.0f} s")
        started = time.monotonic()
        search = Omnivore(self.settings, self.trial, time.monotonic, self.estimate)
        if self.probe is not None:  # sync's speed is known: the walk starts from it
            seed = probe_trial(self.probe, Candidate("sync", (), self.workers,
                                                     self.cfg.threads_per_worker),
                               self.steps_per_epoch)
            search.trials.append(seed)
            self.measured.append(seed)
            self._say(seed)
        try:
            ranked = search.search(*self.starts(), incumbent=self.incumbent and
                                   self.incumbent.candidate)
        finally:
            self.session.close()
            if self._bar is not None:
                self._bar.close()
        best = ranked[0] if ranked and ranked[0].ok else None
        # The winner runs on its own workers (the trials' launcher passes them separately).
        winner = dataclasses.replace(self.config(best.candidate, Path(self.cfg.out)),
                                     workers=best.candidate.workers) if best is not None else None
        plan = Plan(ranked, search.skipped, winner, explain(ranked, self.settings), search.notes,
                    time.monotonic() - started)
        plan.files = self.write(plan)
        return plan

    def write(self, plan: Plan) -> dict[str, Path]:
        from shoal.plan.report import plan_figure, plan_table

        paths = {"json": self.out / "plan.json", "md": self.out / "plan.md",
                 "png": self.out / "plan.png"}
        write_json(paths["json"], plan.to_dict(self.settings))
        paths["md"].write_text(f"# shoal plan\n\n{plan_table(plan, self.settings)}\n"
                               f"Winner: {plan.why}.\n\n![plan](plan.png)\n")
        plan_figure(plan, self.settings, paths["png"])
        return paths


def run_config(launcher: Launcher, cfg: TrainConfig, workers: int, name: str) -> None:
    """Run ``shoal train`` with the settings ``cfg`` (writing to ``cfg.out``) on ``workers``
    workers through ``launcher``; the settings go in a JSON file beside ``cfg.out``."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    config_file = out.parent / f"{out.name}.json"
    config_file.write_text(json.dumps(cfg.to_dict()))
    launcher.train(["--config", str(config_file)], job_topology(cfg, workers).world_size, workers,
                   out, name)


def detached(strategy: str) -> bool:
    """Whether ``strategy``'s workers meet only through parameter servers."""
    cls = get_strategy(strategy)
    return cls.topology(cls.Options(), 1).detached
