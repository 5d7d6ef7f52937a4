"""torchft's Streaming DiLoCo beside shoal's, on the same task and emulated hosts.

Both train the character model of ``examples/char_lm.py`` (same width, layers, batch, seed,
AdamW inner steps, outer Nesterov SGD lr 0.7 momentum 0.9) with ``--tau`` steps a round, 4
fragments (torchft's: the modules ``[embed, position, layer 0]``, ``[layer 1]``, ...,
``[layer L-1, norm, head]``, the runs of tensors shoal's contiguous split gives), ``H``
overlapped steps, fp32 messages (torchft quantizes only on a GPU), one worker on each of 2
emulated hosts (``shoal.emulate``, ``tbf`` links of ``--rate``; needs root). torchft runs one
replica a host, each its own ``Manager``, TCPStore and Gloo group, the lighthouse on host 0;
shoal runs ``char_lm.py`` under torchrun. Runs alternate. Printed: samples/s and validation
bits/char at equal steps, each run's and the median, with the load average::

    sudo .venv/bin/python benchmarks/bench_torchft.py --rate 10mbit --steps 96 --tau 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

from shoal.core.guard import guarded_command
from shoal.emulate import Cluster, terminate_as_exception

REPO = Path(__file__).resolve().parent.parent
LIGHTHOUSE_PORT = 29510


def fragments(model: torch.nn.Module, count: int) -> list[torch.nn.Module]:
    """The model's modules in ``count`` runs, one transformer layer a run in the middle."""
    layers = list(model.blocks.layers)
    if count != len(layers):
        sys.exit(f"torchft's fragments here are the model's layers: --layers must be {count}")
    first = torch.nn.ModuleList([model.embed, model.position, layers[0]])
    last = torch.nn.ModuleList([layers[-1], model.norm, model.head])
    return [first, *layers[1:-1], last]


def replica(a: argparse.Namespace) -> None:
    """One torchft replica on emulated host ``a.replica`` (run inside its namespace)."""
    from torchft._torchft import LighthouseServer
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo
    sys.path.insert(0, str(REPO / "examples"))
    import char_lm as lm

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = lm.CharTransformer(len(lm.chars), lm.args.context, a.width, a.layers)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    parts = fragments(model, 4)
    outer = [torch.optim.SGD(p.parameters(), lr=0.7, momentum=0.9, nesterov=True) for p in parts]
    lighthouse = LighthouseServer(bind=f"[::]:{LIGHTHOUSE_PORT}", min_replicas=2) \
        if a.replica == 0 else None
    store = torch.distributed.TCPStore(a.address, 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=2, use_async_quorum=False,
                      load_state_dict=lambda s: None, state_dict=lambda: {}, init_sync=False,
                      replica_id=f"r{a.replica}", store_addr=a.address, store_port=store.port,
                      rank=0, world_size=1, hostname=a.address, port=0,
                      lighthouse_addr=f"http://{a.lighthouse}:{LIGHTHOUSE_PORT}",
                      timeout=timedelta(seconds=300), quorum_timeout=timedelta(seconds=300))
    train = lm.Windows(lm.tokens[:lm.split], lm.args.context)
    val = lm.Windows(lm.tokens[lm.split:], lm.args.context)
    draw = torch.Generator().manual_seed(a.replica)
    try:
        with DiLoCo(manager, parts, inner, outer, sync_every=a.tau, fragment_sync_delay=a.overlap,
                    fragment_update_alpha=a.alpha):
            start = time.perf_counter()
            for _ in range(a.steps):
                x, y = train.get_batch(torch.randint(len(train), (a.batch,), generator=draw))
                loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                inner.zero_grad()
                loss.backward()
                inner.step()
            train_s = time.perf_counter() - start
        bpc = lm.bits_per_char(model, val)
        Path(a.out).write_text(json.dumps({"train_s": train_s, "bits_per_char": bpc,
                                           "samples_per_s": 2 * a.steps * a.batch / train_s}))
    finally:
        manager.shutdown(wait=False)
        if lighthouse is not None:
            lighthouse.shutdown()


def run_torchft(cluster: Cluster, a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        procs = []
        for i in range(2):
            cmd = [*cluster.exec_args(i, {"GLOO_SOCKET_IFNAME": cluster.ifname(i),
                                          "OMP_NUM_THREADS": "1"}),
                   sys.executable, __file__, "--replica", str(i), "--address", cluster.address(i),
                   "--lighthouse", cluster.address(0), "--out", f"{out}/r{i}.json",
                   *[f"--{k}={getattr(a, k)}" for k in ("steps", "tau", "overlap", "alpha",
                                                        "width", "layers", "batch")]]
            procs.append(subprocess.Popen(guarded_command(cmd), start_new_session=True))
        try:
            codes = [p.wait(timeout=1200) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes):
            sys.exit(f"torchft replicas exited {codes}")
        runs = [json.loads(Path(out, f"r{i}.json").read_text()) for i in range(2)]
    return {"samples_per_s": min(r["samples_per_s"] for r in runs),
            "quality": runs[0]["bits_per_char"], "load": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="10mbit")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--tau", type=int, default=32)
    p.add_argument("--alpha", type=float, default=0.5, help="torchft's mixing (shoal's default)")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="per worker")
    p.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    p.add_argument("--overlap", type=int, help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.overlap is None:
        a.overlap = a.tau // 4 - 1  # as bench_stream's "stream" configurations
    if a.replica is not None:
        replica(a)
        return
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_stream import run_char_lm

    lm = argparse.Namespace(lm_steps=a.steps, lm_tau=a.tau, lm_width=a.width, lm_layers=a.layers,
                            lm_batch=a.batch, measure_wait=False)
    rows: dict[str, list[dict]] = {"shoal": [], "torchft": []}
    with terminate_as_exception(), Cluster(hosts=2, rate=a.rate) as cluster:
        for _ in range(a.repeats):
            rows["shoal"].append(run_char_lm(cluster, "stream fp32", lm))
            rows["torchft"].append(run_torchft(cluster, a))
            print({k: v[-1] for k, v in rows.items()}, file=sys.stderr, flush=True)
    for name, runs in rows.items():
        each = ", ".join(f"{r['samples_per_s']:.1f} ({r['quality']:.3f} b/c, load "
                         f"{r['load']:.1f})" for r in runs)
        print(f"{name}: median {statistics.median(r['samples_per_s'] for r in runs):.1f} "
              f"samples/s; {each}")
    ratio = statistics.median(r["samples_per_s"] for r in rows["shoal"]) / \
        statistics.median(r["samples_per_s"] for r in rows["torchft"])
    print(f"samples/s shoal / torchft: {ratio:.2f}")


if __name__ == "__main__":
    main()
