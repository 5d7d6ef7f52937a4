"""A job torchrun starts (3 ranks) for ``tests/test_plan_injob.py``: on the job's process
group, each rank runs layouts with parameter servers in place of it, one after another
(``shoal.train.launch.relaid``, what ``--strategy auto`` does inside a job for a trial or a
winner of groups or an asynchronous strategy), then meets the others in the job's group.
Rank 0 writes what it saw to ``OUT/seen.json``."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shoal.config import TrainConfig
from shoal.core.env import detect_environment
from shoal.errors import ShoalError
from shoal.train.launch import join, outside_topology, relaid
from shoal.train.workload import load_workload

RUNS = [("groups", {"groups": 1}, {}), ("async-measgd", {"tau": 2}, {"momentum": 0.0}),
        ("async-sgd", {}, {})]


def main(out: Path) -> None:
    env = detect_environment()
    assert env is not None
    cfg = TrainConfig(model="mlp", dataset="digits", epochs=1, progress="none",
                      out=str(out)).validate()
    comm = join(cfg, env, outside_topology(cfg, env))
    data = load_workload(cfg).data
    seen = []
    for strategy, options, changes in RUNS:
        run = dataclasses.replace(cfg, strategy=strategy, strategy_options=options,
                                  out=str(out / strategy), **changes)
        try:
            summary, error = relaid(run, env, comm, data, strategy), None
        except ShoalError as exc:
            summary, error = None, str(exc).splitlines()[0]
        ranks = torch.tensor([float(env.rank)])
        dist.all_reduce(ranks)  # the job's own group, formed again
        seen.append({"strategy": strategy, "error": error, "ranks": ranks.item(),
                     "accuracy": summary and summary["test_accuracy"],
                     "workers": summary and summary["workers"],
                     "completed": summary and summary["completed"]})
    if env.rank == 0:
        (out / "seen.json").write_text(json.dumps(seen))
    comm.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
