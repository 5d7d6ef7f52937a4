"""A serial training loop whose gradient function runs data-parallel (the Synkhronos model).

The loop below is ordinary PyTorch: shuffle, take a batch, compute gradients, step. The only
difference from the serial loop is that the gradient function is a ``shoal.function``: each
of the processes started by ``shoal.fork`` computes the gradient of its rows of the batch,
and the results are averaged (weighted by rows, so it is the gradient of the whole batch).
Validation runs the same way, each process's share in ``num_slices`` pieces.

    .venv/bin/python examples/parallel_digits.py --workers 2 --epochs 10

Both loops start from the same weights and see the same batches, so they reach the same
accuracy (up to float rounding in the order of additions).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import shoal
from shoal.data.base import DataOptions
from shoal.data.digits import load
from shoal.models import MLP


def loss_and_grads(model, x, y):
    """Mean loss of this share and its gradients (runs on every process)."""
    model.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss, [p.grad for p in model.parameters()]


def correct(model, x, y):
    """How many of these samples the model classifies correctly."""
    with torch.no_grad():
        return int((model(x).argmax(1) == y).sum())


def _setup(seed: int):
    ds = load(DataOptions())
    torch.manual_seed(seed)
    model = MLP(ds.input_shape, ds.num_classes, width=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return ds, model, opt


def train_serial(epochs: int, batch: int, seed: int = 0, threads: int = 1) -> dict[str, float]:
    """The reference: a plain PyTorch loop in one process (one thread, like each of the
    parallel processes: for a model this small more threads only add contention)."""
    torch.set_num_threads(threads)
    ds, model, opt = _setup(seed)
    x, y = ds.train.x, ds.train.y
    start = time.perf_counter()
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
        for idx in order.split(batch):
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        acc = (model(ds.test.x).argmax(1) == ds.test.y).float().mean().item()
    return {"accuracy": acc, "seconds": seconds}


def train_parallel(epochs: int, batch: int, workers: int, seed: int = 0,
                   slices: int = 4) -> dict[str, float]:
    """The same loop with the gradient computed by ``workers`` processes."""
    ds, model, opt = _setup(seed)
    grads = shoal.function(loss_and_grads, scatter=["x", "y"], reduce="avg")
    evaluate = shoal.function(correct, scatter=["x", "y"], reduce="sum")
    x, y = shoal.shared(ds.train.x), shoal.shared(ds.train.y)  # in shared memory, once
    with shoal.fork(workers):
        start = time.perf_counter()
        for epoch in range(epochs):
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
            for idx in order.split(batch):
                loss, g = grads(model, x, y, batch=idx)  # every process, its rows of idx
                for p, gp in zip(model.parameters(), g, strict=True):
                    p.grad = gp
                opt.step()  # on the controller ...
                shoal.broadcast(model)  # ... and the workers' replicas follow
        seconds = time.perf_counter() - start
        hits = evaluate(model, ds.test.x, ds.test.y, num_slices=slices)
    return {"accuracy": hits / len(ds.test.y), "seconds": seconds, "last_loss": float(loss)}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    serial = train_serial(args.epochs, args.batch, args.seed)
    parallel = train_parallel(args.epochs, args.batch, args.workers, args.seed)
    print(f"serial:              test accuracy {serial['accuracy']:.2%} ({serial['seconds']:.1f} s)")
    print(f"parallel, {args.workers} procs:   test accuracy {parallel['accuracy']:.2%} "
          f"({parallel['seconds']:.1f} s)")
    return {"serial": serial, "parallel": parallel}


if __name__ == "__main__":
    main()
