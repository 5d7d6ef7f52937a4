"""Each asynchronous strategy equals its paper's algorithm, written in the paper's own
variables, for workers interleaved in a fixed order.

A least-squares problem in float64 is trained by one or two workers in this process, each a
strategy of its own whose ``comm.ps`` is a :class:`~ps_doubles.LoopbackClient` onto one
server state (one or two shards): the events of ``ORDER`` run worker after worker (worker 0
steps, worker 1 steps, worker 1 steps, ...), so every exchange meets the server in a known
order. The references below replay the same order from the published update rules with
analytic gradients: no torch.optim, no autograd, no shoal. Momentum is the classic
``v <- mu v - eta g; x <- x + v`` (Sutskever), at a constant rate where the local step is the
optimizer's. Every worker's parameters and the server's vector must match to 1e-12.

- async-sgd: Downpour SGD (Dean et al. 2012) / Async SGD (You et al. 2017).
- async-msgd: the same, the server with heavy-ball momentum (Async MSGD).
- async-easgd, hogwild-easgd: Zhang, Choromanska & LeCun (2015) Algorithm 1, asynchronous.
- async-measgd: the same paper's Algorithm 2 (EAMSGD), with a non-monotone schedule.
- hogwild: Niu et al. (2011) Algorithm 1, gradients read before another worker's write.
- groups: Omnivore's compute groups (Hadjis et al. 2016), one worker per group here (groups
  of several workers meet through a process group of their own: tests/test_groups.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

import shoal
from shoal.core.comm import Comm
from shoal.core.env import Environment
from shoal.core.ops import split_sizes
from shoal.strategies import get_strategy, make_options
from shoal.strategies.hogwild import PATH_KEY, create_shared_file

from ps_doubles import LoopbackClient

DIM, BATCH, STEPS, LR = 5, 12, 8, 0.05
SCHEDULE = (1.0, 0.6, 1.4, 0.3, 1.0, 2.0, 0.5, 0.8)  # factors of LR by a worker's own step
#: The order of the workers' steps: each worker takes STEPS steps.
ORDER = {1: [0] * STEPS, 2: [0, 1, 1, 0, 0, 0, 1, 0, 1, 1, 1, 0, 1, 0, 0, 1]}

# name: (strategy, options, workers, servers, momentum, weight decay, schedule?)
CASES = {
    "async-sgd-1": ("async-sgd", {}, 1, 1, 0.0, 0.0, True),
    "async-sgd-2": ("async-sgd", {}, 2, 1, 0.0, 0.0, True),
    "async-sgd-2-decay-shards": ("async-sgd", {"servers": 2}, 2, 2, 0.9, 0.01, True),
    "async-msgd-2": ("async-msgd", {}, 2, 1, 0.9, 0.0, False),
    "async-msgd-2-decay-shards": ("async-msgd", {"servers": 2}, 2, 2, 0.8, 0.01, False),
    "async-msgd-2-schedule": ("async-msgd", {}, 2, 1, 0.9, 0.0, True),
    "async-easgd-1": ("async-easgd", {"tau": 1, "alpha": 0.5}, 1, 1, 0.0, 0.0, True),
    "async-easgd-2-t1": ("async-easgd", {"tau": 1}, 2, 1, 0.0, 0.0, False),
    "async-easgd-2-t3": ("async-easgd", {"tau": 3, "alpha": 0.3}, 2, 2, 0.0, 0.0, True),
    "async-easgd-2-momentum": ("async-easgd", {"tau": 2, "alpha": 0.4}, 2, 1, 0.9, 0.01, False),
    "async-measgd-2-t1": ("async-measgd", {"tau": 1, "alpha": 0.5}, 2, 1, 0.9, 0.0, False),
    "async-measgd-2-t3": ("async-measgd", {"tau": 3}, 2, 2, 0.9, 0.01, True),
    "async-measgd-1-t2": ("async-measgd", {"tau": 2, "alpha": 0.3}, 1, 1, 0.8, 0.0, True),
    "hogwild-easgd-2-t2": ("hogwild-easgd", {"tau": 2, "alpha": 0.3}, 2, 2, 0.0, 0.0, True),
    "groups-2-of-2": ("groups", {"groups": 2}, 2, 1, 0.9, 0.01, True),
    "groups-1-of-1-shards": ("groups", {"servers": 2}, 1, 2, 0.8, 0.0, True),
    "async-sgd-2-dc": ("async-sgd", {"delay_compensation": 2.0}, 2, 1, 0.9, 0.0, True),
    "async-msgd-2-dc-decay-shards": ("async-msgd", {"servers": 2, "delay_compensation": 2.0},
                                     2, 2, 0.8, 0.01, False),
    "groups-2-of-2-dc": ("groups", {"groups": 2, "delay_compensation": 0.5}, 2, 1, 0.9, 0.01,
                         True),
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


def rows(step: int, worker: int, workers: int) -> slice:
    base = step * BATCH
    return slice(base + worker * BATCH // workers, base + (worker + 1) * BATCH // workers)


# -- through shoal -------------------------------------------------------------------------
class Server:
    """The server's state in this process: the vector in shards and one rule per shard."""

    def __init__(self, name: str, options: dict, workers: int, servers: int) -> None:
        cls = get_strategy(name)
        init = problem()[2]
        sizes = split_sizes(init.numel(), servers)
        self.ranges = [(sum(sizes[:s]), sum(sizes[:s + 1])) for s in range(servers)]
        self.centers = [init[lo:hi].clone() for lo, hi in self.ranges]
        opts = make_options(cls, options, workers)
        self.rules = [cls.Rule(c, opts) for c in self.centers] if cls.Rule is not None else None

    def vector(self) -> torch.Tensor:
        return torch.cat(self.centers)

    def client(self, worker: int) -> LoopbackClient:
        return LoopbackClient(self.rules, self.centers, self.ranges, client=worker)


class Worker:
    """One worker: its model, optimizer, schedule and strategy, on its own Comm."""

    def __init__(self, case: str | tuple, worker: int, comm: Comm) -> None:
        name, options, workers, _, momentum, decay, _ = CASES[case] if isinstance(case, str) else case
        self.worker, self.workers = worker, workers
        init = problem()[2]
        self.model = torch.nn.Linear(DIM, 1).double().to(comm.device)
        with torch.no_grad():
            self.model.weight.copy_(init[:DIM].view(1, DIM))
            self.model.bias.copy_(init[DIM:])
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=momentum,
                                         weight_decay=decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda t: SCHEDULE[min(t, STEPS - 1)])
        self.strategy = shoal.strategy(name, self.model, self.optimizer, comm=comm, **options)
        self.t = 0

    def gradient(self) -> None:
        x, y, _ = problem()
        batch = rows(self.t, self.worker, self.workers)
        xb, yb = x[batch].to(self.params().device), y[batch].to(self.params().device)
        self.strategy.zero_grad()
        loss = torch.nn.functional.mse_loss(self.strategy.module(xb).squeeze(1), yb)
        self.strategy.backward(loss)

    def step(self, schedule: bool) -> None:
        self.strategy.step()
        if schedule:
            self.scheduler.step()
        self.t += 1

    def params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])


def worker_comm(worker: int, workers: int, client, device: str = "cpu") -> Comm:
    comm = Comm(Environment(rank=worker, world_size=workers, local_world_size=workers),
                torch.device(device))
    comm.ps = client
    return comm


def run_case(case: str, restart_at: int | None = None, device: str = "cpu"
             ) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """Run case ``case`` in the order ``ORDER`` (gradient, then step); with ``restart_at``,
    every worker is made anew after that many events from what a checkpoint keeps of it
    (:meth:`checkpoint_own`, the model of the center, its schedule), as a resumed worker is,
    against the same server state."""
    name, options, workers, servers, _, _, schedule = CASES[case]
    server = Server(name, options, workers, servers)
    team = [Worker(case, w, worker_comm(w, workers, server.client(w), device))
            for w in range(workers)]
    for event, w in enumerate(ORDER[workers]):
        if event == restart_at:
            center = {"weight": server.vector()[:DIM].view(1, DIM), "bias": server.vector()[DIM:]}
            saved = [(copy.deepcopy(m.strategy.checkpoint_own()),
                      copy.deepcopy(m.scheduler.state_dict()), m.t) for m in team]
            team = [Worker(case, k, worker_comm(k, workers, server.client(k), device))
                    for k in range(workers)]
            for member, (own, sched, t) in zip(team, saved, strict=True):
                member.strategy.restore_checkpoint({"model": center}, own)
                member.scheduler.load_state_dict(sched)
                member.t = t
        team[w].gradient()
        team[w].step(schedule)
    return {"center": server.vector(), "workers": [m.params().cpu() for m in team],
            "steps": [m.strategy.steps for m in team], "clock": [m.strategy.clock for m in team]}


# -- the references, from the papers ---------------------------------------------------------
def grad(p: torch.Tensor, step: int, worker: int, workers: int) -> torch.Tensor:
    """Gradient of worker ``worker``'s mean((xb w + b - yb)^2) at ``p = [w, b]``."""
    x, y, _ = problem()
    xb, yb = x[rows(step, worker, workers)], y[rows(step, worker, workers)]
    r = xb @ p[:DIM] + p[DIM] - yb
    return torch.cat([2 * xb.T @ r, (2 * r.sum()).view(1)]) / len(yb)


def reference_async_sgd(case: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Downpour SGD, one push and one fetch per step. Worker i: g <- grad at x^i (what it
    last fetched); the server on arrival: x <- x - eta (g + lambda x); the worker: x^i <- x.
    The worker's momentum is not the server's business."""
    _, _, workers, _, _, lam, schedule = CASES[case]
    x = problem()[2]
    xi = [x.clone() for _ in range(workers)]
    t = [0] * workers
    for i in ORDER[workers]:
        g = grad(xi[i], t[i], i, workers)
        x = x - lr_at(t[i], schedule) * (g + lam * x)
        xi[i] = x.clone()
        t[i] += 1
    return x, xi


def reference_async_msgd(case: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Async MSGD: Downpour whose server keeps one velocity for all pushes. At a constant
    rate, classic momentum on the pushed gradient (with decay): u <- mu u - eta (g + lambda x),
    x <- x + u. Under a schedule, the documented form (torch.optim.SGD's): v <- mu v + g',
    x <- x - eta_t v."""
    _, _, workers, _, mu, lam, schedule = CASES[case]
    x = problem()[2]
    xi = [x.clone() for _ in range(workers)]
    u = torch.zeros_like(x)
    t = [0] * workers
    for i in ORDER[workers]:
        g = grad(xi[i], t[i], i, workers) + lam * x
        if schedule:
            u = mu * u + g
            x = x - lr_at(t[i], schedule) * u
        else:
            u = mu * u - LR * g
            x = x + u
        xi[i] = x.clone()
        t[i] += 1
    return x, xi


def reference_elastic(case: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Zhang, Choromanska & LeCun (2015), Algorithms 1 (EASGD: delta = 0, the gradient at x;
    here with the optimizer's classic momentum mu when asked) and 2 (EAMSGD: Nesterov delta),
    asynchronous: worker i, at its own step t^i,

        x = x^i
        if tau divides t^i:  a) x^i <- x^i - alpha (x - x~)    b) x~ <- x~ + alpha (x - x~)
        v^i <- delta v^i - eta g(x + delta v^i)      (EASGD: v^i <- mu v^i - eta g(x))
        x^i <- x^i + v^i

    with a) and b) against the master's x~ at that moment. Returns the center and what the
    workers' models hold (EAMSGD: the look-ahead x^i + delta v^i)."""
    kind, options, workers, _, mu, lam, schedule = CASES[case]
    tau, alpha = options["tau"], options.get("alpha", 0.9 / workers)
    nesterov = kind == "async-measgd"
    center = problem()[2]
    xs = [center.clone() for _ in range(workers)]
    vs = [torch.zeros_like(center) for _ in range(workers)]
    t = [0] * workers
    for i in ORDER[workers]:
        x = xs[i].clone()
        if t[i] % tau == 0:
            read = center.clone()
            xs[i] = xs[i] - alpha * (x - read)
            center = center + alpha * (x - read)
        at = x + mu * vs[i] if nesterov else x
        vs[i] = mu * vs[i] - lr_at(t[i], schedule) * (grad(at, t[i], i, workers) + lam * at)
        xs[i] = xs[i] + vs[i]
        t[i] += 1
    return center, [xs[i] + mu * vs[i] for i in range(workers)] if nesterov else xs


def reference_compute_groups(case: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Omnivore's compute groups, asynchronous across groups: group k (here worker k alone)
    takes the gradient of its rows at x_k, the last parameters it read; the server, as each
    group's push arrives: v <- mu v + (g_k + lambda x), x <- x - eta_t v; then x_k <- x."""
    _, _, workers, _, mu, lam, schedule = CASES[case]
    x = problem()[2]
    xk = [x.clone() for _ in range(workers)]
    v = torch.zeros_like(x)
    t = [0] * workers
    for k in ORDER[workers]:
        v = mu * v + grad(xk[k], t[k], k, workers) + lam * x
        x = x - lr_at(t[k], schedule) * v
        xk[k] = x.clone()
        t[k] += 1
    return x, xk


def reference_delay_compensated(case: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """DC-ASGD-a (Zheng et al. 2017, the server's side of its algorithm, with the adaptive
    lambda_t): the server keeps w_bak(m) <- w for each worker m whenever it sends
    it w (its first pull, then each reply); on worker m's push of g_m, taken at w_bak(m):

        MeanSquare <- 0.95 MeanSquare + 0.05 g_m * g_m
        lambda_t = lambda_0 / (sqrt(MeanSquare) + 1e-7)           (elementwise)
        g~ = g_m + lambda_t * g_m * g_m * (w - w_bak(m))

    and steps w with g~ (+ weight decay) as the strategy would with g_m: plain SGD for
    async-sgd (the workers' momentum is not the server's), heavy ball v <- mu v + g~,
    w <- w - eta_t v for async-msgd and groups."""
    name, options, workers, _, mu, decay, schedule = CASES[case]
    lambda_0, m = options["delay_compensation"], 0.95
    mu = 0.0 if name == "async-sgd" else mu
    w = problem()[2]
    w_bak = [w.clone() for _ in range(workers)]
    mean_square, v = torch.zeros_like(w), torch.zeros_like(w)
    t = [0] * workers
    for k in ORDER[workers]:
        g = grad(w_bak[k], t[k], k, workers)
        mean_square = m * mean_square + (1 - m) * g * g
        lambda_t = lambda_0 / (mean_square.sqrt() + 1e-7)
        g_tilde = g + lambda_t * g * g * (w - w_bak[k])
        v = mu * v + g_tilde + decay * w
        w = w - lr_at(t[k], schedule) * v
        w_bak[k] = w.clone()
        t[k] += 1
    return w, w_bak


REFERENCES = {"groups": reference_compute_groups, "async-sgd": reference_async_sgd,
              "async-msgd": reference_async_msgd, "async-easgd": reference_elastic,
              "async-measgd": reference_elastic, "hogwild-easgd": reference_elastic}


@pytest.mark.filterwarnings("error::UserWarning")  # a scheduler sees optimizer.step() as called
@pytest.mark.parametrize("case", list(CASES))
def test_strategy_matches_its_paper(case):
    got = run_case(case)
    name, options = CASES[case][:2]
    reference = reference_delay_compensated if options.get("delay_compensation") else \
        REFERENCES[name]
    center, workers = reference(case)
    torch.testing.assert_close(got["center"], center, atol=1e-12, rtol=0, msg="server's vector")
    for i, x in enumerate(workers):
        torch.testing.assert_close(got["workers"][i], x, atol=1e-12, rtol=0,
                                   msg=f"worker {i}'s parameters")
    assert got["steps"] == [STEPS] * CASES[case][2]
    tau = CASES[case][1].get("tau", 1)
    assert got["clock"] == [-(-STEPS // tau)] * CASES[case][2]  # one exchange per tau steps


@pytest.mark.parametrize("case, at", [("async-sgd-2-decay-shards", 5), ("async-msgd-2", 7),
                                      ("groups-2-of-2", 6),
                                      ("async-easgd-2-t3", 7), ("async-measgd-2-t3", 9),
                                      ("async-measgd-1-t2", 3), ("hogwild-easgd-2-t2", 6)])
def test_restart_from_checkpoint_changes_nothing(case, at):
    """What a worker's checkpoint keeps (model, optimizer, x^i, v^i, steps, exchanges) is all
    there is: made anew from it, against the same server, the run ends where it would have."""
    whole, restarted = run_case(case), run_case(case, restart_at=at)
    assert torch.equal(whole["center"], restarted["center"])
    for a, b in zip(whole["workers"], restarted["workers"], strict=True):
        assert torch.equal(a, b)
    assert whole["clock"] == restarted["clock"]


@pytest.mark.parametrize("name", ["async-sgd", "async-easgd", "async-measgd"])
def test_a_worker_new_to_the_checkpoint_starts_from_the_center(name):
    case = (name, {"tau": 2} if name != "async-sgd" else {}, 2, 1, 0.9, 0.0, False)
    server = Server(name, case[1], 2, 1)
    server.centers[0].add_(0.25)  # the center has moved since the workers' models were made
    member = Worker(case, 1, worker_comm(1, 2, server.client(1)))
    torch.testing.assert_close(member.params(), server.vector(), atol=0, rtol=0)  # the PULL
    member.model.weight.data.add_(1.0)
    center = {"weight": server.vector()[:DIM].view(1, DIM), "bias": server.vector()[DIM:]}
    member.strategy.restore_checkpoint({"model": center}, None)
    torch.testing.assert_close(member.params(), server.vector(), atol=0, rtol=0)
    if name == "async-measgd":
        torch.testing.assert_close(member.strategy.x, server.vector(), atol=0, rtol=0)
        assert not member.strategy.v.any()


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["async-sgd-2-decay-shards", "async-msgd-2-schedule",
                                  "async-easgd-2-t3", "async-measgd-2-t3"])
def test_a_gpu_worker_exchanges_through_host_buffers(case):
    """The servers' shards live in host memory; a model on a GPU sends and receives through
    host buffers of its own, and ends where the paper's algorithm does (and a CPU run)."""
    got = run_case(case, device="cuda")
    center, workers = REFERENCES[CASES[case][0]](case)
    torch.testing.assert_close(got["center"], center, atol=1e-12, rtol=0)
    for i, x in enumerate(workers):
        torch.testing.assert_close(got["workers"][i], x, atol=1e-12, rtol=0)


# -- hogwild ---------------------------------------------------------------------------------
def test_hogwild_alone_is_sgd_on_a_shared_tensor():
    """One process, no coordinator: an anonymous shared tensor, plain SGD steps."""
    comm = Comm(Environment(), torch.device("cpu"))
    member = Worker(("hogwild", {}, 1, 1, 0.0, 0.0, False), 0, comm)
    assert member.strategy.shared.is_shared()
    x = problem()[2]
    for t in range(STEPS):
        member.gradient()
        member.step(schedule=False)
        x = x - LR * grad(x, t, 0, 1)
    torch.testing.assert_close(member.params(), x, atol=1e-12, rtol=0)
    torch.testing.assert_close(member.strategy.shared, x, atol=1e-12, rtol=0)


def test_hogwild_workers_write_one_vector_without_a_lock(tmp_path):
    """Niu et al. (2011) Algorithm 1 for two workers on the coordinator's shared file: each
    reads x and evaluates its gradient; the other may write x in between; each then writes
    x_v <- x_v - gamma G(x)_v in place, with the gradient of the x it read."""
    init, workers = problem()[2], 2
    path = create_shared_file(init, str(tmp_path))
    store = torch.distributed.HashStore()
    store.set(PATH_KEY, path)
    team = []
    for w in range(workers):
        comm = worker_comm(w, workers, object())  # a coordinator exists (no server rule)
        comm.store = store
        team.append(Worker(("hogwild", {}, workers, 1, 0.0, 0.0, True), w, comm))
    # g0 g1 s1 s0: worker 0 reads, worker 1 reads and writes, worker 0 writes a stale step
    events = [(0, "g"), (1, "g"), (1, "s"), (0, "s"), (0, "g"), (0, "s"), (1, "g"), (0, "g"),
              (0, "s"), (1, "s"), (1, "g"), (1, "s")]
    x, t, read = init.clone(), [0, 0], {}
    for w, what in events:
        if what == "g":
            team[w].gradient()
            read[w] = grad(x, t[w], w, workers)
        else:
            team[w].step(schedule=True)
            x = x - lr_at(t[w], True) * read[w]
            t[w] += 1
    for member in team:
        torch.testing.assert_close(member.params(), x, atol=1e-12, rtol=0)
    on_disk = torch.from_file(path, shared=False, size=init.numel(), dtype=torch.float64)
    torch.testing.assert_close(on_disk, x, atol=1e-12, rtol=0)
