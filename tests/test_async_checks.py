"""The asynchronous strategies' parts checked alone: the server rules on their own (a
header's fields in, the shard and the reply out, their state), and every misuse refused in
one line before any worker starts: bad options, unusable optimizers, hogwild on CUDA or on
several hosts, a step without a server. Their paper references: test_async_reference.py."""

from __future__ import annotations

import copy

import pytest
import torch

import shoal
from shoal.core.comm import Comm
from shoal.core.env import Environment, set_environment
from shoal.core.header import Header, Kind
from shoal.errors import ShoalError
from shoal.strategies import get_strategy, make_options
from shoal.strategies.async_easgd import ElasticRule
from shoal.strategies.async_msgd import MomentumRule
from shoal.strategies.hogwild_easgd import UnlockedElasticRule

from test_async_reference import DIM, LR, Server, worker_comm


# -- the server rules on their own -----------------------------------------------------------
def header(**fields) -> Header:
    return Header(kind=Kind.EXCHANGE, client=0, fields=fields)


def test_momentum_rule_keeps_its_velocity_in_its_state():
    gen = torch.Generator().manual_seed(1)
    x0, g1, g2 = (torch.randn(7, generator=gen, dtype=torch.float64) for _ in range(3))
    rule = MomentumRule(x0.clone())
    reply = torch.empty_like(x0)
    rule.apply(header(lr=0.1, momentum=0.9, weight_decay=0.01), g1, reply)
    again = MomentumRule(rule.center.clone())
    again.load_state_dict(copy.deepcopy(rule.state_dict()))
    for r in (rule, again):
        r.apply(header(lr=0.05, momentum=0.9, weight_decay=0.01), g2, reply)
    # u <- 0.9 u + g', x <- x - lr u, by hand
    u1 = g1 + 0.01 * x0
    x1 = x0 - 0.1 * u1
    u2 = 0.9 * u1 + g2 + 0.01 * x1
    torch.testing.assert_close(rule.center, x1 - 0.05 * u2, atol=1e-12, rtol=0)
    assert torch.equal(rule.center, again.center) and torch.equal(reply, rule.center)


@pytest.mark.parametrize("rule_cls", [ElasticRule, UnlockedElasticRule])
def test_elastic_rule_replies_the_center_it_used(rule_cls):
    gen = torch.Generator().manual_seed(2)
    center, x = torch.randn(9, generator=gen, dtype=torch.float64), torch.randn(
        9, generator=gen, dtype=torch.float64)
    rule, reply = rule_cls(center.clone()), torch.empty(9, dtype=torch.float64)
    rule.apply(header(alpha=0.3), x, reply)
    assert torch.equal(reply, center)
    torch.testing.assert_close(rule.center, center + 0.3 * (x - center), atol=1e-15, rtol=0)
    assert rule.locked == (rule_cls is ElasticRule)
    assert rule.state_dict() == {}


@pytest.mark.parametrize("on_gpu", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_hogwild_refuses_cuda_in_one_line(on_gpu):
    """The Comm's device says cuda (no GPU needed to see it), or the model is on one."""
    model = torch.nn.Linear(DIM, 1).to("cuda" if on_gpu else "cpu")
    comm = Comm(Environment(), torch.device("cpu" if on_gpu else "cuda"))
    with pytest.raises(ShoalError) as exc:
        shoal.strategy("hogwild", model, torch.optim.SGD(model.parameters(), lr=LR), comm=comm)
    assert str(exc.value) == "hogwild steps parameters shared in host memory, not on cuda: " \
                             "run it with --device cpu"


def test_finite_parameters_stepped_by_another_process_are_seen_finite(tmp_path):
    """Hogwild's shared parameters while another process steps them in place (``add_``): a
    checkpoint's finiteness check must not see a value that changed between two reads as
    non-finite (``torch.isfinite`` on the live vector did, in most checks, and stopped
    hogwild runs at an epoch's end with "parameters became non-finite")."""
    import subprocess
    import sys
    import time

    from shoal.core.ops import all_finite
    from shoal.strategies.hogwild import create_shared_file, map_shared_file

    n = 60_000
    path = create_shared_file(torch.randn(n), str(tmp_path))
    shared = map_shared_file(path, n, torch.float32)
    step = ("import sys, time, torch\n"
            "torch.set_num_threads(1)\n"
            "x = torch.from_file(sys.argv[1], shared=True, size=int(sys.argv[2]))\n"
            "g = torch.randn(x.numel()) * 0.01\n"
            "end = time.time() + 30\n"
            "x.add_(g, alpha=-0.1); print('stepping', flush=True)\n"
            "while time.time() < end:\n"
            "    x.add_(g, alpha=-0.1); g.neg_()\n")
    writer = subprocess.Popen([sys.executable, "-c", step, path, str(n)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "stepping\n"  # (the writer's 30 s bound it)
        seen, end = [], time.monotonic() + 2.0
        while time.monotonic() < end:
            seen.append(all_finite([shared]))
        assert writer.poll() is None, "the writer stopped before the checks ended"
    finally:
        writer.kill()
        writer.wait(timeout=30)
    assert all(seen), f"{seen.count(False)} of {len(seen)} checks saw finite values as not"


def test_hogwild_refuses_several_hosts_in_one_line():
    model = torch.nn.Linear(DIM, 1)
    env = Environment(rank=0, world_size=4, local_world_size=2)
    set_environment(env)
    try:
        with pytest.raises(ShoalError) as exc:
            shoal.strategy("hogwild", model, torch.optim.SGD(model.parameters(), lr=LR),
                           comm=Comm(env, torch.device("cpu")))
    finally:
        set_environment(None)
    assert str(exc.value) == ("hogwild shares the parameters in one host's memory, but this job "
                              "spans several hosts (4 processes, 2 on this one): run it on one "
                              "machine")


# -- options and misuse: one line each, before any worker starts -----------------------------
@pytest.mark.parametrize("name, options, workers, expected", [
    ("async-sgd", {"servers": 0}, 2, "--servers must be at least 1, got 0"),
    ("async-msgd", {"max_staleness": -1}, 2, "--max-staleness must be at least 0, got -1"),
    ("async-sgd", {"max_staleness": 1}, 3,
     "--max-staleness 1 with 3 workers: a worker waits for the 2 others to push, so the bound "
     "must be at least 2 (workers - 1)"),
    ("async-easgd", {"max_staleness": 0}, 2,
     "--max-staleness 0 with 2 workers: a worker waits for the 1 others to push, so the bound "
     "must be at least 1 (workers - 1)"),
    ("async-easgd", {"tau": 0}, 2, "--tau must be at least 1, got 0"),
    ("async-measgd", {"alpha": 1.5}, 2, "--alpha must be in [0, 1], got 1.5"),
    ("async-easgd", {"order": "fifo"}, 2,
     "--order must be one of arrival, round-robin, got 'fifo'"),
    ("async-measgd", {"order": "round-robin"}, 2,
     "--order round-robin is async-easgd's alone (the original EASGD's round-robin master); "
     "this strategy's server takes exchanges in arrival order"),
    ("hogwild-easgd", {"order": "round-robin"}, 2,
     "--order round-robin is async-easgd's alone (the original EASGD's round-robin master); "
     "this strategy's server takes exchanges in arrival order"),
    ("async-sgd", {"tau": 2}, 2,
     "strategy async-sgd does not take --tau (it takes --delay-compensation, --intra-host, "
     "--max-staleness, --servers)"),
    ("async-sgd", {"intra_host": "mpi"}, 2,
     "--intra-host must be one of auto, gloo, shm, got 'mpi'"),
    ("async-msgd", {"delay_compensation": -1.0}, 2,
     "--delay-compensation must be a finite number at least 0, got -1.0"),
    ("groups", {"delay_compensation": float("nan")}, 2,
     "--delay-compensation must be a finite number, got nan"),
    ("async-easgd", {"delay_compensation": 2.0}, 2,
     "strategy async-easgd does not take --delay-compensation (it takes --alpha, "
     "--intra-host, --max-staleness, --order, --servers, --tau)"),
    ("hogwild", {"servers": 2}, 2, "strategy hogwild does not take --servers (it takes no options)"),
])
def test_bad_options_are_one_line(name, options, workers, expected):
    with pytest.raises(ShoalError) as exc:
        make_options(get_strategy(name), options, workers)
    assert str(exc.value) == expected


@pytest.mark.parametrize("name, options", [
    ("async-easgd", {"order": "round-robin", "max_staleness": 3, "servers": 3, "tau": 2}),
    ("async-sgd", {"max_staleness": 3}), ("hogwild-easgd", {"alpha": 0.9}),
])
def test_good_options(name, options):
    made = make_options(get_strategy(name), options, 4)
    assert made.order == options.get("order", "arrival")


@pytest.mark.parametrize("name, optimizer, expected", [
    ("async-sgd", "adam", "async-sgd's server applies SGD steps; the optimizer must be SGD, not Adam"),
    ("async-msgd", "nesterov", "async-msgd's server applies heavy-ball momentum: no --nesterov "
                               "(and no dampening)"),
    ("async-measgd", "plain", "async-measgd needs --momentum > 0 (and no dampening)"),
    ("async-measgd", "adam", "async-measgd takes local steps with SGD, not Adam"),
])
def test_optimizers_a_strategy_cannot_use_are_one_line(name, optimizer, expected):
    model = torch.nn.Linear(DIM, 1)
    opt = {"adam": lambda p: torch.optim.Adam(p),
           "nesterov": lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, nesterov=True),
           "plain": lambda p: torch.optim.SGD(p, lr=LR)}[optimizer](model.parameters())
    with pytest.raises(ShoalError) as exc:
        shoal.strategy(name, model, opt, comm=Comm(Environment(), torch.device("cpu")))
    assert str(exc.value) == expected


def test_groups_with_different_rates_are_refused_at_the_step():
    """The server applies one rate to the whole vector; a schedule may part the groups later."""
    model = torch.nn.Linear(DIM, 1).double()
    server = Server("async-sgd", {}, 1, 1)
    optimizer = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=LR)
    strategy = shoal.strategy("async-sgd", model, optimizer, comm=worker_comm(0, 1, server.client(0)))
    optimizer.param_groups[1]["lr"] = LR / 2
    model(torch.ones(1, DIM, dtype=torch.float64)).sum().backward()
    with pytest.raises(ShoalError, match=r"^async-sgd's server applies one learning rate"):
        strategy.step()


@pytest.mark.parametrize("name", ["async-sgd", "async-msgd", "async-easgd", "async-measgd",
                                  "hogwild-easgd"])
def test_without_a_server_only_the_step_refuses(name):
    """The preflight builds a strategy alone (comm.ps is None); a step then needs a server."""
    model = torch.nn.Linear(DIM, 1)
    strategy = shoal.strategy(name, model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                              comm=Comm(Environment(), torch.device("cpu")))
    assert strategy.topology(strategy.options, 1).detached and not strategy.replicas_in_sync
    model(torch.ones(1, DIM)).sum().backward()
    with pytest.raises(ShoalError) as exc:
        strategy.step()
    assert str(exc.value).startswith(f"strategy {name} trains through a parameter server, and "
                                      "this job has none")
    assert "\n" not in str(exc.value)

