"""The planner: Omnivore's search with injected measurements, the prediction of epochs to a
target, and (real processes) shoal train --strategy auto training what shoal plan picks."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from shoal.cli import main
from shoal.emulate import can_emulate
from shoal.errors import ShoalError
from shoal.plan.search import (
    NOT_WORTH,
    Omnivore,
    SearchSettings,
    epochs_to_target,
    explain,
    group_knobs,
    rank,
)
from shoal.plan.trials import HARDWARE, STATISTICAL, Candidate, Phase, Trial
from shoal.schema import parse_duration

from conftest import one_error_line

SETTINGS = SearchSettings(target=0.9, epochs=20, chance=0.1, budget_s=1e9, lr=0.1, momentum=0.9)


class Clock:
    """A clock the injected trials advance by their cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_with(speeds: dict, progress=lambda c: 0.3, diverges=lambda c: False, clock=None,
             cost: float = 1.0, settings: SearchSettings = SETTINGS) -> tuple[Omnivore, list]:
    """An Omnivore whose trials take ``speeds[(strategy, knob, workers)]`` seconds an epoch
    and gain ``progress(candidate)`` accuracy an epoch (3 epochs, from 0.1, at most 0.99),
    diverging where told."""
    clock = clock or Clock()
    asked: list[Candidate] = []

    def run(c: Candidate, phase: Phase) -> Trial:
        asked.append(c)
        clock.now += cost
        if diverges(c):
            return Trial(c, diverged=True, cost_s=cost)
        s = speeds[(c.strategy, c.knob, c.workers)]
        curve = [(e, min(0.99, 0.1 + progress(c) * e), s * e) for e in (1, 2, 3)]
        return Trial(c, curve=curve, epoch_s=s, cost_s=cost)

    return Omnivore(settings, run, clock), asked


SYNC = Candidate("sync", (), 4, 1)
EASGD = Candidate("easgd", (("tau", 1),), 4, 1)
GROUPS = Candidate("groups", (("groups", 1),), 4, 1)


def test_the_faster_of_two_configurations_wins():
    # Same accuracy per epoch: the one with the faster epoch must win, whichever it is.
    for fast, slow in ((1.0, 2.0), (2.0, 1.0)):
        speeds = {("sync", 1, 4): fast, ("easgd", 4, 4): slow, ("easgd", 16, 4): slow}
        search, _ = run_with(speeds)
        ranked = search.search([SYNC], [EASGD])
        assert ranked[0].candidate.strategy == ("sync" if fast < slow else "easgd")
        # 0.4, 0.7, 0.99 after epochs 1-3: 0.9 is reached 0.2 / 0.29 into epoch 3.
        assert ranked[0].predicted_s == pytest.approx(min(fast, slow) * (2 + 0.2 / 0.29))


def test_the_walk_goes_while_an_epoch_gets_ten_percent_faster():
    speeds = {("sync", 1, 4): 10.0, ("easgd", 4, 4): 8.0, ("easgd", 16, 4): 7.3,
              ("easgd", 64, 4): 5.0}
    search, asked = run_with(speeds)
    search.walk(search.trial(SYNC, HARDWARE), EASGD, (4, 16, 64))
    knobs = [c.knob for c in asked if c.strategy == "easgd"]
    assert knobs == [4, 16]  # 8.0 is 20% faster than 10; 7.3 only 8.75% faster than 8: stop
    assert search.walk(search.trial(SYNC, HARDWARE), EASGD, (4, 16, 64)) == EASGD.with_knob(4)
    # A family no step of which is 10% faster than sync is not tuned at all.
    slow = {("sync", 1, 4): 10.0, ("easgd", 4, 4): 9.5}
    search, asked = run_with(slow)
    search.search([SYNC], [EASGD])
    assert {c.knob for c in asked if c.strategy == "easgd"} == {4}
    assert any("not tuned further" in n for n in search.notes)


def test_a_diverging_branch_is_pruned():
    # At lr 0.1 momentum 0.6 diverges: 0.9 is not tried at that rate; at 0.01 all are.
    def momentum(c: Candidate) -> float:
        return 0.9 if c.momentum is None else c.momentum  # None: the user's

    speeds = {("sync", 1, 4): 1.0}
    search, asked = run_with(speeds, diverges=lambda c: c.lr is None and momentum(c) >= 0.6)
    search.grid(SYNC)
    tried = [(momentum(c), c.lr) for c in asked]
    assert tried[:3] == [(0.0, None), (0.3, None), (0.6, None)]  # then pruned: not 0.9
    assert [mu for mu, _ in tried[3:]] == [0.0, 0.3, 0.6, 0.9]
    assert all(lr == pytest.approx(0.01) for _, lr in tried[3:])
    # A rate at which momentum 0 diverges is dropped whole.
    search, asked = run_with(speeds, diverges=lambda c: c.lr is None)
    search.grid(SYNC)
    assert [(c.momentum, c.lr) for c in asked][0] == (0.0, None)
    assert all(c.lr == pytest.approx(0.01) for c in asked[1:])


def test_groups_shrink_while_the_best_momentum_is_zero():
    # At g = 4 and g = 2 the best explicit momentum is 0 (asynchrony supplies it), and each
    # halving does better; at g = 1 momentum 0.9 is best: g halves twice, then stops.
    speeds = {("groups", g, 4): 1.0 for g in (1, 2, 4)}
    best = {4: (0.0, 0.2), 2: (0.0, 0.25), 1: (0.9, 0.3)}  # g: (best momentum, its progress)

    def progress(c: Candidate) -> float:
        mu = c.momentum if c.momentum is not None else 0.9
        return best[c.knob][1] if mu == best[c.knob][0] else 0.05

    search, asked = run_with(speeds, progress=progress)
    found = search.groups(GROUPS.with_knob(4))
    assert list(dict.fromkeys(c.knob for c in asked)) == [4, 2, 1]
    assert found.candidate.knob == 1 and search.momentum_of(found.candidate) == 0.9
    assert sum("g shrinks" in n for n in search.notes) == 2
    # Where halving g does no better, the shrinking stops and the larger g stays.
    best[2] = (0.0, 0.1)
    search, asked = run_with(speeds, progress=progress)
    found = search.groups(GROUPS.with_knob(4))
    assert list(dict.fromkeys(c.knob for c in asked)) == [4, 2] and found.candidate.knob == 4


def test_the_budget_skips_trials_that_would_not_fit():
    speeds = {("sync", 1, 4): 1.0}
    settings = dataclasses.replace(SETTINGS, budget_s=3.5)
    search, asked = run_with(speeds, settings=settings, cost=1.0)
    search.grid(SYNC)
    assert len(asked) == 3 and len(search.skipped) == 8 - 3


def test_a_trial_that_would_cost_more_than_it_could_save_is_not_run():
    """Once a trial predicts the target in 2.69 s, a trial of 5 s cannot pay for itself
    (even one that reached the target at once would save at most 2.69 s): the grid stops
    there, whatever the budget, and the plan says why."""
    from shoal.plan.search import NOT_WORTH

    search, asked = run_with({("sync", 1, 4): 1.0}, cost=5.0)
    search.grid(SYNC)
    # its curve: 0.4, 0.7, 0.99 after epochs 1-3 of 1 s: 0.9 at 2 + 0.2 / 0.29 epochs
    assert len(asked) == 1 and search.leader_s() == pytest.approx(2 + 0.2 / 0.29)
    assert len(search.skipped) == 7 and {why for _, _, why in search.skipped} == {NOT_WORTH}
    search, asked = run_with({("sync", 1, 4): 1.0}, cost=2.0)  # cheaper: all run
    search.grid(SYNC)
    assert len(asked) == 8 and not search.skipped


def test_the_budget_expects_a_configurations_own_cost():
    """A grid point costs what its configuration's trials cost (start-ups aside); a new
    configuration, the median so far; so one slow trial does not stop the search."""
    search, _ = run_with({("sync", 1, 4): 1.0}, settings=dataclasses.replace(SETTINGS, budget_s=60))
    search.trials = [Trial(SYNC, cost_s=40.0, startup_s=10.0), Trial(EASGD.with_knob(4), cost_s=2.0),
                     Trial(EASGD.with_knob(16), cost_s=4.0)]
    assert search.expected_cost(SYNC) == 30.0
    assert search.expected_cost(dataclasses.replace(EASGD.with_knob(4), momentum=0.0)) == 2.0
    assert search.expected_cost(EASGD.with_knob(64)) == 4.0  # the median of 30, 2, 4
    search.trials = []
    assert search.expected_cost(SYNC) == SETTINGS.trial_cost_s


def test_a_speed_only_trial_does_not_answer_the_grid():
    """An asynchronous candidate's walk step measures its speed only; its grid then runs the
    user's own point again, tested."""
    speeds = {("sync", 1, 4): 1.0, ("groups", 2, 4): 0.5}
    search, asked = run_with(speeds)
    fast = Candidate("groups", (("groups", 2),), 4, 1)
    search.trials.append(Trial(fast, epoch_s=0.5, speed_only=True))
    assert search.trial(fast, HARDWARE).speed_only  # the walk reuses it
    assert search.trial(fast, STATISTICAL).curve and asked == [fast]


def test_the_leaders_are_measured_longer():
    """After the search, the best four tested configurations train trials twice as long,
    then the better two four times as long (successive halving, within the budget); a
    configuration's longest trial ranks it. Here A looks best on short trials (fast start),
    B on long ones, and B wins."""
    a, b = (Candidate("local-sgd", (("tau", 64),), 4, 1), Candidate("diloco", (("tau", 64),), 4, 1))
    others = [Candidate("easgd", (("tau", t),), 4, 1) for t in (4, 16)]
    asked: list[tuple[Candidate, Phase]] = []
    clock = Clock()

    def run(c: Candidate, phase: Phase) -> Trial:
        asked.append((c, phase))
        clock.now += 1.0
        epochs = 3 * phase.scale
        if c == a:  # falls fast toward a floor: reaches 90% at epoch 14.6
            curve = [(e, 1 - (0.08 + 0.5 * e ** -1.2), e) for e in range(1, epochs + 1)]
        elif c == b:  # a power law: reaches 90% at epoch 8.7 (predicted so from any length)
            curve = [(e, 1 - 0.7 * e ** -0.9, e) for e in range(1, epochs + 1)]
        else:
            curve = [(e, 0.2, e) for e in range(1, epochs + 1)]
        return Trial(c, curve=curve, epoch_s=1.0, cost_s=1.0)

    search = Omnivore(SETTINGS, run, clock)
    for c in (a, b, *others):
        search.trial(c, HARDWARE)
    assert epochs_to_target(search.trials[0].curve, 0.9, 0.1) \
        < epochs_to_target(search.trials[1].curve, 0.9, 0.1)  # A leads after 3 epochs (and 6)
    search.refine()
    assert [str(p) for _, p in asked[4:]] == ["refine x2"] * 4 + ["refine x4"] * 2
    ranked = rank(search.trials)
    assert ranked[0].candidate == b and ranked[0].phase == Phase.refine(4)
    # a budget that holds no longer trial leaves the ranking to the short ones
    clock.now = 0.0
    search = Omnivore(dataclasses.replace(SETTINGS, budget_s=4.5), run, clock)
    for c in (a, b, *others):
        search.trial(c, HARDWARE)
    search.refine()
    assert rank(search.trials)[0].candidate == a and len(search.trials) == 4


def test_phases_are_typed_and_written_as_words():
    """A trial's phase is a Phase (its stage and length), written into plan.json as before:
    ``hardware``, ``refine x4``."""
    from shoal.plan.search import Plan
    from shoal.plan.trials import INCUMBENT

    assert [str(p) for p in (INCUMBENT, HARDWARE, STATISTICAL, Phase.refine(4))] == [
        "incumbent", "hardware", "statistical", "refine x4"]
    assert Phase.refine(4).scale == 4 and HARDWARE.scale == 1
    trial = Trial(SYNC, curve=[(1, 0.5, 1.0)], epoch_s=1.0, phase=Phase.refine(2))
    record = Plan([trial], [(SYNC, STATISTICAL, "over the budget")], None, "", [],
                  1.0).to_dict(SETTINGS)
    assert record["trials"][0]["phase"] == "refine x2"
    assert record["skipped"] == [{"label": SYNC.label(), "phase": "statistical",
                                  "why": "over the budget"}]
    assert json.loads(json.dumps(record)) == record


def test_epochs_to_target():
    assert epochs_to_target([(1, 0.5, 1.0), (2, 0.95, 2.0)], 0.9, 0.1) == pytest.approx(1 + 0.4 / 0.45)
    assert epochs_to_target([(1, 0.55, 1.0)], 0.9, 0.1) == pytest.approx(1 + 0.35 / 0.45)
    # err = 0.4 e^-1: reaches 0.1 at e = 4
    curve = [(1, 0.6, 1.0), (2, 0.8, 2.0)]
    assert epochs_to_target(curve, 0.9, 0.1) == pytest.approx(4.0)
    assert math.isinf(epochs_to_target([(1, 0.5, 1.0), (2, 0.4, 2.0)], 0.9, 0.1))
    assert math.isinf(epochs_to_target([(1, 0.1, 1.0)], 0.9, 0.1))
    # a fraction of an epoch; a curve too flat to extrapolate is out of reach, not an overflow
    assert epochs_to_target([(0.25, 0.5, 1.0), (0.5, 0.95, 2.0)], 0.9, 0.1) \
        == pytest.approx(0.25 + 0.25 * 0.4 / 0.45)
    assert math.isinf(epochs_to_target([(0.25, 0.101, 1.0), (0.5, 0.1011, 2.0)], 0.999, 0.1))
    assert group_knobs(6) == [1, 2, 4, 6] and group_knobs(1) == [1]


def test_durations():
    assert [parse_duration(t, "--plan-budget") for t in ("90", "90s", "5m", "1.5h", "168h")] \
        == [90, 90, 300, 5400, 604800]
    for bad, why in (("soon", "a duration"), ("nanm", "a duration"), ("1e400", "a duration"),
                     ("-5m", "a positive duration"), ("0", "a positive duration"),
                     ("1e99", "at most a week"), ("99999999999h", "at most a week")):
        with pytest.raises(ShoalError, match=f"^--plan-budget must be {why}"):
            parse_duration(bad, "--plan-budget")


def test_auto_trains_the_plans_winner(tmp_path):
    out = tmp_path / "auto"
    assert main(["train", "--strategy", "auto", "--model", "mlp", "--workers", "2",
                 "--epochs", "3", "--target-accuracy", "0.9", "--plan-budget", "30s",
                 "--plan-candidates", "sync,easgd", "--trial-epochs", "1", "--progress", "none",
                 "--out", str(out)]) == 0
    plan = json.loads((out / "plan" / "plan.json").read_text())
    assert set(plan) >= {"target_accuracy", "budget_s", "planning_s", "epochs", "why", "notes",
                         "winner", "trials", "skipped"}
    assert plan["budget_s"] == 30 and not (out / "probe.json").exists()  # the flag, no probe
    assert plan["target_accuracy"] == 0.9 and plan["epochs"] == 3 and plan["trials"]
    for t in plan["trials"]:
        assert set(t) >= {"label", "strategy", "options", "workers", "threads", "momentum", "lr",
                          "phase", "curve", "epoch_s", "diverged", "predicted_s", "cost_s"}
        assert t["phase"] in ("hardware", "statistical", "refine x2", "refine x4")
        assert t["strategy"] in ("sync", "easgd")
        # 1 trial epoch (a periodic strategy's: at least two periods, within the run's 3),
        # sync's tested 4 times inside it (and at its end, one step past)
        assert all(len(p) == 3 for p in t["curve"]) and 1 <= t["curve"][-1][0] <= 3.1
        if t["strategy"] == "sync" and not t["phase"].startswith("refine"):
            assert len(t["curve"]) >= 4 and t["curve"][-1][0] < 1.2 and t["curve"][0][0] < 0.5
    winner, config = plan["winner"], json.loads((out / "config.json").read_text())
    for key in ("strategy", "strategy_options", "threads_per_worker"):
        assert config[key] == winner[key], key  # the final run is the winner
    # its momentum and lr as the winner gave them, or (auto, unset) resolved for its strategy
    if isinstance(winner["momentum"], str):
        assert config["momentum_auto"]["explicit"] == config["momentum"]
    else:
        assert config["momentum"] == winner["momentum"]
    assert config["lr"] == winner["lr"] or (winner["lr"] is None and config["lr"] is not None)
    assert config["world_size"] == plan["trials"][0]["workers"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["plan"]["winner"] == plan["trials"][0]["label"] and summary["completed"]
    assert (out / "plan" / "plan.png").is_file() and (out / "plan" / "plan.md").is_file()
    # The 2-worker trials ran one after another in one planning session (one start-up),
    # the 1-process layout's as a job of its own. Whether easgd's trial runs is the
    # planner's call on measured times (on digits sync may reach the target in less time
    # than another trial costs): if it did not, the plan says it was not worth it.
    sessions = sorted((out / "plan" / "trials" / "sessions").iterdir())
    in_layout = [t for t in plan["trials"] if t["workers"] == 2]
    not_worth = [s for s in plan["skipped"] if s["why"] == NOT_WORTH]
    assert len(sessions) == 1 and (len(in_layout) > 1 or not_worth), plan["skipped"]
    started = [t for t in plan["trials"] if t["startup_s"] > 0]
    assert len(started) == 1 and started[0]["workers"] == 2


def test_planning_errors_are_one_line(tmp_path, capsys):
    for args, message in ((["--strategy", "auto"], "needs --target-accuracy"),
                          (["--strategy", "auto", "--target-accuracy", "1.5"], "in (0, 1]"),
                          (["--strategy", "auto", "--target-accuracy", "0.9", "--plan-budget",
                            "soon"], "--plan-budget must be a duration"),
                          (["--strategy", "auto", "--target-accuracy", "0.9",
                            "--plan-candidates", "sync,hogwild"], "does not tune hogwild")):
        assert main(["train", "--out", str(tmp_path / "r"), *args]) == 2
        assert message in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("strategy, knob", [("groups", "groups"), ("async-measgd", "tau")])
def test_an_asynchronous_walk_step_measures_speed_only(tmp_path, strategy, knob):
    """groups (a parameter server) on the walk trains a few steps as a job of its own,
    untested, and its time per epoch comes from its summary; so does Async EAMSGD, which
    the planner walks by its period when --plan-candidates names it."""
    from shoal.config import TrainConfig
    from shoal.plan.planner import Planner, PlanOptions
    from shoal.sweep.runner import Launcher

    cfg = TrainConfig(model="mlp", dataset="digits", epochs=10, batch_size=16, workers=2,
                      target_accuracy=0.9, progress="none", out=str(tmp_path),
                      plan_candidates=("sync", strategy)).validate()
    with Launcher(None, 120) as launcher:
        planner = Planner(cfg, PlanOptions.of(cfg), launcher, tmp_path, 2, show=False)
        assert [c.strategy for c in planner.starts()[1]] == [strategy]
        assert planner.starts()[1][0].options == ((knob, 1),)
        trial = planner.trial(Candidate(strategy, ((knob, 2),), 2, None), HARDWARE)
    assert trial.ok and trial.speed_only and not trial.curve and 0 < trial.epoch_s < 60
    summary = json.loads(next((tmp_path / "trials").glob(f"01-{strategy}*/summary.json")).read_text())
    assert summary["steps"] == 11  # a quarter of a trial (1 epoch of 45 steps), at least 8
    assert trial.epoch_s == pytest.approx(summary["wall_time_s"] / 11 * 45)


def test_an_asynchronous_trial_is_tested_inside_its_slice_of_the_run(tmp_path):
    """groups' grid trial (its server tests the center as its workers' samples add up to
    the next test's global batches) is a slice of the run as sync's is, tested four times:
    a tenth of 10 epochs, not a whole epoch."""
    from shoal.config import TrainConfig
    from shoal.plan.planner import Planner, PlanOptions
    from shoal.sweep.runner import Launcher

    cfg = TrainConfig(model="mlp", dataset="digits", epochs=10, batch_size=16, workers=2,
                      target_accuracy=0.9, progress="none", out=str(tmp_path)).validate()
    groups = Candidate("groups", (("groups", 2),), 2, None)
    with Launcher(None, 120) as launcher:
        planner = Planner(cfg, PlanOptions.of(cfg), launcher, tmp_path, 2, show=False)
        assert planner.length(groups) == {"stop_at_step": 46, "eval_every_steps": 11}
        trial = planner.trial(groups, STATISTICAL)
    assert trial.ok and not trial.speed_only
    # tested as the samples pass 11, 22, 33 and 44 global batches (the workers' reports
    # come every 11 of their half-batches: a test lands up to a report late), then at the
    # epoch's end
    epochs = [e for e, _, _ in trial.curve]
    assert len([e for e in epochs if e < 1]) == 4 and epochs == sorted(epochs)
    assert all(abs(e - k * 11 / 45) < 0.1 for k, e in enumerate(epochs[:4], 1))
    assert all(0 < acc <= 1 for _, acc, _ in trial.curve) and 0 < trial.epoch_s < 60


def test_a_trials_cost_is_estimated_from_the_fastest_tested_one(tmp_path):
    """Before a configuration has run, its trial's cost comes from what sync measured:
    compute per step, and the all-reduce paid every step (sync), once a period (tau), or
    twice (groups: a push and a pull), plus a job's start-up outside the session. The
    search takes it over the median: a slow sync trial does not stop the walk."""
    from shoal.config import TrainConfig
    from shoal.plan.planner import Planner, PlanOptions

    cfg = TrainConfig(model="mlp", dataset="digits", epochs=10, batch_size=16, workers=2,
                      target_accuracy=0.9, progress="none", out=str(tmp_path)).validate()
    planner = Planner(cfg, PlanOptions.of(cfg), NoLauncher(), tmp_path, 2, show=False)
    sync = Candidate("sync", (), 2, None)
    assert planner.estimate(sync, HARDWARE) is None  # nothing measured yet
    # 45 steps an epoch: 0.1 s a step, of which 0.06 s an all-reduce
    planner.measured.append(Trial(sync, curve=[(1, 0.5, 4.5)], epoch_s=4.5, comm_fraction=0.6))
    # a trial: a tenth of 10 epochs, one step past the epoch's end
    assert planner.steps_per_epoch == 45 and planner.steps(sync, HARDWARE) == 46
    assert planner.estimate(sync, HARDWARE) == pytest.approx(46 * 0.1)
    tau16 = Candidate("local-sgd", (("tau", 16),), 2, None)
    assert planner.steps(tau16, HARDWARE) == 48  # three whole periods
    assert planner.estimate(tau16, HARDWARE) == pytest.approx(48 * (0.04 + 0.06 / 16))
    groups = Candidate("groups", (("groups", 2),), 2, None)
    assert planner.estimate(groups, HARDWARE) == pytest.approx(11 * (0.04 + 0.12) + 10)
    search = Omnivore(planner.settings, lambda c, p: None, Clock(), planner.estimate)
    search.trials = [Trial(sync, cost_s=60.0)]
    assert search.expected_cost(tau16) == pytest.approx(48 * (0.04 + 0.06 / 16))


class NoLauncher:
    """A launcher the estimate never calls."""

    timeout = 10.0


def test_a_failing_trial_ends_its_session_and_the_next_starts_another(tmp_path):
    """A diverging trial (two real workers) ends the planning session with its one line;
    the next trial starts a new session and trains."""
    from shoal.config import TrainConfig
    from shoal.plan.session import PlanningSession
    from shoal.sweep.runner import Launcher

    base = TrainConfig(model="mlp", dataset="digits", epochs=2, batch_size=64, workers=2,
                       progress="none", out=str(tmp_path / "base")).validate()
    with Launcher(None, 120) as launcher:
        session = PlanningSession(launcher, base, 2, tmp_path / "sessions", timeout=120)
        try:
            bad = dataclasses.replace(base, lr=1e12, out=str(tmp_path / "bad"), workers=None,
                                      stop_at_step=8)
            with pytest.raises(ShoalError, match="loss became|non-finite"):
                session.run(bad)
            good = dataclasses.replace(base, out=str(tmp_path / "good"), workers=None,
                                       stop_at_step=8, eval_every_steps=4)
            assert session.run(good) > 0  # a new session's start-up
        finally:
            session.close()
    assert sorted(p.name.rsplit("-", 1)[0] for p in (tmp_path / "sessions").iterdir()) == [
        "session-1", "session-2"]
    records = [json.loads(line) for line in (tmp_path / "good" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "eval"] == [4, 8]


@pytest.mark.skipif(can_emulate() is not None, reason=f"cannot emulate: {can_emulate()}")
def test_a_session_on_the_emulated_cluster_runs_trials_one_after_another(tmp_path):
    """Under torchrun across two emulated hosts (network namespaces: the planner is not the
    workers' parent and shares no network with them) the ranks join the planner's pool and
    train trial after trial in one start-up."""
    from shoal.config import TrainConfig
    from shoal.plan.session import PlanningSession
    from shoal.sweep.runner import Launcher

    base = TrainConfig(model="mlp", dataset="digits", epochs=2, batch_size=64, workers=2,
                       threads_per_worker=1, progress="none", out=str(tmp_path / "base")).validate()
    with Launcher("1gbit", 120) as launcher:
        assert launcher.emulated(2)
        session = PlanningSession(launcher, base, 2, tmp_path / "sessions", timeout=120)
        try:
            startups = [session.run(dataclasses.replace(base, out=str(tmp_path / f"trial-{k}"),
                                                        workers=None, stop_at_step=4))
                        for k in range(2)]
        finally:
            session.close()
    assert startups[0] > 0 and startups[1] == 0
    for k in range(2):
        summary = json.loads((tmp_path / f"trial-{k}" / "summary.json").read_text())
        assert summary["workers"] == 2 and summary["steps"] == 4
    assert len(list((tmp_path / "sessions").iterdir())) == 1


def test_no_candidate_reaching_the_target_is_said_with_the_epochs_left_rounded():
    """The epochs left after the probe are a fraction of the run's (a real srun of 4 ranks
    said "within 9.130434782608695 epochs"): one decimal at most."""
    left = dataclasses.replace(SETTINGS, epochs=10 - 0.8695652173913043)
    assert explain([], left) == "no candidate is predicted to reach 90% within 9.1 epochs"
    assert "within 20 epochs" in explain([], SETTINGS)
