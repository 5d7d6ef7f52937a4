"""Parallel functions and collectives give the serial answer (one session of 2 processes)."""

from __future__ import annotations

import os
import time
import uuid

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.errors import ShoalError, WorkerError

from conftest import marked_processes

pytestmark = pytest.mark.timeout(60)
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def session():
    marker = uuid.uuid4().hex
    os.environ["SHOAL_TEST_MARKER"] = marker  # inherited by the spawned workers
    try:
        s = shoal.fork(2, timeout=30)
    finally:
        del os.environ["SHOAL_TEST_MARKER"]
    yield s
    shoal.close()
    deadline = time.monotonic() + 10
    while [p for p in marked_processes(marker) if p != os.getpid()] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in marked_processes(marker) if p != os.getpid()] == [], "stray workers"


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# -- functions used below (module level: the workers import them by reference) ---------------
def mean_rows(x):
    return x.mean(0)


def sum_rows(x):
    return x.sum(0)


def prod_rows(x):
    return x.prod(0)


def min_rows(x):
    return x.min(0).values


def max_rows(x):
    return x.max(0).values


def double(x):
    return x * 2


def rows_here(x):
    return x.shape[0]


SERIAL = {
    "avg": (mean_rows, lambda x: x.mean(0)),
    "sum": (sum_rows, lambda x: x.sum(0)),
    "prod": (prod_rows, lambda x: x.prod(0)),
    "min": (min_rows, lambda x: x.min(0).values),
    "max": (max_rows, lambda x: x.max(0).values),
    "gather": (double, lambda x: x * 2),
}


def data(rows: int = 7, cols: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 1 + 0.1 * torch.randn(rows, cols, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("mode", list(SERIAL))
@pytest.mark.parametrize("rows", [8, 7])  # even and uneven splits
def test_reduce_mode_equals_serial(session, mode, rows):
    fn, serial = SERIAL[mode]
    x = data(rows)
    f = shoal.function(fn, scatter=["x"], reduce=mode)
    torch.testing.assert_close(f(x), serial(x), **TOL)


def test_reduce_none_returns_rank0_value(session):
    f = shoal.function(rows_here, scatter=["x"], reduce=None)
    assert f(data(7)) == 4  # rank 0 takes the larger share of an uneven split


@pytest.mark.parametrize("mode", ["avg", "sum", "prod", "min", "max", "gather"])
def test_num_slices_equals_serial(session, mode):
    fn, serial = SERIAL[mode]
    x = data(23)
    f = shoal.function(fn, scatter=["x"], reduce=mode)
    torch.testing.assert_close(f(x, num_slices=3), serial(x), **TOL)


def weighted_loss(x, y, w):
    return F.mse_loss(x @ w, y), (x @ w - y).abs().max(), x.shape[0]


def test_batch_indexes_shared_data(session):
    x, y, w = data(50, 4), data(50, 1, seed=1), data(4, 1, seed=2)
    xs, ys = shoal.shared(x), shoal.shared(y)
    f = shoal.function(weighted_loss, scatter=["x", "y"], broadcast=["w"], reduce=["avg", "max", "sum"])
    idx = torch.randperm(50, generator=torch.Generator().manual_seed(3))[:29]
    loss, worst, n = f(xs, ys, w, batch=idx)
    torch.testing.assert_close(loss, F.mse_loss(x[idx] @ w, y[idx]), **TOL)
    torch.testing.assert_close(worst, (x[idx] @ w - y[idx]).abs().max(), **TOL)
    assert n == 29
    # plain tensors take batch= too, and slices combine with it
    loss2, _, _ = f(x, y, w, batch=idx.tolist(), num_slices=2)
    torch.testing.assert_close(loss2, loss, **TOL)


def structured(x):
    return {"stats": (x.sum(0), [x.min(), x.max()]), "count": float(x.shape[0]), "rows": x}


def test_structured_outputs(session):
    x = data(9)
    f = shoal.function(structured, scatter=["x"], reduce={"stats": "sum", "count": "sum", "rows": "gather"})
    out = f(x)
    torch.testing.assert_close(out["stats"][0], x.sum(0), **TOL)
    torch.testing.assert_close(out["stats"][1][0], x[:5].min() + x[5:].min(), **TOL)  # sum over ranks
    assert out["count"] == 9.0 and isinstance(out["count"], float)
    torch.testing.assert_close(out["rows"], x)


def test_lambda_and_closure_functions(session):
    scale = torch.tensor(3.0, dtype=torch.float64)
    f = shoal.function(lambda x: (x * scale).sum(0), scatter=["x"], reduce="sum")
    x = data(5)
    torch.testing.assert_close(f(x), (x * 3).sum(0), **TOL)


def test_broadcast_and_plain_arguments(session):
    def affine(x, w, b, *, shift=0.0):
        return x @ w + b + shift

    f = shoal.function(affine, scatter=["x"], broadcast=["w"], reduce="gather")
    x, w = data(6, 3), data(3, 2, seed=5)
    torch.testing.assert_close(f(x, w, 1.5, shift=2.0), x @ w + 3.5, **TOL)
    torch.testing.assert_close(f(x, w, 0.5), x @ w + 0.5, **TOL)  # changed plain argument
    unlisted = shoal.function(affine, scatter=["x"], reduce="gather")  # w goes as a broadcast too
    torch.testing.assert_close(unlisted(x, w, torch.tensor(0.5, dtype=x.dtype)), x @ w + 0.5, **TOL)


# -- collectives inside a function -----------------------------------------------------------
def collectives_inside(x):
    r = rank()
    summed = shoal.all_reduce(x.sum(0).clone(), op="sum")
    averaged = shoal.all_reduce(x.sum(0).clone(), op="avg")
    largest = shoal.all_reduce(x.max(0).values.clone(), op="max")
    everything = shoal.all_gather(x)
    at_root = shoal.gather(x)
    reduced = shoal.reduce(x.sum(0).clone(), op="sum")
    source = torch.full((3,), float(r + 1), dtype=x.dtype)
    shoal.broadcast(source)
    table = torch.arange(10.0, dtype=x.dtype).reshape(5, 2) * (r + 1)  # rank 0's is read
    part = shoal.scatter(table)
    return summed, averaged, largest, everything, at_root, reduced, source, part


def test_collectives_inside_function(session):
    x = data(7)
    f = shoal.function(collectives_inside, scatter=["x"],
                       reduce=[None, None, None, None, None, None, "gather", "gather"])
    summed, averaged, largest, everything, at_root, reduced, source, part = f(x)
    torch.testing.assert_close(summed, x.sum(0), **TOL)
    torch.testing.assert_close(averaged, x.sum(0) / 2, **TOL)
    torch.testing.assert_close(largest, x.max(0).values, **TOL)
    torch.testing.assert_close(everything, x)
    torch.testing.assert_close(at_root, x)
    torch.testing.assert_close(reduced, x.sum(0), **TOL)
    torch.testing.assert_close(source, torch.ones(6, dtype=x.dtype))  # both ranks got rank 0's
    torch.testing.assert_close(part, torch.arange(10.0, dtype=x.dtype).reshape(5, 2))


def both_ways(x):
    """Each collective through the session's path and through Gloo, on rank-specific values
    (odd sizes, uneven dim 0s for the gathers, every dtype a function may move); returns
    whether the path is there, whether every result equals Gloo's, and the Gloo calls the
    collectives made (none: they went through the host's memory)."""
    import torch.distributed as dist

    from shoal.parallel.hostsums import host_path

    gloo = {name: getattr(dist, name) for name in
            ("all_reduce", "reduce", "broadcast", "gather", "all_gather", "scatter")}
    made: list[str] = []

    def counted(name):
        def call(*args, **kwargs):
            made.append(name)
            return gloo[name](*args, **kwargs)
        return call

    r, equal = rank(), []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool):
        summed = dtype.is_floating_point
        for n in (1, 7, 1001, 5000):
            mine = (torch.randn(n + r, 3, generator=torch.Generator().manual_seed(r * 100 + n),
                                dtype=torch.float64) * 50).to(dtype)  # rank 1: a row more
            same = mine[:n].contiguous()  # alike in shape on every rank
            ref = {"broadcast": same.clone(), "reduce": same.clone(), "all_reduce": same.clone()}
            gloo["broadcast"](ref["broadcast"], src=1)
            if summed:
                gloo["reduce"](ref["reduce"], dst=1)
                gloo["all_reduce"](ref["all_reduce"])
            padded = torch.cat([mine, mine.new_zeros(1, 3)]) if r == 0 else mine
            rows = [torch.empty_like(padded) for _ in range(2)]
            gloo["all_gather"](rows, padded)
            ref["all_gather"] = torch.cat([rows[0][:n], rows[1]])
            table = torch.cat([same, same + 1 if summed else same.logical_not()])
            ref["scatter"] = torch.empty_like(same)
            gloo["scatter"](ref["scatter"], list(table.split(n)) if r == 0 else None, src=0)
            for name in gloo:
                setattr(dist, name, counted(name))
            try:
                got = {"broadcast": shoal.broadcast(same.clone(), src=1),
                       "all_gather": shoal.all_gather(mine), "scatter": shoal.scatter(table)}
                at_root = shoal.gather(mine, dst=0)
                if summed:
                    got["reduce"] = shoal.reduce(same.clone(), dst=1)
                    got["all_reduce"] = shoal.all_reduce(same.clone())
            finally:
                for name, op in gloo.items():
                    setattr(dist, name, op)
            if r == 0:
                equal.append(torch.equal(at_root, ref["all_gather"]))
            else:
                equal.append(at_root is None)
            equal += [torch.equal(got[k], ref[k]) for k in got if k != "reduce" or r == 1]
    return host_path() is not None, all(equal), len(made)


def test_collectives_in_a_session_go_through_the_hosts_memory_and_equal_gloos(session):
    """Every rank of a 2-process session on one host moves CPU tensors through its shared
    memory (no Gloo call): its sums and reduce are bit for bit Gloo's (with 2 ranks the
    order of a sum is moot), its broadcast, gathers and scatter too, every dtype."""
    f = shoal.function(both_ways, scatter=["x"], reduce="gather")
    taken, equal, made = f(data(2))
    assert list(taken) == [True, True] and list(equal) == [True, True]
    assert list(made) == [0, 0]


def collective_mismatch(x):
    return shoal.all_reduce(torch.ones(3 + rank()))


def test_collective_shape_mismatch_raises_on_every_rank(session):
    f = shoal.function(collective_mismatch, scatter=["x"], reduce=None)
    with pytest.raises(ShoalError, match=r"rank 0: .*float32\[3\].*rank 1: .*float32\[4\]"):
        f(data(4))
    assert f is not None and shoal.function(sum_rows, scatter=["x"], reduce="sum")(data(4)).shape == (3,)


# -- modules: in-place updates and collectives from the controller ---------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)
        self.register_buffer("seen", torch.zeros(()))


def sgd_step(model, x, y, n):
    model.zero_grad()
    F.cross_entropy(model.fc(x), y, reduction="sum").div(n).backward()
    shoal.all_reduce([p.grad for p in model.parameters()], op="sum")
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
    model.seen += x.shape[0]
    return F.cross_entropy(model.fc(x), y)


def test_in_place_updates_match_serial_training(session):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 4, generator=g), torch.randint(0, 3, (40,), generator=g)
    parallel, serial = Net(), Net()
    step = shoal.function(sgd_step, scatter=["x", "y"], reduce="avg")
    xs, ys = shoal.shared(x), shoal.shared(y)
    for epoch in range(3):
        for idx in torch.randperm(40, generator=torch.Generator().manual_seed(epoch)).split(15):
            step(parallel, xs, ys, len(idx), batch=idx)
            serial.zero_grad()
            F.cross_entropy(serial.fc(x[idx]), y[idx]).backward()
            with torch.no_grad():
                for p in serial.parameters():
                    p -= 0.5 * p.grad
    for a, b in zip(parallel.parameters(), serial.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # every replica took the same steps: gathering the weight shows two equal copies
    both = shoal.gather(parallel.fc.weight)
    torch.testing.assert_close(both[:3], both[3:])
    assert shoal.gather(parallel.seen).tolist() == [63.0, 57.0]  # rows each rank saw (a buffer)


def perturb(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(float(rank() + 1))


def test_collectives_on_module_replicas_from_controller(session):
    model = Net()
    base = [p.detach().clone() for p in model.parameters()]
    bump = shoal.function(perturb, reduce=None)
    bump(model)  # rank r adds r + 1 to its replica
    copies = shoal.gather(model)[:2]  # weight and bias (then the buffer): both replicas, concatenated
    for b, c in zip(base, copies, strict=True):
        torch.testing.assert_close(c, torch.cat([b + 1, b + 2]))
    shoal.all_reduce(model, op="avg")
    for b, p in zip(base, model.parameters(), strict=True):
        torch.testing.assert_close(p, b + 1.5)
    bump(model)
    shoal.reduce(model.parameters(), op="max")  # rank 0 gets the elementwise max, rank 1 keeps
    for b, p in zip(base, model.parameters(), strict=True):
        torch.testing.assert_close(p, b + 3.5)
    shoal.broadcast(model)  # rank 0's values everywhere
    for b, c in zip(base, shoal.gather(model.parameters()), strict=True):
        torch.testing.assert_close(c, torch.cat([b + 3.5, b + 3.5]))
    bump(model)
    shoal.all_reduce(model.parameters(), op="avg")  # the spelling: a generator of parameters
    for b, c in zip(base, shoal.gather(model.parameters()), strict=True):
        torch.testing.assert_close(c, torch.cat([b + 5, b + 5]))
    for p in model.parameters():
        p.data.sub_(1.5)  # rank 0 only: back to base + 3.5, then pushed to the replicas
    shoal.broadcast(model)
    everywhere = shoal.all_gather(model.fc.bias)
    torch.testing.assert_close(everywhere, torch.cat([base[1] + 3.5] * 2))
    assert shoal.scatter(model.fc.weight).shape == (2, 4)  # rank 0's share of 3 rows


def test_controller_collective_on_unknown_tensor_is_an_error(session):
    with pytest.raises(ShoalError, match="modules the workers hold"):
        shoal.all_reduce(torch.ones(3))


# -- errors ----------------------------------------------------------------------------------
def fail_on_rank1(x):
    if rank() == 1:
        raise ValueError("boom on the worker")
    return x.sum()


def fail_on_rank0(x):
    if rank() == 0:
        raise KeyError("controller side")
    return x.sum()


def test_worker_exception_carries_rank_and_traceback(session):
    f = shoal.function(fail_on_rank1, scatter=["x"], reduce="sum")
    with pytest.raises(WorkerError) as info:
        f(data(4))
    err = info.value
    assert err.rank == 1
    assert "ValueError: boom on the worker" in str(err) and "fail_on_rank1" in str(err)
    assert "test_parallel.py" in err.traceback and "boom on the worker" in err.traceback
    assert isinstance(err.__cause__, shoal.parallel.RemoteTraceback)
    with pytest.raises(KeyError, match="controller side"):  # rank 0's own error, as raised
        shoal.function(fail_on_rank0, scatter=["x"])(data(4))
    torch.testing.assert_close(f.__class__(sum_rows, scatter=["x"], reduce="sum")(data(4)),
                               data(4).sum(0))  # the session still works


def ragged(x):
    return torch.zeros(2 + rank())


def test_output_shape_mismatch_is_an_error(session):
    f = shoal.function(ragged, scatter=["x"], reduce="sum")
    with pytest.raises(ShoalError, match=r"rank 0: output 0 \(sum\): float32\[2\]; "
                                         r"rank 1: output 0 \(sum\): float32\[3\]"):
        f(data(4))
    # gather accepts different row counts
    g = shoal.function(ragged, scatter=["x"], reduce="gather")
    assert g(data(4)).shape == (5,)


def test_argument_errors(session):
    f = shoal.function(weighted_loss, scatter=["x", "y"], broadcast=["w"])
    with pytest.raises(ShoalError, match="different numbers of rows"):
        f(data(5), data(6), data(3, 1))
    with pytest.raises(ShoalError, match="cannot be split over 2 processes x 4 slices"):
        f(data(5), data(5), data(3, 1), num_slices=4)
    with pytest.raises(ShoalError, match="not a named parameter"):
        shoal.function(weighted_loss, scatter=["z"])
    with pytest.raises(ShoalError, match="unknown reduce mode"):
        shoal.function(weighted_loss, reduce="median")


def optimizer_step(model, opt, x, y, n):
    opt.zero_grad()
    F.cross_entropy(model.fc(x), y, reduction="sum").div(n).backward()
    shoal.all_reduce([p.grad for p in model.parameters()], op="sum")
    opt.step()


def test_optimizer_replicas_keep_their_state(session):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(30, 4, generator=g), torch.randint(0, 3, (30,), generator=g)
    parallel, serial = Net(), Net()
    popt = torch.optim.SGD(parallel.parameters(), lr=0.3, momentum=0.9)
    sopt = torch.optim.SGD(serial.parameters(), lr=0.3, momentum=0.9)
    with pytest.raises(ShoalError, match="before its model"):
        shoal.replicate(popt)
    step = shoal.function(optimizer_step, scatter=["x", "y"], reduce=None)
    for idx in torch.arange(30).split(10) * 2:
        step(parallel, popt, x, y, len(idx), batch=idx)
        sopt.zero_grad()
        F.cross_entropy(serial.fc(x[idx]), y[idx]).backward()
        sopt.step()
    for a, b in zip(parallel.parameters(), serial.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    both = shoal.gather(parallel.fc.weight)
    torch.testing.assert_close(both[:3], both[3:])
