"""torchft's DiLoCo for benchmarks/soak_elastic.py: one replica group of one process
(``python benchmarks/soak_torchft.py --replica R ...``), started by the soak next to a
torchft lighthouse (:func:`lighthouse`). torchft (``pip install torchft==0.2.0``) is never a
dependency of shoal: only this benchmark imports it.

The replica trains the soak's model on digits like shoal's ``diloco`` (inner SGD with
momentum, a constant learning rate, an outer Nesterov SGD every ``--tau`` steps; torch's
seed 0, so every replica starts from the same model). Its data follows torchft's round
counter (``Manager.current_step()``): global inner step ``g = round * tau + j`` is epoch
``g // steps_per_epoch``; replica R takes rows ``(position * replicas + R) * batch ...`` of
that epoch's permutation (seeded by the epoch), as shoal deals an epoch over its workers.
A replica restarted after a kill heals from a live peer at its first quorum (torchft's
checkpoint transport) and goes on from the peers' round. It writes ``OUT/steps<R>.jsonl``
(``{"step": g}`` a line, as it trains) and, per committed round it took part in,
``OUT/rounds<R>.jsonl`` (the round and the epoch rows it trained in it); replica 0 writes
``OUT/result.json`` (test accuracy of the final global model) at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


MIN_REPLICAS = 2  # with 1, a restarted replica formed quorums alone from step 0 (split brain)


def lighthouse() -> object:
    """A torchft lighthouse on loopback that forms a quorum of MIN_REPLICAS replicas up (the
    survivors go on without a lost one, once its heartbeat is 5 s old: torchft's default)."""
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind="127.0.0.1:0", min_replicas=MIN_REPLICAS, join_timeout_ms=10_000)


def epoch_rows(epoch: int, rows: int, seed: int) -> torch.Tensor:
    """The order of the training rows in ``epoch``."""
    return torch.randperm(rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


def batch_of(a: argparse.Namespace, g: int, rows: int) -> tuple[int, torch.Tensor]:
    """Global inner step ``g``'s epoch and this replica's rows of it."""
    per_epoch = -(-rows // (a.batch * a.replicas))
    epoch, position = divmod(g, per_epoch)
    lo = (position * a.replicas + a.replica) * a.batch
    return epoch, epoch_rows(epoch, rows, a.seed)[lo:lo + a.batch]


def manager_for(a: argparse.Namespace, model: torch.nn.Module, inner: torch.optim.Optimizer):
    """This replica group's torchft Manager (its own store, world size 1, Gloo)."""
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    def load(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=a.timeout)
    return Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=MIN_REPLICAS,
                   use_async_quorum=False, load_state_dict=load,
                   state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
                   replica_id=f"soak{a.replica}", store_addr="127.0.0.1", store_port=store.port,
                   rank=0, world_size=1, lighthouse_addr=a.lighthouse, port=0,
                   hostname="127.0.0.1", timeout=timeout, quorum_timeout=timeout * 6,
                   connect_timeout=timeout), store


def train(a: argparse.Namespace) -> None:
    """Train to ``--rounds`` committed rounds; log steps and committed rounds."""
    from torchft.local_sgd import DiLoCo

    from shoal.data import load_dataset
    from shoal.models import build_model

    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    data = load_dataset("digits")
    model = build_model(a.model, data.input_shape, data.num_classes)
    inner = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
    outer = torch.optim.SGD(model.parameters(), lr=a.outer_lr, momentum=a.outer_momentum,
                            nesterov=True)
    manager, _store = manager_for(a, model, inner)
    out = Path(a.out)
    steps = (out / f"steps{a.replica}.jsonl").open("a", buffering=1)
    rounds = (out / f"rounds{a.replica}.jsonl").open("a", buffering=1)
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=a.tau):
            while manager.current_step() < a.rounds:
                start, trained = manager.current_step(), []
                for j in range(a.tau):
                    epoch, idx = batch_of(a, start * a.tau + j, len(data.train))
                    x, y = data.train.get_batch(idx)
                    inner.zero_grad()
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    inner.step()  # the tau-th runs DiLoCo's sync in its hook
                    trained.append([epoch, idx.tolist()])
                    steps.write(json.dumps({"step": start * a.tau + j + 1}) + "\n")
                if manager.current_step() == start + 1:  # committed, and this replica in it
                    rounds.write(json.dumps({"round": start, "rows": trained}) + "\n")
        if a.replica == 0:
            x, y = data.test.get_batch(torch.arange(len(data.test)))
            with torch.no_grad():
                accuracy = (model(x).argmax(1) == y).float().mean().item()
            (out / "result.json").write_text(json.dumps({"test_accuracy": accuracy}) + "\n")
    finally:
        manager.shutdown(wait=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, kind, default in (("replica", int, 0), ("replicas", int, 4), ("lighthouse", str, ""),
                                ("model", str, "mlp"), ("rounds", int, 10), ("tau", int, 16),
                                ("batch", int, 16), ("lr", float, 0.05), ("momentum", float, 0.9),
                                ("outer-lr", float, 0.7), ("outer-momentum", float, 0.5),
                                ("timeout", float, 10.0), ("seed", int, 0), ("out", str, ".")):
        p.add_argument(f"--{name}", type=kind, default=default)
    train(p.parse_args())


if __name__ == "__main__":
    main()
