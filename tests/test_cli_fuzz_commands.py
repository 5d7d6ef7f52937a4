"""Property-based tests of ``shoal plan``, ``shoal train --strategy auto``, ``shoal run`` and
the asynchronous strategies' flags, as :mod:`test_cli_fuzz` tests ``shoal train``'s: whatever
the values (durations of every shape, empty and unknown lists, negative numbers that look
like options, counts, hostile text), the command ends with success or one ``shoal: error:``
line (exit 0 or 2), never a traceback, an exit 1 or a file outside ``--out``.

The commands run up to the work they would start (a plan's search, a job's processes, auto's
probe of sync), which these examples leave out (:func:`checks_only`): everything that reads
and checks the values, the data, the model and ``--out`` runs for real, in this process.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from unittest import mock

from hypothesis import given
from hypothesis import strategies as st

from shoal.plan.planner import Planner

from test_cli_fuzz import BASE, HOSTILE, HUGE, NUMBERS, POOLS, SETTINGS, TEXT, Valid, flag_args, run_shoal


def _search(planner: Planner) -> None:
    """Where a plan's search would start: what it was given must be what it can use."""
    assert planner.launcher.timeout < threading.TIMEOUT_MAX, "a wait no clock can hold"
    assert planner.options.candidates, "a plan with nothing to choose from"
    raise Valid


@contextlib.contextmanager
def checks_only() -> Iterator[None]:
    """Run the commands up to their work, then stop with :class:`Valid`: a plan's search
    (every trial a job), an asynchronous job's processes, ``shoal run``'s workers. All that
    reads and checks the flags, the data, the model and ``--out`` runs for real."""
    with mock.patch.object(Planner, "run", _search), \
            mock.patch("shoal.train.job._run_with_restarts", side_effect=Valid), \
            mock.patch("shoal.train.job.run_rank", side_effect=Valid), \
            mock.patch("shoal.runtime.launch", side_effect=Valid):
        yield


#: Durations of every shape, and the lists the planner reads.
DURATIONS = ["90s", "5m", "1h", "0.5s", "auto", "-5m", "-1", "0", "1e99", "99999999999h",
             "168h", "169h", "nan", "inf", "-inf", "nanm", "1e400", "", " ", "5 min", "m", "s5", "1e-300s",
             "5M", "1h30m"]
CANDIDATES = ["sync", ",", "", " ", " , ,", "sync,,", "local-sgd,easgd", "groups", "eamsgd",
              "hogwild", "async-sgd", "magic", "sync,magic", "shoal:Strategy", "diloco,diloco"]
PLAN_POOLS = {
    "--plan-budget": DURATIONS, "--replan-every": DURATIONS, "--plan-candidates": CANDIDATES,
    "--trial-epochs": NUMBERS, "--target-accuracy": NUMBERS,
    "--out": POOLS["--out"], "--epochs": ["1", "2", "0", "-1", "nan", HUGE],
}
#: shoal plan's --simulate flags, without --simulate (its calibration takes a minute); for
#: shoal train, unknown flags.
SIMULATE_POOLS = {"--nodes": ["4,16", "", ",", "-1", "0", HUGE], "--calibration": ["x"],
                  "--bandwidth": ["1gbit", "-1", "x", ""], "--latency": ["50us", "-1", "x", ""],
                  "--strategies": CANDIDATES, "--host-cost": None}
#: Counts that become processes stay small or invalid (their upper bounds are another test's).
COUNTS = ["1", "2", "0", "-1", "", "x", "1.5", "nan", "-inf", "auto", "1e3"]
ASYNC_POOLS = {
    "--servers": COUNTS, "--groups": COUNTS, "--workers": ["1", "2", "0", "-1", "x"],
    "--max-staleness": NUMBERS, "--order": ["arrival", "round-robin", "", "-1", "x"],
    "--momentum": ["0.9", "0", "auto", "auto:0.5", "auto:x", "auto:-1", "auto:1e99",
                   "auto:nan", "auto:", "-0.5", "1", "nan", "-inf"],
    "--tau": ["4", "auto", "auto:8", "auto:-4", "auto:0", "auto:x", "auto:1e99", "-inf", "0",
              HUGE],
    "--alpha": NUMBERS,
}
ASYNCHRONOUS = ["async-easgd", "async-measgd", "async-sgd", "async-msgd", "groups", "hogwild",
                "hogwild-easgd"]
RUN_POOLS = {"--workers": COUNTS + ["-5m", HUGE], "--threads-per-worker": COUNTS + [HUGE]}
#: Good values, drawn more often than the others, so that many examples pass every check.
VALID = {"--plan-budget": ["90s", "5m", "0.5s", "168h", "10", "auto"],
         "--replan-every": ["1h", "30s"],
         "--plan-candidates": ["sync", "local-sgd,easgd", "groups", " diloco , eamsgd "],
         "--trial-epochs": ["0.25", "1"], "--target-accuracy": ["0.5", "1"],
         "--out": ["run", "run/sub"], "--epochs": ["1", "2"], "--servers": ["1", "2"],
         "--groups": ["1", "2"], "--workers": ["1", "2"], "--max-staleness": ["1", "10"],
         "--order": ["arrival", "round-robin"], "--momentum": ["0.9", "auto", "auto:0.5"],
         "--tau": ["4", "auto", "auto:8"], "--alpha": ["0.1", "0.5"],
         "--threads-per-worker": ["1", "2"]}
#: What ``shoal run`` runs: missing or odd scripts and modules, or a real one (its launch
#: is where checks_only stops).
RUN_TARGETS = [["missing.py"], ["{cfg}/fuzz_model.py"], ["{cfg}"], [""], ["-"], [],
               ["-m", "json"], ["-m", "no_such_module_here"], ["-m", ""], ["-m", ".."],
               ["-m", "json.no_such"], ["{cfg}/fuzz_model.py", "--workers", "-5"]]


@st.composite
def pooled_args(draw: st.DrawFn, pools: dict[str, list[str] | None]) -> list[str]:
    """A few of ``pools``' flags, each with a good value (:data:`VALID`), one from its pool
    (``None``: no value), a hostile one or any short text, as ``--flag value`` or
    ``--flag=value``."""
    args: list[str] = []
    for flag in draw(st.lists(st.sampled_from(sorted(pools)), max_size=3)):
        pool = pools[flag]
        if pool is None:
            args.append(flag)
            continue
        kind = draw(st.integers(0, 4))
        value = draw(st.sampled_from(VALID[flag]) if kind < 3 and flag in VALID else
                     st.sampled_from(pool) if kind < 4 else
                     st.one_of(st.sampled_from(HOSTILE), TEXT))
        args += [f"{flag}={value}"] if draw(st.booleans()) else [flag, value]
    return args


@SETTINGS
@given(st.sampled_from([["plan"], ["train", "--strategy", "auto"]]), pooled_args(PLAN_POOLS),
       st.sampled_from([[], [], [], ["train"], ["simulate"]]), st.data())
def test_any_planning_flags_end_in_success_or_one_error_line(command, planning, more, data):
    # now and then one of shoal train's flags (--out, --strategy, ...: the planned run's) or
    # the --simulate flags too
    if more == ["train"]:
        planning = [*data.draw(flag_args())[:2], *planning]
    elif more == ["simulate"]:
        planning = [*planning, *data.draw(pooled_args(SIMULATE_POOLS))]
    with checks_only():
        run_shoal([*command, *BASE[1:], "--target-accuracy", "0.9", *planning])


def _takes(strategy: str) -> dict[str, list[str] | None]:
    """:data:`ASYNC_POOLS` of the flags ``strategy`` takes (the others: a one-line refusal)."""
    from shoal.schema import flag_name
    from shoal.strategies import get_strategy, option_fields

    own = {flag_name(f.name) for f in option_fields(get_strategy(strategy))}
    return {k: v for k, v in ASYNC_POOLS.items() if k in own or k in ("--workers", "--momentum")}


@SETTINGS
@given(st.sampled_from(ASYNCHRONOUS), st.booleans(), st.data())
def test_any_asynchronous_flags_end_in_success_or_one_error_line(strategy, own, data):
    # mostly the flags the strategy takes, now and then any of them
    args = data.draw(pooled_args(_takes(strategy) if own else ASYNC_POOLS))
    with checks_only():
        run_shoal([*BASE, "--strategy", strategy, *args])


@SETTINGS
@given(pooled_args(RUN_POOLS), st.sampled_from(RUN_TARGETS))
def test_any_run_flags_end_in_success_or_one_error_line(args, target):
    with checks_only():
        run_shoal(["run", *args, *target])
