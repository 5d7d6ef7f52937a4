"""Each low-communication strategy equals its paper's algorithm, written in the paper's own
variables.

A least-squares problem in float64 is trained for STEPS steps by 1, 2 and 3 real Gloo workers
through ``shoal.strategy(...)``. The references below simulate the same workers serially with
analytic gradients, straight from the published update rules: no torch.optim, no autograd,
no collectives, and no PyTorch conventions (momentum is the classic ``v <- mu v - eta g;
x <- x + v``; Nesterov is Sutskever's, with the gradient taken at the look-ahead point).
Every worker's parameters and the center (EASGD) or global model (DiLoCo) must match to 1e-10.

- local SGD: Stich (2019) eq. 2 / Lin et al. (2020): local steps, the average every tau.
- EASGD: Zhang, Choromanska & LeCun (2015) Algorithm 1, synchronous (eqs. 5-6 at tau = 1).
- EAMSGD: the same paper's Algorithm 2 (Nesterov momentum in x and v), with a constant and a
  non-monotone learning-rate schedule.
- DiLoCo: Douillard et al. (2023) Algorithm 1 with a Nesterov outer step.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import shoal
from shoal.core.comm import Comm
from shoal.core.dynamo import eager
from shoal.core.env import Environment
from shoal.core.processes import spawn
from shoal.core.timeline import WAIT
from shoal.errors import ShoalError

DIM, BATCH, STEPS, LR = 5, 12, 12, 0.05
#: A non-monotone schedule (factors of LR by step): the relation between Nesterov's look-ahead
#: point and x depends on the learning rate of the step that made it.
SCHEDULE = (1.0, 0.6, 1.4, 0.3, 1.0, 2.0, 0.5, 0.8, 1.2, 0.4, 1.0, 0.7)

# name: (strategy, options, momentum of the local steps, learning-rate schedule?). Where the
# local step is your optimizer's (all but eamsgd), schedules go with plain SGD only: classic
# momentum and PyTorch's agree only at a constant learning rate, and that is the optimizer's
# business, not the strategy's.
CASES = {
    "local-sgd-t1-plain": ("local-sgd", {"tau": 1}, 0.0, False),
    "local-sgd-t1": ("local-sgd", {"tau": 1}, 0.9, False),
    "local-sgd-t3": ("local-sgd", {"tau": 3}, 0.9, False),
    "local-sgd-t3-measure-wait": ("local-sgd", {"tau": 3, "measure_wait": True}, 0.9, False),
    "easgd-t1": ("easgd", {"tau": 1}, 0.0, False),
    "easgd-t3": ("easgd", {"tau": 3, "alpha": 0.3}, 0.0, False),
    "easgd-t5-schedule": ("easgd", {"tau": 5, "alpha": 0.5}, 0.0, True),
    "easgd-t2-no-overlap": ("easgd", {"tau": 2, "overlap": False}, 0.0, False),
    "easgd-t2-momentum": ("easgd", {"tau": 2, "alpha": 0.4}, 0.9, False),  # shoal's default
    "easgd-alpha0": ("easgd", {"tau": 2, "alpha": 0.0}, 0.0, False),
    "eamsgd-t1": ("eamsgd", {"tau": 1, "alpha": 0.5}, 0.9, False),
    "eamsgd-t3": ("eamsgd", {"tau": 3, "alpha": 0.5}, 0.9, False),
    "eamsgd-t2-schedule": ("eamsgd", {"tau": 2, "alpha": 0.3}, 0.9, True),
    "eamsgd-t5-schedule": ("eamsgd", {"tau": 5}, 0.8, True),
    "eamsgd-alpha0-schedule": ("eamsgd", {"tau": 2, "alpha": 0.0}, 0.9, True),
    "diloco-t2": ("diloco", {"tau": 2, "outer_lr": 0.7, "outer_momentum": 0.9}, 0.0, False),
    "diloco-t3": ("diloco", {"tau": 3, "outer_lr": 0.5, "outer_momentum": 0.5}, 0.9, False),
    "diloco-t5-schedule": ("diloco", {"tau": 5, "outer_lr": 0.7, "outer_momentum": 0.9}, 0.0, True),
    "diloco-as-local-sgd": ("diloco", {"tau": 3, "outer_lr": 1.0, "outer_momentum": 0.0}, 0.9, False),
}


def lr_at(t: int, schedule: bool) -> float:
    return LR * SCHEDULE[t] if schedule else LR


def problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Data for STEPS global batches, and the initial parameter vector [w..., b]."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH, DIM, generator=gen, dtype=torch.float64)
    y = x @ torch.randn(DIM, generator=gen, dtype=torch.float64) + 0.1 * torch.randn(
        STEPS * BATCH, generator=gen, dtype=torch.float64)
    return x, y, 0.1 * torch.randn(DIM + 1, generator=gen, dtype=torch.float64)


def rows(step: int, rank: int, world: int) -> slice:
    base = step * BATCH
    return slice(base + rank * BATCH // world, base + (rank + 1) * BATCH // world)


# -- through shoal -------------------------------------------------------------------------
def run_case(name: str, comm: Comm, restart_at: int | None = None) -> dict[str, list[float]]:
    """Train case ``name``; with ``restart_at``, stop after that many steps, make everything
    anew from the saved states (as a resumed run does) and go on."""
    kind, options, momentum, schedule = CASES[name]
    x, y, init = problem()

    def make() -> tuple:
        model = torch.nn.Linear(DIM, 1).double()
        with torch.no_grad():
            model.weight.copy_(init[:DIM].view(1, DIM))
            model.bias.copy_(init[DIM:])
        # torch's SGD built and stepped as shoal train's is, leaving torch._dynamo unimported:
        # 1-3 CPU-s less in each of the processes these cases run in.
        optimizer = eager(torch.optim.SGD)(model.parameters(), lr=LR, momentum=momentum)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                      lambda t: SCHEDULE[min(t, STEPS - 1)])
        return model, optimizer, scheduler, shoal.strategy(kind, model, optimizer, comm=comm,
                                                           **options)

    model, optimizer, scheduler, strategy = make()
    waited = comm.timeline.totals.get(WAIT, 0.0)
    for step in range(STEPS):
        if step == restart_at:
            saved = [copy.deepcopy(o.state_dict()) for o in (model, optimizer, scheduler, strategy)]
            model, optimizer, scheduler, strategy = make()
            for o, state in zip((model, optimizer, scheduler, strategy), saved, strict=True):
                o.load_state_dict(state)
        batch = rows(step, comm.rank, comm.world_size)
        loss = torch.nn.functional.mse_loss(strategy.module(x[batch]).squeeze(1), y[batch])
        strategy.backward(loss)
        strategy.step()
        if schedule:
            scheduler.step()
        strategy.zero_grad()
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()]).tolist()  # noqa: E731
    return {"x": flat(model), "eval": flat(strategy.eval_module),
            "waited": comm.timeline.totals.get(WAIT, 0.0) > waited}


#: Cases restarted from saved state mid-run: at a step where EASGD's pull is still to be
#: applied (6 = 2 x 3), mid-round, and under a schedule.
RESTARTS = {"local-sgd-t3": 4, "easgd-t3": 6, "easgd-t2-momentum": 4, "eamsgd-t3": 6,
            "eamsgd-t2-schedule": 4, "eamsgd-t5-schedule": 7, "diloco-t3": 4}


def run_cases(comm: Comm) -> dict:
    results: dict = {name: run_case(name, comm) for name in CASES}
    results["restarted"] = {name: run_case(name, comm, at) for name, at in RESTARTS.items()}
    results["stability"] = elastic_stability(comm)
    results["start"] = starting_points(comm)
    return results


def elastic_stability(comm: Comm) -> str:
    """What shoal.strategy says to alpha = 0.9 on this many workers (beta = 0.9 x workers)."""
    model = torch.nn.Linear(DIM, 1)
    try:
        shoal.strategy("easgd", model, torch.optim.SGD(model.parameters(), lr=LR), comm=comm,
                       alpha=0.9)
    except ShoalError as exc:
        return str(exc)
    return "ok"


def starting_points(comm: Comm) -> dict[str, list[float]]:
    """Each strategy's model right after it is made from a model that differs by rank."""
    found = {}
    for name in sorted(shoal.STRATEGIES):
        torch.manual_seed(100 + comm.rank)
        model = torch.nn.Linear(DIM, 1)
        shoal.strategy(name, model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                       comm=comm)
        found[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    return found


def run_all(out_dir: str, cases) -> None:
    """One rank of a job: ``cases(comm)``'s results, written as this rank's JSON."""
    comm = shoal.init(device="cpu")
    Path(out_dir, f"rank{comm.rank}.json").write_text(json.dumps(cases(comm)))
    shoal.shutdown()


def results_by_world(tmp_path_factory, cases) -> dict[int, list[dict]]:
    """world size -> each rank's results of ``cases`` (a module-level function of a Comm),
    in this process alone and in jobs of 2 and 3 real processes."""
    found = {1: [cases(Comm(Environment(), torch.device("cpu")))]}
    for world in (2, 3):
        out = tmp_path_factory.mktemp(f"world{world}")
        spawn(world, run_all, (str(out), cases))
        found[world] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    return found


@pytest.fixture(scope="module")
def shoal_results(tmp_path_factory) -> dict[int, list[dict]]:
    """world size -> each rank's results for every case."""
    return results_by_world(tmp_path_factory, run_cases)


# -- the references, from the papers ---------------------------------------------------------
def grad(p: torch.Tensor, step: int, worker: int, world: int) -> torch.Tensor:
    """Gradient of worker ``worker``'s mean((xb w + b - yb)^2) at ``p = [w, b]``."""
    x, y, _ = problem()
    xb, yb = x[rows(step, worker, world)], y[rows(step, worker, world)]
    r = xb @ p[:DIM] + p[DIM] - yb
    return torch.cat([2 * xb.T @ r, (2 * r.sum()).view(1)]) / len(yb)


def local_steps(xs: list[torch.Tensor], vs: list[torch.Tensor], t: int, mu: float,
                schedule: bool) -> None:
    """Step t of every worker k alone, classic momentum: v^k <- mu v^k - eta_t g^k(x^k),
    x^k <- x^k + v^k (plain SGD for mu = 0)."""
    for k in range(len(xs)):
        vs[k] = mu * vs[k] - lr_at(t, schedule) * grad(xs[k], t, k, len(xs))
        xs[k] = xs[k] + vs[k]


def reference_local_sgd(name: str, world: int) -> tuple[list[torch.Tensor], None]:
    """Stich (2019) eq. 2: x^k <- x^k - eta g^k (here with classic momentum v^k, kept local,
    when mu > 0); after every tau-th step every x^k <- (1/K) sum_k x^k."""
    _, options, mu, schedule = CASES[name]
    init = problem()[2]
    x = [init.clone() for _ in range(world)]
    v = [torch.zeros_like(init) for _ in range(world)]
    for t in range(STEPS):
        local_steps(x, v, t, mu, schedule)
        if (t + 1) % options["tau"] == 0:
            mean = sum(x) / world
            x = [mean.clone() for _ in range(world)]
    return x, None


def reference_elastic(name: str, world: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Algorithms 1 (delta = 0) and 2 of Zhang, Choromanska & LeCun (2015), every worker
    communicating at the same step against the same center (the synchronous form):

        x = x^i
        if tau divides t:  a) x^i <- x^i - alpha (x - x~)    b) x~ <- x~ + alpha (x - x~)
        v^i <- delta v^i - eta g(x + delta v^i)       (EAMSGD; EASGD: the gradient at x)
        x^i <- x^i + v^i

    Returns what the workers' models hold (EAMSGD: the look-ahead x + delta v, where the next
    gradient is taken) and the center. shoal starts step t's communication at the end of
    step t - 1, so after STEPS steps the center has b) of t = STEPS and a) is still to come.
    """
    kind, options, delta, schedule = CASES[name]
    tau = options["tau"]
    alpha = options.get("alpha", 0.9 / world)
    nesterov = kind == "eamsgd"
    init = problem()[2]
    xs = [init.clone() for _ in range(world)]
    vs = [torch.zeros_like(init) for _ in range(world)]
    center = init.clone()
    for t in range(STEPS + 1):
        x = [xi.clone() for xi in xs]
        if t % tau == 0:
            pulls = [alpha * (x[i] - center) for i in range(world)]
            if t < STEPS:
                xs = [xs[i] - pulls[i] for i in range(world)]
            center = center + sum(pulls)
        if t == STEPS:
            break
        for i in range(world):
            at = x[i] + delta * vs[i] if nesterov else x[i]
            vs[i] = delta * vs[i] - lr_at(t, schedule) * grad(at, t, i, world)
            xs[i] = xs[i] + vs[i]
    models = [xs[i] + delta * vs[i] for i in range(world)] if nesterov else xs
    return models, center


def reference_diloco(name: str, world: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Douillard et al. (2023) Algorithm 1. Each round every worker starts from theta
    (line 3) and takes tau inner steps (line 7; classic momentum, its velocity kept across
    rounds as an inner optimizer's state is); Delta = mean(theta - theta_i) (lines 9, 11);
    the outer step (line 12) is Sutskever's Nesterov momentum with Delta as the gradient at
    the look-ahead point: v <- mu v - lr Delta, theta_S <- theta_S + v, theta = theta_S + mu v.
    """
    _, options, mu, schedule = CASES[name]
    tau, outer_lr, outer_mu = options["tau"], options["outer_lr"], options["outer_momentum"]
    init = problem()[2]
    theta_s, outer_v = init.clone(), torch.zeros_like(init)
    theta = theta_s + outer_mu * outer_v
    xs = [theta.clone() for _ in range(world)]
    vs = [torch.zeros_like(init) for _ in range(world)]
    for t in range(STEPS):
        local_steps(xs, vs, t, mu, schedule)
        if (t + 1) % tau == 0:
            outer_grad = sum(theta - xi for xi in xs) / world
            outer_v = outer_mu * outer_v - outer_lr * outer_grad
            theta_s = theta_s + outer_v
            theta = theta_s + outer_mu * outer_v
            xs = [theta.clone() for _ in range(world)]
    return xs, theta


REFERENCES = {"local-sgd": reference_local_sgd, "easgd": reference_elastic,
              "eamsgd": reference_elastic, "diloco": reference_diloco}


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_strategy_matches_its_paper(shoal_results, name, world):
    models, evaluated = REFERENCES[CASES[name][0]](name, world)
    for rank in range(world):
        got = shoal_results[world][rank][name]
        torch.testing.assert_close(torch.tensor(got["x"], dtype=torch.float64), models[rank],
                                   atol=1e-10, rtol=0, msg=f"rank {rank}'s parameters")
        torch.testing.assert_close(torch.tensor(got["eval"], dtype=torch.float64),
                                   models[rank] if evaluated is None else evaluated,
                                   atol=1e-10, rtol=0, msg=f"rank {rank}'s evaluated model")


@pytest.mark.parametrize("world", [2, 3])
def test_limiting_cases(shoal_results, world):
    res = shoal_results[world][0]
    # local SGD, tau=1, plain SGD == synchronous SGD on the global batch
    x, y, p = problem()
    for step in range(STEPS):
        p = p - LR * grad(p, step, 0, 1)
    torch.testing.assert_close(torch.tensor(res["local-sgd-t1-plain"]["x"], dtype=torch.float64), p)
    # EASGD with alpha = 0: the center stays where it started
    torch.testing.assert_close(torch.tensor(res["easgd-alpha0"]["eval"], dtype=torch.float64),
                               problem()[2])
    # --measure-wait books time as waiting for peers and changes nothing else
    assert res["local-sgd-t3-measure-wait"]["waited"] and not res["local-sgd-t3"]["waited"]
    # DiLoCo with outer lr 1 and no momentum == local SGD with the same tau
    torch.testing.assert_close(torch.tensor(res["diloco-as-local-sgd"]["x"], dtype=torch.float64),
                               torch.tensor(res["local-sgd-t3"]["x"], dtype=torch.float64))


def test_eamsgd_with_alpha0_is_nesterov_sgd(shoal_results):
    """With no coupling, every EAMSGD worker is Sutskever's Nesterov momentum alone, under a
    schedule too: v <- mu v - eta_t g(x + mu v), x <- x + v (the model holds x + mu v)."""
    _, _, mu, _ = CASES["eamsgd-alpha0-schedule"]
    for world in (1, 2):
        for rank in range(world):
            x, v = problem()[2], torch.zeros(DIM + 1, dtype=torch.float64)
            for t in range(STEPS):
                v = mu * v - lr_at(t, True) * grad(x + mu * v, t, rank, world)
                x = x + v
            got = shoal_results[world][rank]["eamsgd-alpha0-schedule"]["x"]
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), x + mu * v,
                                       atol=1e-10, rtol=0)


@pytest.mark.parametrize("world, expected", [
    (1, "ok"), (2, "ok"),  # beta = 0.9, 1.8
    (3, "--alpha 0.9 with 3 workers gives beta = 2.7; the center update needs alpha * workers <= 2"),
])
def test_unstable_elastic_center_is_refused_at_run_time(shoal_results, world, expected):
    """Through shoal.strategy the number of workers is known only when the job runs: every
    rank refuses, with the arithmetic, before training starts."""
    assert {r["stability"] for r in shoal_results[world]} == {expected}


@pytest.mark.parametrize("world", [2, 3])
def test_every_worker_starts_from_rank_0s_model(shoal_results, world):
    """x^i = x~ (EASGD's initialization), theta_i = theta (DiLoCo's line 3), one x_0 (local
    SGD, and DDP for sync), even when the workers' own models start apart."""
    torch.manual_seed(100)
    rank0 = torch.cat([p.detach().reshape(-1) for p in torch.nn.Linear(DIM, 1).parameters()])
    for name in shoal.STRATEGIES:
        for rank in range(world):
            got = torch.tensor(shoal_results[world][rank]["start"][name])
            torch.testing.assert_close(got, rank0, atol=0, rtol=0, msg=f"{name}, rank {rank}")


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", list(RESTARTS))
def test_restart_from_saved_state_changes_nothing(shoal_results, name, world):
    """What a checkpoint keeps (model, optimizer, scheduler, strategy state) is all there is:
    EASGD's pending pull, EAMSGD's x and v, DiLoCo's outer momentum."""
    for rank in range(world):
        assert shoal_results[world][rank]["restarted"][name] == shoal_results[world][rank][name]


#: Every case above as the code before --fragments, --overlap-steps and --outer-precision
#: computed it (``main`` at a3be51b; regenerate only on purpose).
GOLDEN = Path(__file__).parent / "data" / "periodic_golden.json"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_plain_rounds_are_the_earlier_code(shoal_results, world):
    """One fragment, no overlap, fp32: every number equal to the earlier code's to 12
    significant digits (JSON keeps Python floats exactly). Bit for bit on the CPU that
    recorded them; one with wider vector units (AVX-512) rounds a sum's last bit otherwise
    (1.478856257497385 against 1.4788562574973851), which a golden file cannot follow."""
    golden = json.loads(GOLDEN.read_text())[str(world)]
    for rank in range(world):
        for name in CASES:
            got, want = shoal_results[world][rank][name], golden[rank][name]
            assert (got["x"], got["eval"]) == (pytest.approx(want["x"], rel=1e-12, abs=1e-15),
                                               pytest.approx(want["eval"], rel=1e-12, abs=1e-15)), \
                f"{name}, rank {rank}"
