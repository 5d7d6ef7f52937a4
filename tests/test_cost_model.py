"""The cost model of ``shoal plan --simulate``: its formulas against hand-computed alpha-beta
values, unit parsing, the command's simulate.json (an injected calibration: no timing here),
and monotonicity (more bandwidth is never slower)."""

from __future__ import annotations

import json
import math

import pytest

from shoal.cli import main
from shoal.errors import ShoalError
from shoal.plan.simulate import (
    SC17_EFFICIENCY,
    Workload,
    parse_bandwidth,
    parse_latency,
    predict,
    workloads,
)
from shoal.strategies import STRATEGIES
from shoal.strategies.cost import (
    Calibration,
    Link,
    Machine,
    Network,
    broadcast_s,
    exchange_s,
    ring_allreduce_s,
    server_cycle_s,
    slowest,
)

from conftest import one_error_line

#: A calibration with round numbers: 100 us per sample, no endpoint cost to speak of.
CAL = Calibration(compute_s_per_sample=1e-4, threads=1, alpha_host_s=0.0, host_bytes_per_s=1e30,
                  cores=2, source="test")
#: 1 Gbit/s = 125 MB/s, 10 us per message; taken at its nominal values.
GBIT = Network(bytes_per_s=125e6, latency_s=10e-6)
PARAMS = 250_000  # 1 MB of float32


# -- the formulas, by hand ---------------------------------------------------------------------
def test_ring_allreduce_by_hand():
    # p = 4, 1 MB at 125 MB/s, 10 us: 2*3/4 * 8 ms + 6 * 10 us = 12 ms + 60 us
    assert ring_allreduce_s(4, 1e6, 1 / 125e6, 10e-6) == pytest.approx(12.06e-3)
    # p = 2: one message of half the bytes each way, twice: n * beta + 2 alpha
    assert ring_allreduce_s(2, 1e6, 1 / 125e6, 10e-6) == pytest.approx(8e-3 + 20e-6)
    assert ring_allreduce_s(1, 1e6, 1 / 125e6, 10e-6) == 0.0
    # many nodes: the bandwidth term tends to 2 n beta, the latency term grows linearly
    assert ring_allreduce_s(256, 1e6, 1 / 125e6, 0.0) == pytest.approx(2 * 255 / 256 * 8e-3)


def test_other_collectives_by_hand():
    assert broadcast_s(8, 1e6, 1 / 125e6, 10e-6) == pytest.approx(8e-3 + 3 * 10e-6)
    assert broadcast_s(1, 1e6, 1 / 125e6, 10e-6) == 0.0
    assert exchange_s(1e6, 1 / 125e6, 10e-6) == pytest.approx(16e-3 + 20e-6)
    # 8 pushers of 1 MB through 2 servers' links: 8 * 1 MB / (2 * 125 MB/s)
    assert server_cycle_s(8, 1e6, 1 / 125e6, 2) == pytest.approx(32e-3)


def test_sync_prediction_is_compute_plus_ring_allreduce():
    p = predict(Workload.of("sync"), 4, 32, PARAMS, CAL, GBIT)
    compute = 32 * 1e-4
    step = compute + 12.06e-3
    assert p.compute_s == pytest.approx(compute)
    assert p.step_s == pytest.approx(step)
    assert p.samples_per_s == pytest.approx(4 * 32 / step)
    assert p.efficiency == pytest.approx(compute / step)
    assert p.bound == "network"
    one = predict(Workload.of("sync"), 1, 32, PARAMS, CAL, GBIT)
    assert one.step_s == pytest.approx(compute) and one.efficiency == pytest.approx(1.0)


def test_periodic_strategies_amortize_the_allreduce_over_tau():
    compute, ring = 32 * 1e-4, 12.06e-3
    local = predict(Workload.of("local-sgd", tau=4), 4, 32, PARAMS, CAL, GBIT)
    assert local.step_s == pytest.approx(compute + ring / 4)
    assert predict(Workload.of("diloco", tau=4), 4, 32, PARAMS, CAL, GBIT).step_s == local.step_s
    # EASGD hides the all-reduce behind the round's other tau - 1 steps
    easgd = predict(Workload.of("easgd", tau=4), 4, 32, PARAMS, CAL, GBIT)
    assert easgd.step_s == pytest.approx((compute + max(3 * compute, ring)) / 4)
    hidden = predict(Workload.of("easgd", tau=16), 4, 32, PARAMS, CAL, GBIT)
    assert hidden.step_s == pytest.approx(compute) and hidden.efficiency == pytest.approx(1.0)
    exposed = predict(Workload.of("easgd", tau=4, overlap=False), 4, 32, PARAMS, CAL, GBIT)
    assert exposed.step_s == pytest.approx(local.step_s)


def test_parameter_server_queues_when_demand_exceeds_its_link():
    compute, ex = 32 * 1e-4, 16e-3 + 20e-6
    alone = predict(Workload.of("async-sgd"), 1, 32, PARAMS, CAL, GBIT)
    assert alone.step_s == pytest.approx(compute + ex)
    # 64 workers on one server's link: each waits its turn, 64 * 8 ms per cycle
    crowded = predict(Workload.of("async-sgd"), 64, 32, PARAMS, CAL, GBIT)
    assert crowded.step_s == pytest.approx(64 * 8e-3) and crowded.bound == "server"
    assert crowded.samples_per_s == pytest.approx(125e6 / 1e6 * 32)  # the link's exchanges/s
    # k shards: k times the server bandwidth
    sharded = predict(Workload.of("async-sgd", servers=4), 64, 32, PARAMS, CAL, GBIT)
    assert sharded.step_s == pytest.approx(16 * 8e-3)
    # the elastic form exchanges every tau steps
    elastic = predict(Workload.of("async-easgd", tau=4), 2, 32, PARAMS, CAL, GBIT)
    assert elastic.step_s == pytest.approx((4 * compute + ex) / 4)


def test_groups_by_hand():
    # 8 workers in 2 groups of 4: ring inside, broadcast inside, the leader's exchange
    compute = 32 * 1e-4
    inside = ring_allreduce_s(4, 1e6, 1 / 125e6, 10e-6) + broadcast_s(4, 1e6, 1 / 125e6, 10e-6)
    p = predict(Workload.of("groups", groups=2), 8, 32, PARAMS, CAL, GBIT)
    assert p.step_s == pytest.approx(compute + inside + 16e-3 + 20e-6)


def test_a_token_bucket_passes_its_burst_at_the_endpoints_speed():
    """tbf's bucket (the emulated cluster's links): after an idle long enough to refill it,
    a message's first ``burst`` bytes cost only the endpoints' time; a shorter idle refills
    only what the link's rate brings in meanwhile."""
    link = Link(alpha=0.0, beta=1 / 125e6 + 1e-9, burst=250e3, host_beta=1e-9)
    assert link.wire_s(1e6) == pytest.approx(750e3 / 125e6)  # 6 ms: what the bucket does not hold
    assert link.wire_s(200e3) == 0.0
    assert link.wire_s(1e6, idle_s=1e-3) == pytest.approx((1e6 - 125e3) / 125e6)
    # sync on 2 nodes computing 3.2 ms: the bucket refills 400 kB worth, so holds its 250 kB
    tbf = Network(125e6, 0.0, host_cost=True, burst_bytes=250e3)
    cal = Calibration(1e-4, 1, alpha_host_s=0.0, host_bytes_per_s=1e9, cores=2)
    step = predict(Workload.of("sync"), 2, 32, PARAMS, cal, tbf).step_s
    assert step == pytest.approx(32e-4 + 1e6 * 1e-9 + 750e3 / 125e6)
    assert step < predict(Workload.of("sync"), 2, 32, PARAMS, cal, Network(125e6, 0.0, True)).step_s


def test_workers_that_share_cores_queue_for_them():
    """On one machine of 2 cores, 4 synchronous workers compute on half a core each (and
    ``contention`` slower side by side); asynchronous ones drift apart, so the cores bound
    them only by all the work they hold, the server's included."""
    local = Network()
    cal = Calibration(1e-4, 1, alpha_host_s=0.0, host_bytes_per_s=1e12, cores=2)
    machine = Machine(cores=2, contention=0.25, noise=0.0, server_work=0.0)
    sync = predict(Workload.of("sync"), 4, 32, PARAMS, cal, local, machine)
    assert sync.compute_s == pytest.approx(2 * 1.25 * 32e-4)
    assert sync.step_s == pytest.approx(2 * 1.25 * 32e-4, rel=1e-3)
    alone = predict(Workload.of("sync"), 1, 32, PARAMS, cal, local, machine)
    assert alone.step_s == pytest.approx(32e-4, rel=1e-3)  # one process: no contention
    asynchronous = predict(Workload.of("async-sgd"), 4, 32, PARAMS, cal, local, machine)
    assert asynchronous.step_s == pytest.approx(4 * 1.25 * 32e-4 / 2, rel=1e-2)


def test_synchronous_workers_wait_for_the_slowest():
    """A step's compute that varies (``noise``: its standard deviation over its mean) makes
    workers that meet wait for the slowest: ``slowest(p)`` standard deviations of a round
    (sqrt(tau) steps' worth); a hidden exchange has the round's other steps to absorb it,
    and asynchronous workers never wait."""
    assert slowest(1) == 0.0 and slowest(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-4)
    assert slowest(4) == pytest.approx(1.0294, rel=1e-3) and slowest(256) > slowest(64)
    cal = Calibration(1e-4, 1, alpha_host_s=0.0, host_bytes_per_s=1e12, cores=2)
    noisy = Machine(cores=8, contention=0.0, noise=0.5, server_work=0.0)
    c = 32e-4
    sync = predict(Workload.of("sync"), 4, 32, PARAMS, cal, Network(), noisy)
    assert sync.step_s == pytest.approx(c + slowest(4) * 0.5 * c, rel=1e-3)
    local = predict(Workload.of("local-sgd", tau=4), 4, 32, PARAMS, cal, Network(), noisy)
    assert local.step_s == pytest.approx(c + slowest(4) * 0.5 * c * 2 / 4, rel=1e-3)
    easgd = predict(Workload.of("easgd", tau=4), 4, 32, PARAMS, cal, Network(), noisy)
    assert easgd.step_s == pytest.approx(c, rel=1e-3)
    assert predict(Workload.of("async-sgd"), 4, 32, PARAMS, cal, Network(),
                   noisy).step_s < sync.step_s


def test_a_server_works_on_every_exchange():
    """A server's rule costs ``server_work`` endpoint per-byte times per byte of its shard:
    on each exchange's path, and in its queue of every pusher's exchanges."""
    cal = Calibration(1e-4, 1, alpha_host_s=0.0, host_bytes_per_s=1e9, cores=2)
    busy = Machine(cores=None, server_work=10.0)
    free = Machine(cores=None, server_work=0.0)
    one, more = (predict(Workload.of("async-sgd"), 1, 32, PARAMS, cal, Network(), m)
                 for m in (free, busy))
    assert more.step_s - one.step_s == pytest.approx(10.0 * 1e6 * 1e-9)
    crowded = predict(Workload.of("async-sgd"), 64, 32, PARAMS, cal, Network(), busy)
    assert crowded.step_s == pytest.approx(64 * 1e6 * (1e-9 + 10.0 * 1e-9))
    assert crowded.bound == "server"


def test_host_cost_adds_the_calibrated_endpoint():
    cal = Calibration(1e-4, 1, alpha_host_s=50e-6, host_bytes_per_s=1e9, cores=2)
    assert GBIT.alpha(cal) == pytest.approx(10e-6)
    assert GBIT.beta(cal) == pytest.approx(1 / 125e6)
    both = Network(125e6, 10e-6, host_cost=True)
    assert both.alpha(cal) == pytest.approx(60e-6)
    assert both.beta(cal) == pytest.approx(1 / 125e6 + 1 / 1e9)
    local = Network()  # no link: the calibrated cost is all there is
    assert local.alpha(cal) == pytest.approx(50e-6) and local.beta(cal) == pytest.approx(1e-9)


@pytest.mark.parametrize("strategy", ["sync", "local-sgd", "easgd", "diloco", "async-sgd",
                                      "async-easgd", "groups"])
def test_more_bandwidth_or_less_latency_is_never_slower(strategy):
    w, = workloads(strategy, {"tau": 4, "groups": 4})
    for nodes in (1, 2, 4, 16, 64, 256):
        times = [predict(w, nodes, 32, PARAMS, CAL, Network(bw, 5e-6)).step_s
                 for bw in (1e6, 1e7, 1e8, 1e9, 1e10)]
        assert times == sorted(times, reverse=True), (nodes, times)
        lat = [predict(w, nodes, 32, PARAMS, CAL, Network(1e9, a)).step_s
               for a in (1e-3, 1e-4, 1e-5, 0.0)]
        assert lat == sorted(lat, reverse=True), (nodes, lat)


def test_workloads_take_knobs_from_the_spec_then_the_flags():
    ws = workloads("sync,local-sgd:tau=16,easgd,groups:groups=8,async-sgd", {"tau": 8, "servers": 2})
    assert [w.label for w in ws] == ["sync", "local-sgd tau=16", "easgd tau=8", "groups g=8 k=2",
                                     "async-sgd k=2"]
    with pytest.raises(ShoalError, match="no formula for strategy 'hogwild'"):
        workloads("hogwild", {})


def test_spec_options_reach_the_pattern():
    """A spec's options are the strategy's own, parsed as its flags: a half-precision hook
    sends half the bytes, --tau auto starts at 16, --no-overlap waits for the all-reduce."""
    half, plain, auto, exposed = workloads("sync:compress=fp16,sync,local-sgd:tau=auto,"
                                           "easgd:tau=4,overlap=false", {})
    assert [w.label for w in (half, plain, auto, exposed)] == [
        "sync fp16", "sync", "local-sgd tau=16", "easgd tau=4 no-overlap"]
    assert predict(half, 4, 32, PARAMS, CAL, GBIT).bytes_per_step == pytest.approx(
        predict(plain, 4, 32, PARAMS, CAL, GBIT).bytes_per_step / 2)
    assert auto.pattern(4).every == 16 and not exposed.pattern(4).hidden
    with pytest.raises(ShoalError, match=r"--strategies: easgd:overlap=maybe: --overlap must be "
                                         r"true or false"):
        workloads("easgd:overlap=maybe", {})


def test_outer_precision_prices_its_bytes():
    """--outer-precision's messages, by hand: bf16 halves the all-reduce; int4 sends a 4-byte
    scale and 128 bytes of codes per 256 values (132 / 1024 of float32) and is all-gathered,
    which on p = 4 carries what an all-reduce of p / 2 = 2 times as many bytes does."""
    compute, ring = 32 * 1e-4, 12.06e-3  # p = 4, 1 MB: test_ring_allreduce_by_hand
    plain = predict(Workload.of("local-sgd", tau=4), 4, 32, PARAMS, CAL, GBIT)
    half = predict(Workload.of("local-sgd", tau=4, outer_precision="bf16"), 4, 32, PARAMS, CAL,
                   GBIT)
    int4 = predict(Workload.of("diloco", tau=4, outer_precision="int4"), 4, 32, PARAMS, CAL, GBIT)
    assert half.bytes_per_step == pytest.approx(plain.bytes_per_step / 2)
    assert int4.bytes_per_step == pytest.approx(plain.bytes_per_step * 132 / 1024 * 2)
    # the latency term does not shrink with the bytes: 6 alpha = 60 us per ring
    gathered = (ring - 60e-6) * 132 / 1024 * 2 + 60e-6
    assert int4.step_s == pytest.approx(compute + gathered / 4)
    assert STRATEGIES["easgd"].communication(
        STRATEGIES["easgd"].Options(outer_precision="int8"), 2).size == pytest.approx(260 / 1024)


def test_streamed_fragments_by_hand():
    """Streaming DiLoCo: F all-reduces of n / F bytes a round, each waited for H steps after
    it began. p = 4 on 1 Gbit/s: a ring of n bytes is 1.5 n / 125 MB/s + 6 alpha (alpha =
    10 us): 12.06 ms for 1 MB, 3.06 ms for a quarter, 6.06 ms for a half; c = 3.2 ms."""
    c = 32 * 1e-4
    whole = predict(Workload.of("diloco", tau=8), 4, 32, PARAMS, CAL, GBIT)
    assert whole.step_s == pytest.approx((8 * c + 12.06e-3) / 8)
    # four fragments waited for at once: the same bytes, four rings' latency
    four = predict(Workload.of("diloco", tau=8, fragments=4), 4, 32, PARAMS, CAL, GBIT)
    assert four.step_s == pytest.approx((8 * c + 4 * 3.06e-3) / 8)
    assert four.bytes_per_step == pytest.approx(whole.bytes_per_step)
    # one step of overlap hides a quarter's ring (3.06 ms < 3.2 ms) but not a half's
    hidden = predict(Workload.of("diloco", tau=8, fragments=4, overlap_steps=1), 4, 32, PARAMS,
                     CAL, GBIT)
    assert hidden.step_s == pytest.approx(c) and hidden.efficiency == pytest.approx(1.0)
    halves = predict(Workload.of("diloco", tau=8, fragments=2, overlap_steps=1), 4, 32, PARAMS,
                     CAL, GBIT)
    assert halves.step_s == pytest.approx((8 * c + 2 * (6.06e-3 - c)) / 8)
    # overlap alone (one fragment): the whole ring behind H steps
    behind = predict(Workload.of("diloco", tau=8, overlap_steps=2), 4, 32, PARAMS, CAL, GBIT)
    assert behind.step_s == pytest.approx((8 * c + 12.06e-3 - 2 * c) / 8)


PRICED = sorted(n for n, c in STRATEGIES.items() if c.communication(c.Options(), 2) is not None)


def test_every_strategy_but_hogwild_states_its_pattern():
    assert set(STRATEGIES) - set(PRICED) == {"hogwild"}  # one host's shared memory


@pytest.mark.parametrize("strategy", PRICED)
def test_the_planner_and_the_simulator_price_a_strategy_alike(tmp_path, strategy):
    """The planner's estimate of a trial (fitted to a measured sync trial) and --simulate's
    prediction (calibrated to the same compute and link) read the same pattern, and agree."""
    from shoal.config import TrainConfig
    from shoal.plan.planner import Planner, PlanOptions
    from shoal.plan.trials import HARDWARE, Candidate, Trial

    cfg = TrainConfig(model="mlp", dataset="digits", epochs=10, batch_size=16, workers=2,
                      target_accuracy=0.9, progress="none", out=str(tmp_path)).validate()
    planner = Planner(cfg, PlanOptions.of(cfg), NoLauncher(), tmp_path, 2, show=False)
    cal = Calibration(compute_s_per_sample=5e-3 / 16, threads=1, alpha_host_s=0.0,
                      host_bytes_per_s=1e30, source="test")
    net = Network(bytes_per_s=125e6)  # 1 MB: 8 ms a one-way transfer
    sync = predict(Workload.of("sync"), 2, 16, PARAMS, cal, net)
    planner.measured.append(Trial(Candidate("sync", (), 2, None), curve=[(1, 0.5, 1.0)],
                                  epoch_s=sync.step_s * planner.steps_per_epoch,
                                  comm_fraction=sync.comm_s / sync.step_s))
    candidate = Candidate(strategy, (), 2, None)
    assert candidate.pattern() == Workload.of(strategy).pattern(2)
    startup = 0.0 if planner.in_session(candidate) else 10.0
    per_step = (planner.estimate(candidate, HARDWARE) - startup) / planner.steps(candidate, HARDWARE)
    assert per_step == pytest.approx(predict(Workload.of(strategy), 2, 16, PARAMS, cal, net).step_s)


class NoLauncher:
    """A launcher the estimate never calls."""

    timeout = 10.0


def test_the_calibration_times_a_real_all_reduce():
    """Two processes started as shoal starts a job's (core.processes.spawn, core.group):
    a message costs something, and the bandwidth is finite."""
    from shoal.plan.calibrate import measure_collectives

    alpha, bandwidth = measure_collectives(1 << 20, reps=5)
    assert 0 < alpha < 0.1 and 1e6 < bandwidth < 1e12


# -- units ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,expected", [("10gbit", 1.25e9), ("100mbit", 12.5e6),
                                           ("1gbit", 125e6), ("1.5Gbit", 187.5e6),
                                           ("500kbit", 62.5e3)])
def test_bandwidth_units(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize("text,expected", [("5us", 5e-6), ("1ms", 1e-3), ("0.5ms", 5e-4),
                                           ("0us", 0.0), ("2s", 2.0), ("100ns", 1e-7)])
def test_latency_units(text, expected):
    assert parse_latency(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["10", "fast", "10gb", "-1gbit", "0mbit", "10 gigabit", ""])
def test_bad_bandwidth_is_one_line(text):
    with pytest.raises(ShoalError) as err:
        parse_bandwidth(text)
    assert "\n" not in str(err.value) and "--bandwidth must be a rate like 10gbit" in str(err.value)


@pytest.mark.parametrize("text", ["5", "soon", "-5us", "5 minutes", "1h"])
def test_bad_latency_is_one_line(text):
    with pytest.raises(ShoalError) as err:
        parse_latency(text)
    assert "\n" not in str(err.value) and "--latency must be a time like 5us" in str(err.value)


# -- the command -----------------------------------------------------------------------------------
TINY = ["--model", "mlp", "--dataset", "synthetic", "--synthetic-shape", "1x4x4",
        "--synthetic-samples", "64", "--batch-size", "8"]


def _calibration(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"calibration": {"compute_s_per_sample": 2e-5, "threads": 1,
                                                "alpha_host_s": 4e-5, "host_bytes_per_s": 2e9,
                                                "cores": 2}}))
    return str(path)


def test_simulate_writes_simulate_json(tmp_path, capsys):
    out = tmp_path / "sim"
    code = main(["plan", "--simulate", *TINY, "--nodes", "1,64,256", "--bandwidth", "10gbit",
                 "--latency", "5us", "--strategies", "sync,local-sgd:tau=8,async-sgd",
                 "--calibration", _calibration(tmp_path), "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| strategy | nodes | samples/s | efficiency |" in printed
    assert "Expected to beat SC17's 91.5%" in printed
    data = json.loads((out / "simulate.json").read_text())
    assert data["schema"] == 1 and data["model"] == "mlp" and data["batch_per_worker"] == 8
    assert data["bytes"] == 4 * data["params"] > 0
    assert data["network"]["bytes_per_s"] == pytest.approx(1.25e9)
    assert data["network"]["latency_s"] == pytest.approx(5e-6)
    assert data["network"]["host_cost"] is False
    assert data["effective"]["alpha_s"] == pytest.approx(5e-6)
    assert data["calibration"]["compute_s_per_sample"] == pytest.approx(2e-5)
    assert data["calibration"]["source"].startswith("--calibration")
    assert data["sc17_efficiency"] == SC17_EFFICIENCY and data["beats_sc17_at"] == 256
    rows = data["predictions"]
    assert [(r["label"], r["nodes"]) for r in rows] == [
        (label, n) for label in ("sync", "local-sgd tau=8", "async-sgd k=1") for n in (1, 64, 256)]
    keys = {"label", "strategy", "tau", "groups", "servers", "nodes", "batch_per_worker", "step_s",
            "compute_s", "comm_s", "comm_fraction", "samples_per_s", "efficiency", "bound",
            "bytes_per_step"}
    for r in rows:
        assert set(r) == keys
        assert 0 < r["efficiency"] <= 1 + 1e-9 and r["samples_per_s"] > 0
    assert set(data["beats_sc17"]) <= {r["label"] for r in rows}
    for label in data["beats_sc17"]:
        assert next(r for r in rows if r["label"] == label and r["nodes"] == 256)["efficiency"] \
            >= SC17_EFFICIENCY
    # the calibration of one run serves the next, and a second run does not replace the file
    code = main(["plan", "--simulate", *TINY, "--calibration", str(out / "simulate.json"),
                 "--out", str(out)])
    assert code == 2
    assert "already holds a simulate.json; pass --overwrite" in one_error_line(capsys.readouterr().err)
    assert main(["plan", "--simulate", *TINY, "--calibration", str(out / "simulate.json"),
                 "--out", str(out), "--overwrite"]) == 0


def test_simulate_leaves_other_files_alone(tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["plan", "--simulate", *TINY, "--calibration", _calibration(tmp_path),
                 "--out", str(out)]) == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "simulate.json"]


@pytest.mark.parametrize("args,message", [
    (["--bandwidth", "10gb"], "--bandwidth must be a rate like 10gbit"),
    (["--latency", "5"], "--latency must be a time like 5us"),
    (["--nodes", "64,x"], "--nodes must be positive node counts"),
    (["--nodes", "0"], "--nodes must be positive node counts"),
    (["--strategies", "hogwild"], "no formula for strategy 'hogwild'"),
    (["--strategies", "sync,nosuch"], "nosuch"),
    (["--strategies", "local-sgd:tau=0"], "tau must be at least 1"),
])
def test_simulate_bad_input_is_one_line(tmp_path, capsys, args, message):
    code = main(["plan", "--simulate", *TINY, "--calibration", _calibration(tmp_path),
                 "--out", str(tmp_path / "s"), *args])
    assert code == 2
    assert message in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "s" / "simulate.json").exists()


def test_simulate_flags_need_simulate(tmp_path, capsys):
    assert main(["plan", *TINY, "--nodes", "64", "--out", str(tmp_path / "p")]) == 2
    assert "--nodes belong(s) to --simulate" in one_error_line(capsys.readouterr().err)


def test_bad_calibration_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"compute_s_per_sample": "fast"}))
    assert main(["plan", "--simulate", *TINY, "--calibration", str(bad),
                 "--out", str(tmp_path / "s")]) == 2
    assert "a calibration needs numbers" in one_error_line(capsys.readouterr().err)
