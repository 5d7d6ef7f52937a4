"""shoal on one CUDA GPU, next to a hand-written PyTorch loop: a few minutes, run by
``make test-gpu`` after the GPU tests.

- **Training step** (one process on GPU 0): ``shoal train --device cuda --workers 1`` and a
  plain loop (model, SGD with momentum, cross-entropy, the same synthetic data read a batch at
  a time on the CPU and copied to the GPU), in float32 and with each feature on:
  ``--precision bf16-mixed`` (autocast), ``16-mixed`` (autocast and a GradScaler),
  ``--channels-last`` and ``--compile`` (Triton). Each row gives samples/s, its ratio to the
  float32 row of the same side, and shoal / plain. shoal's last row adds ``--loader-workers
  2`` (batches read by two DataLoader processes into pinned memory).
- **Asynchronous**: ``--strategy async-sgd --workers 2`` with ``CUDA_VISIBLE_DEVICES=0``:
  two worker processes share GPU 0 and exchange with a parameter server (host memory, Gloo)
  through pinned host buffers; samples/s and its ratio to shoal's one-process float32 row.
- **Pinned memory**: shoal's :class:`~shoal.data.loader.ShardLoader` with two loader
  processes handing batches to the GPU, ``pin_memory`` on and off.

Everything is timed as ``bench_ddp.py`` times it: shoal from rank 0's step records after
``--warmup`` steps (everything its loop does counts), the plain loop between two
``torch.cuda.synchronize`` calls after the same warm-up. Every run is a fresh process; the
repeats alternate the sides, and the table shows medians. Run:

    .venv/bin/python benchmarks/bench_gpu.py [--model resnet18 --shape 3x32x32 --batch 128]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
#: The feature rows: name -> (shoal's flags, the plain loop's variant).
FEATURES = {
    "float32": ([], "32"),
    "bf16-mixed": (["--precision", "bf16-mixed"], "bf16"),
    "16-mixed": (["--precision", "16-mixed"], "fp16"),
    "channels-last": (["--channels-last"], "channels-last"),
    "compile": (["--compile"], "compile"),
    "loader processes (2, pinned)": (["--loader-workers", "2"], None),
}
LR, MOMENTUM = 0.05, 0.9


def data_flags(a: argparse.Namespace, samples: int) -> list[str]:
    return ["--dataset", "synthetic", "--synthetic-shape", a.shape, "--synthetic-samples",
            str(samples)]


#: The loader benchmark's images and batches: large enough that copying them counts.
PINNED_SHAPE, PINNED_BATCHES = "3x128x128", 20


def load_data(shape: str, samples: int):
    """The synthetic data shoal's run reads (the same seed, shape and size)."""
    from shoal.data import DataOptions, load_dataset

    dims = tuple(int(d) for d in shape.split("x"))
    return load_dataset("synthetic", DataOptions(synthetic_shape=dims, synthetic_samples=samples))


# -- shoal --------------------------------------------------------------------------------------
def run_shoal(a: argparse.Namespace, flags: list[str], workers: int = 1, epochs: int = 1,
              env: dict[str, str] | None = None) -> float:
    """``shoal train --device cuda`` on synthetic data; samples/s after the warm-up, from
    rank 0's (the coordinator's, asynchronous) step records."""
    from shoal.sweep.measure import measure_run

    steps = a.steps // epochs
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "shoal", "train", "--device", "cuda", "--model", a.model,
               *data_flags(a, steps * a.batch * workers), "--epochs", str(epochs),
               "--batch-size", str(a.batch), "--workers", str(workers), "--lr", str(LR),
               "--momentum", str(MOMENTUM), "--schedule", "constant", "--log-every", "5",
               "--checkpoint-every", str(10**9), "--progress", "none", "--out", out, *flags]
        subprocess.run(cmd, check=True, cwd=REPO, env=env)
        warmup = a.warmup if epochs == 1 else steps  # asynchronous: records at epoch ends
        return measure_run(Path(out), warmup)["samples_per_s"]


# -- the plain loop (in a fresh interpreter: ``--plain VARIANT``) ------------------------------
def plain_loop(a: argparse.Namespace, variant: str) -> float:
    """samples/s of the hand-written loop on GPU 0 with ``variant``'s feature."""
    import torch.nn.functional as F

    from shoal.models import build_model

    dev = torch.device("cuda", 0)
    data = load_data(a.shape, a.steps * a.batch)
    torch.manual_seed(0)
    model = build_model(a.model, data.input_shape, data.num_classes).to(dev)
    memory = torch.channels_last if variant == "channels-last" else torch.contiguous_format
    model.to(memory_format=memory)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    if variant == "compile":
        model.compile()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(variant)
    scaler = torch.amp.GradScaler("cuda") if variant == "fp16" else None
    perm = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(0))

    def step(i: int) -> None:
        x, y = data.train.get_batch(perm[i * a.batch:(i + 1) * a.batch])
        x = x.to(dev, non_blocking=True).contiguous(memory_format=memory)
        y = y.to(dev, non_blocking=True)
        with torch.autocast("cuda", dtype=dtype) if dtype else contextlib.nullcontext():
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    for i in range(a.warmup):
        step(i)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for i in range(a.warmup, a.steps):
        step(i)
    torch.cuda.synchronize()
    return (a.steps - a.warmup) * a.batch / (time.perf_counter() - started)


def pinned_loader(a: argparse.Namespace, pin: bool) -> float:
    """samples/s of :class:`ShardLoader` (2 loader processes) handing batches to GPU 0:
    an epoch to start the processes, then one timed."""
    from shoal.data.loader import ShardLoader
    from shoal.data.sharding import EpochPlan

    dev = torch.device("cuda", 0)
    batches = PINNED_BATCHES
    data = load_data(PINNED_SHAPE, batches * a.batch)
    loader = ShardLoader(data, EpochPlan(len(data.train), a.batch, 1, 0), 0, workers=2,
                         pin_memory=pin)
    try:
        seconds = 0.0
        for epoch in range(2):
            torch.cuda.synchronize()
            started = time.perf_counter()
            for x, y, _ in loader.epoch(epoch):
                x.to(dev, non_blocking=True).sum()
                y.to(dev, non_blocking=True)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
    finally:
        loader.close()
    return batches * a.batch / seconds


def in_child(a: argparse.Namespace, what: str, variant: str) -> float:
    """Run ``what`` (``plain`` or ``pinned``) in a fresh interpreter; its samples/s."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, f"--{what}", variant, "--result", str(out),
               "--model", a.model, "--shape", a.shape, "--batch", str(a.batch),
               "--steps", str(a.steps), "--warmup", str(a.warmup)]
        subprocess.run(cmd, check=True, cwd=REPO)
        return json.loads(out.read_text())["samples_per_s"]


# -- the tables ---------------------------------------------------------------------------------
def measure(a: argparse.Namespace) -> dict:
    """Every row's samples/s, ``--repeats`` times (each run a fresh process), and medians."""
    runs: dict[str, list[float]] = {}
    one_gpu = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    for _ in range(a.repeats):  # alternating, so a slow spell hits every row alike
        for name, (flags, variant) in FEATURES.items():
            runs.setdefault(f"shoal {name}", []).append(run_shoal(a, flags, env=one_gpu))
            if variant is not None:
                runs.setdefault(f"plain {name}", []).append(in_child(a, "plain", variant))
            print(f"{name}: done", file=sys.stderr, flush=True)
        runs.setdefault("async", []).append(
            run_shoal(a, ["--strategy", "async-sgd"], workers=2, epochs=3, env=one_gpu))
        for pin in ("on", "off"):
            runs.setdefault(f"pinned {pin}", []).append(in_child(a, "pinned", pin))
    return {"runs": runs, "median": {k: statistics.median(v) for k, v in runs.items()}}


def tables(a: argparse.Namespace, result: dict) -> str:
    m = result["median"]
    lines = [f"{torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA "
             f"{torch.version.cuda}); {a.model} on synthetic {a.shape}, batch {a.batch}, "
             f"{a.steps - a.warmup} timed steps after {a.warmup}; median of {a.repeats}", "",
             "| one process on GPU 0 | shoal samples/s | / shoal float32 | plain samples/s "
             "| / plain float32 | shoal / plain |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name in FEATURES:
        ours = m[f"shoal {name}"]
        row = f"| {name} | {ours:,.0f} | {ours / m['shoal float32']:.2f} |"
        plain = m.get(f"plain {name}")
        lines.append(row + (f" {plain:,.0f} | {plain / m['plain float32']:.2f} | "
                            f"{ours / plain:.2f} |" if plain else " - | - | - |"))
    lines += ["", "| asynchronous: 2 workers share GPU 0, 1 server (async-sgd) | samples/s "
              "| / shoal float32, one process |", "| --- | ---: | ---: |",
              f"| async-sgd | {m['async']:,.0f} | {m['async'] / m['shoal float32']:.2f} |",
              "", f"| ShardLoader, 2 loader processes -> GPU 0 ({PINNED_SHAPE}) | samples/s |",
              "| --- | ---: |",
              f"| pin_memory on | {m['pinned on']:,.0f} |",
              f"| pin_memory off | {m['pinned off']:,.0f} |",
              f"| on / off | {m['pinned on'] / m['pinned off']:.2f} |"]
    return "\n".join(lines) + "\n"


def facts() -> str:
    """What torch sees of CUDA: versions, and each GPU's name, capability and memory."""
    import importlib.util

    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() \
        else "none"
    lines = [f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
             f"{torch.backends.cudnn.version()}, NCCL {nccl}, Triton "
             f"{'yes' if importlib.util.find_spec('triton') else 'no'}, bf16 "
             f"{'yes' if torch.cuda.is_bf16_supported() else 'no'}"]
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        lines.append(f"cuda:{i} {props.name}, compute capability {props.major}.{props.minor}, "
                     f"{props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--shape", default="3x32x32")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="runs/bench-gpu", help="where the table and JSON go")
    p.add_argument("--facts", action="store_true", help="print what torch sees of CUDA and stop")
    p.add_argument("--plain", help=argparse.SUPPRESS)  # a child: the plain loop's variant
    p.add_argument("--pinned", choices=("on", "off"), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    if a.facts:
        print(facts())
        return 0
    if not 0 < a.warmup < a.steps or a.steps < 15 or a.repeats < 1:
        p.error("need 0 < --warmup < --steps, --steps >= 15 and --repeats >= 1")
    if a.plain or a.pinned:
        speed = plain_loop(a, a.plain) if a.plain else pinned_loader(a, a.pinned == "on")
        Path(a.result).write_text(json.dumps({"samples_per_s": speed}))
        return 0
    result = measure(a)
    text = tables(a, result)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_gpu.md").write_text(text)
    (out / "bench_gpu.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
         "cuda": torch.version.cuda, "settings": vars(a), **result}, indent=2))
    print("\n" + text)
    print(f"wrote {out / 'bench_gpu.md'} and {out / 'bench_gpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
