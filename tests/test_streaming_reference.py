"""Streaming exchanges equal their paper's algorithm, written in its own variables.

Streaming DiLoCo (Douillard et al. 2025): the parameters in fragments p = 1..F, fragment p's
outer step lands after inner step p tau / F of every period of tau steps, its pseudo-gradient
Delta_p = mean_m(theta_p - theta_{m,p}) taken H steps earlier (overlap), the outer Nesterov
step on theta_p, then theta_{m,p} <- alpha theta_{m,p} + (1 - alpha) theta_p (theta_p itself
when H = 0). The same least-squares problem as tests/test_strategy_reference.py, float64, on
1, 2 and 3 real Gloo workers through ``shoal.strategy``; the references simulate the workers
serially with analytic gradients and no shoal code. Compressed cases use the hand-written
int4 code of tests/test_quantize.py with error feedback. Local SGD's and EASGD's fragments
follow the same schedule (no mixing: the update applies when the exchange lands). Every
case also restarts from saved state mid-flight and must not notice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from test_quantize import reference_scaled
from test_strategy_reference import DIM, LR, STEPS, grad, problem, results_by_world, rows

import shoal
from shoal.core.comm import Comm
from shoal.core.dynamo import eager

TAU = 4
# name: (strategy, options, inner momentum, restart after this many steps)
CASES = {
    "diloco-f2": ("diloco", {"fragments": 2}, 0.0, 3),
    "diloco-f2-h1": ("diloco", {"fragments": 2, "overlap_steps": 1}, 0.9, 3),
    "diloco-f1-h2": ("diloco", {"overlap_steps": 2, "mix_alpha": 0.3}, 0.0, 5),
    "diloco-f2-h1-alpha0": ("diloco", {"fragments": 2, "overlap_steps": 1, "mix_alpha": 0.0},
                            0.0, 5),
    "diloco-f2-h1-int4": ("diloco", {"fragments": 2, "overlap_steps": 1,
                                     "outer_precision": "int4"}, 0.0, 5),
    "local-sgd-f2-h1": ("local-sgd", {"fragments": 2, "overlap_steps": 1}, 0.0, 3),
    "local-sgd-f2-int4": ("local-sgd", {"fragments": 2, "outer_precision": "int4"}, 0.0, 5),
    "easgd-f2-h1": ("easgd", {"fragments": 2, "overlap_steps": 1, "alpha": 0.3}, 0.0, 3),
}
OUTER_LR, OUTER_MU = 0.7, 0.9


def options_of(case: tuple) -> dict:
    kind, options, _, _ = case
    extra = {"outer_lr": OUTER_LR, "outer_momentum": OUTER_MU} if kind == "diloco" else {}
    return {"tau": TAU, **extra, **options}


def linear_model(init: torch.Tensor) -> torch.nn.Module:
    """x w + b: one layer, ``init = [w, b]``."""
    model = torch.nn.Linear(DIM, 1).double()
    with torch.no_grad():
        model.weight.copy_(init[:-1].view(1, -1))
        model.bias.copy_(init[-1:])
    return model


@dataclass(frozen=True)
class Geometry:
    """A model in the paper's variables: its parameter vector at the start, worker ``k``'s
    gradient at ``p`` for step ``t`` of ``world`` workers, fragment ``p``'s indices of the
    vector (``fragments(count, pattern)[p]``), and the same model through shoal."""

    init: torch.Tensor
    grad: Callable[[torch.Tensor, int, int, int], torch.Tensor]
    fragments: Callable[[int, str], list]
    build: Callable[[torch.Tensor], torch.nn.Module]


#: Linear(5, 1): weight | bias
LINEAR = Geometry(problem()[2], grad, lambda count, pattern: FRAGMENTS[count], linear_model)


def run_case(name: str, comm: Comm, restart_at: int | None = None, cases: dict = CASES,
             geometry: Geometry = LINEAR) -> dict:
    kind, _, momentum, _ = cases[name]
    x, y, _ = problem()

    def make() -> tuple:
        model = geometry.build(geometry.init)
        # torch's SGD built and stepped as shoal train's is, leaving torch._dynamo unimported:
        # 1-3 CPU-s less in each of the processes these cases run in.
        optimizer = eager(torch.optim.SGD)(model.parameters(), lr=LR, momentum=momentum)
        return model, optimizer, shoal.strategy(kind, model, optimizer, comm=comm,
                                                **options_of(cases[name]))

    model, optimizer, strategy = make()
    for step in range(STEPS):
        if step == restart_at:
            saved = [o.state_dict() for o in (model, optimizer, strategy)]
            model, optimizer, strategy = make()
            for o, state in zip((model, optimizer, strategy), saved, strict=True):
                o.load_state_dict(state)
        batch = rows(step, comm.rank, comm.world_size)
        loss = torch.nn.functional.mse_loss(strategy.module(x[batch]).squeeze(1), y[batch])
        strategy.backward(loss)
        strategy.step()
        strategy.zero_grad()
    strategy.end_epoch(0)
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()]).tolist()  # noqa: E731
    return {"x": flat(model), "eval": flat(strategy.eval_module)}


def run_cases(comm: Comm) -> dict:
    return {name: run_case(name, comm) for name in CASES} | {
        f"{name}-restarted": run_case(name, comm, CASES[name][3]) for name in CASES}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, list[dict]]:
    return results_by_world(tmp_path_factory, run_cases)


# -- the references ----------------------------------------------------------------------------
FRAGMENTS = {1: [slice(0, 6)], 2: [slice(0, 5), slice(5, 6)]}  # Linear(5, 1): weight | bias


def schedule(count: int, overlap: int) -> tuple[dict[int, int], dict[int, int]]:
    """Fragment p (0-based) -> the step offset its exchange starts after, and lands after."""
    lands = {p: (p + 1) * TAU // count % TAU for p in range(count)}
    return {p: (lands[p] - overlap) % TAU for p in range(count)}, lands


def inner_steps(xs, vs, t, mu, gradient=grad):
    for k in range(len(xs)):
        vs[k] = mu * vs[k] - LR * gradient(xs[k], t, k, len(xs))
        xs[k] = xs[k] + vs[k]


def average(parts: list[torch.Tensor], errors: list[torch.Tensor] | None, frag: slice):
    """(1/M) sum_m of what each worker sends: exactly, or int4 with error feedback e_m."""
    if errors is None:
        return sum(parts) / len(parts)
    sent = []
    for m, part in enumerate(parts):
        want = part + errors[m][frag]
        got = reference_scaled(want, 7).double()
        errors[m][frag] = want - got
        sent.append(got)
    return sum(sent) / len(sent)


def reference_streaming_diloco(name: str, world: int, close: bool = True, cases: dict = CASES,
                               geometry: Geometry = LINEAR) -> tuple[list, torch.Tensor]:
    """Streaming DiLoCo, Sutskever's Nesterov outer step per fragment (see the docstring):
    v_p <- mu v_p - lr Delta_p, theta_S,p <- theta_S,p + v_p, theta_p = theta_S,p + mu v_p;
    ``close``: the epoch ends after the last step."""
    _, opts, mu, _ = cases[name]
    count, overlap, alpha = opts.get("fragments", 1), opts.get("overlap_steps", 0), \
        opts.get("mix_alpha", 0.5)
    frags = geometry.fragments(count, opts.get("fragment_pattern", "sequential"))
    starts, lands = schedule(count, overlap)
    init = geometry.init
    theta_s, v = init.clone(), torch.zeros_like(init)
    theta = theta_s + OUTER_MU * v
    xs = [theta.clone() for _ in range(world)]
    vs = [torch.zeros_like(init) for _ in range(world)]
    errors = [torch.zeros_like(init) for _ in range(world)] \
        if opts.get("outer_precision") == "int4" else None
    pending: dict[int, torch.Tensor] = {}
    started = [0] * count

    def land(p):
        frag = frags[p]
        v[frag] = OUTER_MU * v[frag] - OUTER_LR * pending.pop(p)
        theta_s[frag] = theta_s[frag] + v[frag]
        theta[frag] = theta_s[frag] + OUTER_MU * v[frag]
        for m in range(world):
            moved = s > started[p]
            xs[m][frag] = alpha * xs[m][frag] + (1 - alpha) * theta[frag] if moved and alpha \
                else theta[frag]

    def start(p):
        frag = frags[p]
        pending[p] = average([theta[frag] - xs[m][frag] for m in range(world)], errors, frag)
        started[p] = s

    for t in range(STEPS):
        inner_steps(xs, vs, t, mu, geometry.grad)
        s = t + 1
        for p in range(count):
            if s % TAU == starts[p]:
                start(p)
        for p in sorted(pending):
            if s == started[p] + overlap:
                land(p)
    if not close:  # as torchft, which knows no epochs
        return xs, theta
    for p in sorted(pending):  # the epoch's end: what is in flight lands, then every
        land(p)                # fragment that moved since it last started is exchanged
    for p in range(count):
        if s > started[p]:
            start(p)
            land(p)
    return xs, theta


def reference_streaming_local(name: str, world: int, cases: dict = CASES,
                              geometry: Geometry = LINEAR) -> tuple[list, torch.Tensor | None]:
    """Local SGD by fragments: fragment p's average lands H steps after the workers sent it;
    each worker moves by the average minus what it sent (H = 0: becomes the average).
    Compressed: each sends its move from the last average, which every worker holds. EASGD:
    d_m = alpha (x_m - c) at the start; when it lands x_m <- x_m - d_m, c <- c + sum_m d_m."""
    kind, opts, mu, _ = cases[name]
    count, overlap = opts.get("fragments", 1), opts.get("overlap_steps", 0)
    frags = geometry.fragments(count, opts.get("fragment_pattern", "sequential"))
    starts, _ = schedule(count, overlap)
    init = geometry.init
    xs = [init.clone() for _ in range(world)]
    vs = [torch.zeros_like(init) for _ in range(world)]
    anchor, center = init.clone(), init.clone()
    errors = [torch.zeros_like(init) for _ in range(world)] \
        if opts.get("outer_precision") == "int4" else None
    pending: dict[int, tuple[int, list, torch.Tensor]] = {}
    started = [0] * count

    def start(p):
        frag = frags[p]
        sent = [xs[m][frag].clone() for m in range(world)]
        if kind == "easgd":
            pulls = [opts["alpha"] * (sent[m] - center[frag]) for m in range(world)]
            pending[p] = (s, pulls, sum(pulls))
        elif errors is not None:
            anchor[frag] = anchor[frag] + average([x - anchor[frag] for x in sent], errors, frag)
            pending[p] = (s, sent, anchor[frag].clone())
        else:
            pending[p] = (s, sent, sum(sent) / world)
        started[p] = s

    def land(p):
        begun, sent, result = pending.pop(p)
        frag = frags[p]
        for m in range(world):
            if kind == "easgd":
                xs[m][frag] = xs[m][frag] - sent[m]
            else:
                xs[m][frag] = xs[m][frag] + result - sent[m] if s > begun else result.clone()
        if kind == "easgd":
            center[frag] = center[frag] + result

    for t in range(STEPS):
        inner_steps(xs, vs, t, mu, geometry.grad)
        s = t + 1
        for p in range(count):
            if s % TAU == starts[p]:
                start(p)
        for p in sorted(pending):
            if s == pending[p][0] + overlap:
                land(p)
    assert not pending
    if kind != "easgd":  # the epoch's end: every fragment that moved since it started
        for p in range(count):
            if s > started[p]:
                start(p)
                land(p)
    return xs, (center if kind == "easgd" else None)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_streaming_matches_the_paper(results, name, world):
    kind = CASES[name][0]
    reference = reference_streaming_diloco if kind == "diloco" else reference_streaming_local
    assert_as_reference(results[world], name, *reference(name, world))


def assert_as_reference(ranks, name: str, models, evaluated) -> None:
    """Every rank's parameters, and the model it evaluated, are the reference's."""
    for rank, found in enumerate(ranks):
        got = found[name]
        torch.testing.assert_close(torch.tensor(got["x"], dtype=torch.float64), models[rank],
                                   atol=1e-10, rtol=0, msg=f"rank {rank}'s parameters")
        torch.testing.assert_close(torch.tensor(got["eval"], dtype=torch.float64),
                                   models[rank] if evaluated is None else evaluated,
                                   atol=1e-10, rtol=0, msg=f"rank {rank}'s evaluated model")


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_restart_mid_flight_changes_nothing(results, name, world):
    """A checkpoint while an exchange is in flight (or error-feedback residuals are held)
    keeps it: the resumed run is the same run, bit for bit."""
    for rank in range(world):
        assert results[world][rank][f"{name}-restarted"] == results[world][rank][name]
