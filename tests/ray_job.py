"""Run by tests/test_ray.py in a subprocess (a Ray hang cannot hang pytest): one local Ray,
two ``TorchTrainer`` runs of the same run name, then shoal's own loop as their reference.

1. On 2 workers: each case (a strategy and its options) trains :data:`CASE_EPOCHS` epoch
   through shoal.integrations.ray, every rank writing its parameters to
   ``OUT/cases/<i>/rank<r>.pt``; then the README's example (examples/ray_diloco.py, its
   ``train_func``) trains :data:`EXAMPLE` for 2 epochs, a checkpoint after each.
2. On 1 worker: the example's ``main`` goes on from that run's last checkpoint
   (``ray.train.get_checkpoint()``) for a third epoch.
3. After ``ray.shutdown()``, here (a job of one, no Ray): shoal's own loop from the same
   checkpoint (``shoal_ray.load``) for the third epoch, its parameters in
   ``OUT/resumed_reference.pt``.

``OUT/result.json`` says what each run reported and where its checkpoints are. Ray listens on
the loopback interface only and keeps its files under TEMP (the test finds any process left
there by that path).

    python tests/ray_job.py OUT TEMP
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_PATH = REPO / "examples" / "ray_diloco.py"
CASES = {
    "sync": ("sync", {}),
    "local-sgd": ("local-sgd", {"tau": 4}),
    "easgd": ("easgd", {"tau": 4}),
    "eamsgd": ("eamsgd", {"tau": 4}),
    "diloco": ("diloco", {"tau": 8}),
}
CASE_EPOCHS = 1
#: The example's strategy in the checkpointed run: streamed, overlapped, int4 with residuals.
EXAMPLE = ("diloco", {"tau": 8, "fragments": 2, "overlap_steps": 1, "outer_precision": "int4"})
EXAMPLE_EPOCHS, RESUMED_EPOCHS, RESUMED_WORKERS = 2, 3, 1
RUN_NAME = "shoal-ray-test"


def build() -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
    """The example's data, model and optimizer, built the same way."""
    from shoal.data import load_dataset
    from shoal.models import build_model

    data = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("lenet5", data.input_shape, data.num_classes)
    return data, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def fit(strategy: Any, data: Any, epochs: int, first: int = 0) -> None:
    """The example's loop (without its evaluation and reports)."""
    for epoch in range(first, epochs):
        for x, y in strategy.batches(data.train, batch_size=16, epoch=epoch):
            strategy.backward(F.cross_entropy(strategy.module(x), y))
            strategy.step()
            strategy.zero_grad()


def trained(strategy: Any) -> dict[str, Any]:
    """What a run's comparison reads: this rank's model, the evaluated one, the steps."""
    return {"model": {k: v.clone() for k, v in strategy.model.state_dict().items()},
            "eval": {k: v.clone() for k, v in strategy.eval_module.state_dict().items()},
            "steps": strategy.steps}


def reference(out: str) -> None:
    """shoal's own loop (``shoal.launch``, 2 workers): every case, then the example's
    strategy for its epochs, each rank's results in ``OUT/<i>/rank<r>.pt``."""
    import shoal

    comm = shoal.init(device="cpu", threads=1)  # Ray's workers have one thread each
    for i, (name, options) in enumerate([*CASES.values(), EXAMPLE]):
        data, model, optimizer = build()
        strategy = shoal.strategy(name, model, optimizer, **options)
        fit(strategy, data, CASE_EPOCHS if i < len(CASES) else EXAMPLE_EPOCHS)
        Path(out, str(i)).mkdir(parents=True, exist_ok=True)
        torch.save(trained(strategy), Path(out, str(i), f"rank{comm.rank}.pt"))


#: A listening socket's local address, as /proc/net/tcp and tcp6 write the loopback ones.
LOOPBACK = ("0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


def listening(marker: str) -> list[dict[str, Any]]:
    """The TCP sockets listening in the processes whose environment carries ``marker``
    (this Ray's and its workers'): each one's process title, address and port."""
    owners: dict[str, str] = {}
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or marker.encode() not in (entry / "environ").read_bytes():
                continue
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            for fd in (entry / "fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    owners[link[8:-1]] = title
        except OSError:  # a process that ended meanwhile
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in owners:  # LISTEN
                address, port = fields[1].split(":")
                found.append({"process": owners[fields[9]], "address": address,
                              "port": int(port, 16), "loopback": address in LOOPBACK})
    return found


def cases_then_example(config: dict[str, Any]) -> None:
    """Ray's ``train_func`` of the first run (2 workers); rank 0 also writes what listens
    (``OUT/listening.json``), Ray's process group's store (``MASTER_PORT``) among it."""
    from shoal.integrations import ray as shoal_ray

    if int(os.environ["RANK"]) == 0:
        Path(config["out"], "listening.json").write_text(json.dumps({
            "sockets": listening(os.environ["SHOAL_TEST_MARKER"]),
            "master_port": int(os.environ["MASTER_PORT"])}))

    for i, (name, options) in enumerate(CASES.values()):
        data, model, optimizer = build()
        strategy = shoal_ray.strategy(name, model, optimizer, **options)
        fit(strategy, data, CASE_EPOCHS)
        Path(config["out"], "cases", str(i)).mkdir(parents=True, exist_ok=True)
        torch.save(trained(strategy), Path(config["out"], "cases", str(i),
                                           f"rank{strategy.comm.rank}.pt"))
    config["example_train_func"](config["example"])


def checkpoints(result: Any) -> list[dict[str, Any]]:
    """Every checkpoint a run reported: its directory and rank 0's metrics."""
    return [{"path": c.path, "metrics": m} for c, m in result.best_checkpoints]


def resumed_reference(checkpoint: str, out: Path) -> dict[str, Any]:
    """Step 3: shoal's own loop, one process, from ``checkpoint`` for the third epoch."""
    import shoal
    from shoal.integrations import ray as shoal_ray

    shoal.init(device="cpu", threads=1)
    data, model, optimizer = build()
    strategy = shoal.strategy(EXAMPLE[0], model, optimizer, **EXAMPLE[1])
    first = shoal_ray.load(strategy, checkpoint)
    saved = torch.load(Path(checkpoint, shoal_ray.OWN.format(0)), weights_only=True)["own"]
    loaded = all(torch.equal(v, saved["model"][k]) for k, v in model.state_dict().items()) \
        and torch.equal(strategy.state_dict()["theta"], saved["strategy"]["theta"])
    fit(strategy, data, RESUMED_EPOCHS, first)
    torch.save(trained(strategy), out / "resumed_reference.pt")
    shoal.shutdown()
    return {"first": first, "loaded_equals_saved": loaded}


def main() -> None:
    out, temp = Path(sys.argv[1]), Path(sys.argv[2])
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    example = runpy.run_path(str(EXAMPLE_PATH), run_name="ray_diloco")
    result: dict[str, Any] = {}
    start = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=str(temp), object_store_memory=100 * 1024**2, configure_logging=False)
    result["seconds"] = {"init": time.monotonic() - start}
    storage = str(out / "storage")
    try:
        start = time.monotonic()
        config = {"out": str(out), "example_train_func": example["train_func"],
                  "example": {"strategy": EXAMPLE[0], "options": EXAMPLE[1], "epochs": EXAMPLE_EPOCHS}}
        first = TorchTrainer(cases_then_example, train_loop_config=config,
                             scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                             run_config=RunConfig(name=RUN_NAME, storage_path=storage)).fit()
        result["first"] = checkpoints(first)
        result["seconds"]["first"] = time.monotonic() - start
        start = time.monotonic()
        second = example["main"](["--workers", str(RESUMED_WORKERS), "--epochs", str(RESUMED_EPOCHS),
                                  "--strategy", EXAMPLE[0], "--options", json.dumps(EXAMPLE[1]),
                                  "--name", RUN_NAME, "--storage", storage])
        made = {c["path"] for c in result["first"]}  # the run's list holds the first run's too
        result["second"] = [c for c in checkpoints(second) if c["path"] not in made]
        result["seconds"]["second"] = time.monotonic() - start
    finally:
        start = time.monotonic()
        ray.shutdown()
        result["seconds"]["shutdown"] = time.monotonic() - start
    result["reference"] = resumed_reference(result["first"][-1]["path"], out)
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
