"""The stop vote: every rank stops after the same step when SIGTERM reaches one, and the
vote costs a fast loop next to nothing (at most one tiny all-reduce per spacing)."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

import shoal
from shoal.core.processes import spawn
from shoal.core.stop import request_stop
from shoal.errors import ShoalError
from shoal.train.stopping import SIGTERM, VOTE_SPACING_S, StopVote, vote_spacing

STEP_S = 0.001


def _vote_loop(asker: int, ask_at: int, meets_every: int) -> tuple[int, str, int, float]:
    """Steps of STEP_S until the vote says stop (rank ``asker`` asked at step ``ask_at``):
    the step stopped after, the reason, the all-reduces made, the seconds taken."""
    comm = shoal.init(device="cpu")
    vote = StopVote(comm, lambda step: step % meets_every == 0)
    real, calls = dist.all_reduce, [0]

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(*args, **kwargs)

    dist.all_reduce = counted
    started, step, reason = time.perf_counter(), 0, None
    while reason is None:
        step += 1
        assert step < 100_000, "the vote never stopped the loop"
        time.sleep(STEP_S)
        if comm.rank == asker and step == ask_at:
            request_stop()
        reason = vote.agreed(step)
    vote.settle()
    took = time.perf_counter() - started
    shoal.shutdown()
    return step, reason, calls[0], took


@pytest.mark.parametrize(("workers", "asker", "meets_every"), [(2, 1, 1), (3, 0, 1), (2, 0, 4)])
def test_every_rank_stops_after_the_same_step_soon_after_sigterm(workers, asker, meets_every):
    ask_at = 200
    got = spawn(workers, _vote_loop, (asker, ask_at, meets_every))
    steps = {step for step, _, _, _ in got}
    assert len(steps) == 1, got
    step = steps.pop()
    assert all(reason == SIGTERM for _, reason, _, _ in got), got
    assert step % meets_every == 0 and step > ask_at
    # Acted on within two spacings: a spacing is at most VOTE_SPACING_S / STEP_S steps
    # (a step takes at least STEP_S), plus a meeting for each.
    most = 2 * (round(VOTE_SPACING_S / STEP_S) + meets_every) + meets_every
    assert step - ask_at <= most, got
    for _, _, calls, took in got:  # not a vote every step: about one per spacing
        assert calls <= 2 * took / VOTE_SPACING_S + 3, got


@pytest.mark.parametrize("given", ["soon", "-1", "61", "nan"])
def test_a_spacing_that_is_not_seconds_is_named(monkeypatch, given):
    monkeypatch.setenv("SHOAL_STOP_VOTE_S", given)
    with pytest.raises(ShoalError, match=f"SHOAL_STOP_VOTE_S='{given}': expected seconds"):
        vote_spacing()


def test_the_spacing_is_the_environments_where_given(monkeypatch):
    assert vote_spacing() == VOTE_SPACING_S
    monkeypatch.setenv("SHOAL_STOP_VOTE_S", "0")
    assert vote_spacing() == 0.0
