"""What each strategy sends and how often, by hand from its paper's definition, and the fit of
the cost model's machine (shoal/plan/fit.py) with its held-out check, on synthetic points
of a known machine; the two-point calibration of alpha and beta."""

from __future__ import annotations

import pytest

from shoal.errors import ShoalError
from shoal.plan.calibrate import collectives_cost
from shoal.plan.fit import GRIDS, Setting, check, fit, network, predicted
from shoal.plan.simulate import predict, workloads
from shoal.strategies.communication import Exchange
from shoal.strategies.cost import Calibration, Machine

N = 1e6  # bytes of the model: 250,000 float32 parameters
P = 4  # workers
RING = 2 * (P - 1) / P * N  # what a worker sends in a ring all-reduce: 1.5 MB

#: spec -> (exchange, every, hidden, pushers, a worker's bytes sent per step), at 4 workers
#: (groups: 2 of 2; the servers' strategies: one server).
BY_HAND = {
    # synchronous SGD: every step, an all-reduce of the gradients
    "sync": (Exchange.ALL_REDUCE, 1, False, 0, RING),
    # local SGD (Lin et al. 2020): the parameters averaged every tau local steps
    "local-sgd:tau=4": (Exchange.ALL_REDUCE, 4, False, 0, RING / 4),
    # EASGD (Zhang et al. 2015), synchronous form: elastic pulls every tau steps, the
    # all-reduce overlapped with the next steps (SC17's implementation)
    "easgd:tau=4": (Exchange.ALL_REDUCE, 4, True, 0, RING / 4),
    # DiLoCo (Douillard et al. 2023): the outer pseudo-gradients every H inner steps
    "diloco:tau=4": (Exchange.ALL_REDUCE, 4, False, 0, RING / 4),
    # asynchronous SGD (Downpour; SC17's Async SGD): every worker pushes its gradient every
    # step and pulls the parameters
    "async-sgd": (Exchange.SERVER, 1, False, 4, N),
    "async-msgd": (Exchange.SERVER, 1, False, 4, N),
    # asynchronous EASGD (Zhang et al., SC17): each worker's parameters against the
    # center's every tau steps
    "async-easgd:tau=4": (Exchange.SERVER, 4, False, 4, N / 4),
    # Omnivore's compute groups (Hadjis et al. 2016): a synchronous all-reduce inside each
    # group of s = 2, the group's leader pushes and pulls (g = 2 pushers) and broadcasts the
    # parameters: per worker, the ring's 2 (s-1)/s n, and the leader's push and broadcast
    # shared by the group's s workers
    "groups:groups=2": (Exchange.GROUP_SERVER, 1, False, 2, 2 * (2 - 1) / 2 * N + 2 * N / 2),
}


@pytest.mark.parametrize("spec", sorted(BY_HAND))
def test_each_strategy_sends_what_its_paper_defines(spec):
    """The pattern each strategy states, and the bytes a worker sends per step that the cost
    model derives from it, against the hand computation above."""
    exchange, every, hidden, pushers, sent = BY_HAND[spec]
    (w,) = workloads(spec, {})
    pattern = w.pattern(P)
    assert (pattern.exchange, pattern.every, pattern.hidden, pattern.pushers) == (
        exchange, every, hidden, pushers)
    cal = Calibration(1e-4, 1, 0.0, 1e9, cores=2)
    assert predict(w, P, 32, int(N / 4), cal, network("100mbit")).bytes_per_step == \
        pytest.approx(sent)


def test_a_half_precision_hook_halves_what_sync_sends():
    (half,) = workloads("sync:compress=fp16", {})
    assert half.pattern(P).size == 0.5


def test_an_emulated_network_is_the_payload_of_its_rate_with_tbf_s_bucket():
    """100 Mbit/s is 12.5 MB/s of frames, of which 1448 of every 1514 bytes are TCP payload;
    tbf's bucket holds 10 ms of the rate (125 kB); the local processes have no link."""
    slow = network("100mbit")
    assert slow.bytes_per_s == pytest.approx(12.5e6 * 1448 / 1514)
    assert slow.burst_bytes == 125_000 and slow.host_cost
    assert network("1gbit").burst_bytes == 1_250_000
    assert network("local").bytes_per_s is None


# -- the fit, on points of a known machine ------------------------------------------------------
#: A calibration with a known alpha and beta (what bench_model.py measures) for this machine's
#: processes and for the emulated cluster's endpoints.
LOCAL = Calibration(140e-6, 1, alpha_host_s=70e-6, host_bytes_per_s=1.5e9, cores=2)
EMULATED = Calibration(140e-6, 1, alpha_host_s=100e-6, host_bytes_per_s=1.0e9, cores=2)
SETTING = Setting(batch=32, params=136_886, cores=2, local=LOCAL, emulated=EMULATED)
#: The machine the synthetic points come from (each value on its grid).
TRUE = Machine(cores=2, contention=0.3, noise=0.2, server_work=4.0, exchange_s=0.0005)
#: Two cores and nothing else: no contention, noise or work.
APART_2 = Machine(cores=2, contention=0.0, noise=0.0, server_work=0.0, exchange_s=0.0)
SPECS = ("sync", "local-sgd:tau=4", "easgd:tau=4", "async-sgd", "groups:groups=2")


def synthetic(machine: Machine) -> list[dict]:
    """The bench's 34 points, as ``machine`` would run them."""
    points = [{"network": net, "strategy": s, "workers": w}
              for net in ("local", "100mbit", "1gbit") for w in (1, 2, 4) for s in SPECS
              if (net == "local" or w > 1) and not (s.startswith("groups") and w < 2)]
    for p, q in zip(points, predicted([{**p, "samples_per_s": 1.0} for p in points], SETTING,
                                      machine), strict=True):
        p["samples_per_s"] = q
    return points


def test_the_fit_finds_the_machine_that_made_the_points():
    points = synthetic(TRUE)
    assert len(points) == 34
    found = fit(points, SETTING)
    assert {k: getattr(found, k) for k in GRIDS} == pytest.approx({k: getattr(TRUE, k) for k in GRIDS})
    assert fit(synthetic(APART_2), SETTING) == APART_2  # nothing to fit: nothing found


def test_held_out_points_are_predicted_by_parameters_that_never_saw_them():
    """Fitted on every other point, the machine predicts the others: within 10% when the
    points come from the model (half the points pin the parameters down less: without the
    local one-worker async-sgd point, an exchange's own time trades off against the server's
    work), and exactly when fitted on all of them; a point that the model cannot explain
    (a run 40% slower than its machine) shows in its held-out error, while the others stay
    close."""
    result = check(synthetic(TRUE), SETTING)
    assert len(result["folds"]) == 2 and result["fitted"] == pytest.approx(
        {k: getattr(TRUE, k) for k in GRIDS})
    assert all(abs(r["error"]) < 1e-6 and abs(r["held_out_error"]) < 0.1
               for r in result["points"])
    points = synthetic(TRUE)
    points[9]["samples_per_s"] *= 0.6
    result = check(points, SETTING)
    odd = result["points"][9]
    assert odd["held_out_error"] > 0.5  # predicted 1 / 0.6 - 1 = 67% above what it measured
    others = [abs(r["held_out_error"]) for i, r in enumerate(result["points"]) if i != 9]
    assert max(others) < 0.2 and sum(e < 0.05 for e in others) >= 25


def test_a_check_needs_points_in_every_fold():
    with pytest.raises(ShoalError, match="at least 2 folds"):
        check(synthetic(TRUE)[:1], SETTING)
    with pytest.raises(ShoalError, match="needs measured points"):
        fit([], SETTING)


def test_two_all_reduces_give_alpha_and_beta():
    """The calibration's two-point fit: 4 bytes cost two latencies (the ring's two messages
    for two processes), ``n`` bytes two latencies plus ``n`` bytes' time."""
    alpha, rate = 70e-6, 1.5e9
    n = 8 << 20
    assert collectives_cost(n, 2 * alpha, 2 * alpha + n / rate) == pytest.approx((alpha, rate))
    with pytest.raises(ShoalError, match="too busy to time it"):
        collectives_cost(n, 1e-3, 1e-3)
