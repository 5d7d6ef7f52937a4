"""shoal on a CUDA GPU, with real processes: every test here is marked ``gpu``, run by
``make test-gpu`` (``pytest -m gpu``) and skipped by every other run.

What a user expects of a GPU: ``shoal train --device cuda`` learns (synchronous with one
worker, or one per GPU), ends where the same run on the CPU ends, runs an asynchronous job
whose workers share one GPU, trains in bf16 and fp16 (with its scaler), channels-last and
compiled, feeds the GPU from pinned memory, moves its checkpoints between GPU and CPU, and
runs parallel functions there. The assertions are about behaviour (accuracy far above
chance, parameters equal to the CPU run's within float tolerance, files written, devices
recorded), never about time: ``benchmarks/bench_gpu.py`` measures speed.

Runs compared with the CPU's switch off TF32 (``NVIDIA_TF32_OVERRIDE=0``), which cuBLAS and
cuDNN otherwise use for float32 matrix products and convolutions on Ampere and later.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import shoal
from shoal.data import load_dataset
from shoal.data.loader import ShardLoader
from shoal.data.sharding import EpochPlan
from shoal.models import MLP, build_model

from conftest import (
    checkpoint_params,
    is_loopback,
    max_param_diff,
    one_error_line,
    shoal_env,
    sockets_of_a_running_job,
    train,
)
from conftest import shoal as shoal_command

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

#: GPUs visible (none outside ``pytest -m gpu``: conftest hides them from the CPU suite).
GPUS = torch.cuda.device_count()
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs (NCCL runs one rank per GPU); "
                                               f"{GPUS} visible")
DIGITS = ["--model", "lenet5", "--dataset", "digits", "--workers", "1"]
#: An MLP (matrix products only) for runs compared with the CPU's: 2 epochs, 180 steps.
MLP_RUN = ["--model", "mlp", "--dataset", "digits", "--epochs", "2"]
#: Digits has 10 classes: chance is 10%; LeNet-5's 3 epochs reach 93-95% on the CPU in
#: float32, bf16-mixed and 16-mixed alike.
LEARNED = 0.85
#: Parameters of the same run on the GPU and the CPU (float32, TF32 off) after 180 steps.
SAME_RUN = 1e-3


def no_tf32() -> dict[str, str]:
    """The environment of a run compared with the CPU's: plain float32 on the GPU."""
    return {**shoal_env(), "NVIDIA_TF32_OVERRIDE": "0"}


def run(out: Path, *args: str, exact: bool = False, timeout: float = 300) -> dict:
    """``shoal train`` that must succeed (``exact``: TF32 off); returns summary.json."""
    return train(out, *args, timeout=timeout, env=no_tf32() if exact else None)


def model_accuracy(state: dict[str, torch.Tensor], model: str) -> float:
    """Test accuracy on digits of ``state`` loaded, strictly, into a fresh ``model`` on the
    CPU: a checkpoint written on the GPU is usable without one."""
    data = load_dataset("digits")
    net = build_model(model, data.input_shape, data.num_classes)
    net.load_state_dict(state)
    net.eval()
    with torch.no_grad():
        x, y = data.test.get_batch(torch.arange(len(data.test)))
        return (net(x).argmax(1) == y).double().mean().item()


@pytest.fixture(scope="module")
def lenet_gpu(tmp_path_factory):
    """LeNet-5 on digits, one worker on GPU 0, float32: the run the features compare with."""
    out = tmp_path_factory.mktemp("lenet-gpu")
    return out, run(out, *DIGITS, "--device", "cuda", "--epochs", "3")


@pytest.fixture(scope="module")
def mlp_cpu(tmp_path_factory):
    out = tmp_path_factory.mktemp("mlp-cpu")
    return out, run(out, *MLP_RUN, "--workers", "1", "--device", "cpu")


@pytest.fixture(scope="module")
def mlp_gpu(tmp_path_factory):
    out = tmp_path_factory.mktemp("mlp-gpu")
    return out, run(out, *MLP_RUN, "--workers", "1", "--device", "cuda", exact=True)


def params(out: Path) -> dict[str, torch.Tensor]:
    return checkpoint_params(out / "checkpoint.pt")


# -- synchronous: one worker, one per GPU -------------------------------------------------------
def test_one_worker_on_the_gpu_learns_and_writes_its_run(lenet_gpu):
    out, summary = lenet_gpu
    assert summary["device"] == "cuda:0" and summary["completed"] and summary["epochs"] == 3
    assert summary["test_accuracy"] >= LEARNED, summary["test_accuracy"]
    config = json.loads((out / "config.json").read_text())
    assert config["device"] == "cuda"
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").open()
             if json.loads(line)["event"] == "step"]
    assert steps[-1] == summary["steps"] == 3 * 90  # 1437 samples, batches of 16
    # The checkpoint holds CPU tensors: its model classifies as well on the CPU.
    assert all(t.device.type == "cpu" for t in params(out).values())
    assert model_accuracy(params(out), "lenet5") == pytest.approx(summary["test_accuracy"],
                                                                  abs=0.01)


def test_the_gpu_run_ends_where_the_cpu_run_does(mlp_cpu, mlp_gpu):
    (cpu, on_cpu), (gpu, on_gpu) = mlp_cpu, mlp_gpu
    assert on_cpu["device"] == "cpu" and on_gpu["device"] == "cuda:0"
    diff = max_param_diff(params(cpu), params(gpu))
    assert diff < SAME_RUN, diff
    assert on_gpu["train_loss"] == pytest.approx(on_cpu["train_loss"], rel=1e-3)
    assert on_gpu["test_accuracy"] == pytest.approx(on_cpu["test_accuracy"], abs=0.01)


@two_gpus
def test_two_workers_on_two_gpus_end_where_two_cpu_workers_do(tmp_path):
    cpu = run(tmp_path / "cpu", *MLP_RUN, "--workers", "2", "--device", "cpu")
    gpu = run(tmp_path / "gpu", *MLP_RUN, "--workers", "2", "--device", "cuda", exact=True)
    assert gpu["workers"] == 2 and gpu["device"] == "cuda:0" and gpu["completed"]
    diff = max_param_diff(params(tmp_path / "cpu"), params(tmp_path / "gpu"))
    assert diff < SAME_RUN, diff
    # NCCL's all-reduce is counted as Gloo's is: every gradient once a step
    assert gpu["bytes_per_sample"] == pytest.approx(cpu["bytes_per_sample"], rel=1e-6)


@two_gpus
def test_a_job_on_two_gpus_listens_on_loopback_only(tmp_path):
    """NCCL's bootstrap sockets follow NCCL_SOCKET_IFNAME, which shoal's workers set to lo."""
    job, sockets = sockets_of_a_running_job(tmp_path, *DIGITS[:4], "--workers", "2",
                                            "--device", "cuda", timeout=120)
    assert len(job) >= 3 and sockets, (job, sockets)
    assert all(is_loopback(addr) for _, addr, _ in sockets), sockets


def test_more_workers_than_gpus(tmp_path):
    """``--device cuda``: one line before any worker starts. ``auto``: all on the CPU (two
    NCCL ranks on one GPU would fail)."""
    workers = str(GPUS + 1)
    env = shoal_env()
    res = shoal_command("train", "--out", str(tmp_path / "cuda"), *DIGITS[:4], "--workers",
                        workers, "--device", "cuda", env=env)
    assert res.returncode == 2 and res.stray == []
    verb = "is" if GPUS == 1 else "are"
    assert one_error_line(res.stderr) == (
        f"shoal: error: --device cuda: {workers} processes on this host need a GPU each (NCCL "
        f"runs one rank per GPU), and {GPUS} {verb} visible: start at most {GPUS}, or use the "
        "CPU")
    summary = run(tmp_path / "auto", *DIGITS[:4], "--workers", workers, "--epochs", "1",
                  "--stop-at-step", "5")
    assert summary["device"] == "cpu" and summary["workers"] == GPUS + 1


# -- asynchronous: workers share a GPU through host buffers --------------------------------------
@pytest.mark.parametrize("strategy, options", [("async-sgd", []), ("async-easgd", ["--tau", "4"])])
def test_asynchronous_workers_share_one_gpu(tmp_path, strategy, options):
    """Two workers and a server: the workers on GPU 0 (both, however many GPUs there are
    beyond it with CUDA_VISIBLE_DEVICES=0), each exchanging with the server's shard in host
    memory over its own Gloo pair, through pinned host buffers."""
    env = {**shoal_env(), "CUDA_VISIBLE_DEVICES": "0"}
    res = shoal_command("train", "--out", str(tmp_path), "--progress", "plain", *MLP_RUN,
                        "--epochs", "4", "--workers", "2", "--device", "cuda", "--strategy",
                        strategy, *options, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["device"] == "cuda:0"  # where the workers computed (the server: the CPU)
    assert summary["completed"] and not summary["degraded"] and summary["servers"] == 1
    assert summary["test_accuracy"] >= 0.9, summary["test_accuracy"]
    assert summary["staleness"]["updates"] > 0 and summary["bytes_sent"] > 0
    saved = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert len(saved["ranks"]) == 2 and all(r is not None for r in saved["ranks"])


def test_compute_groups_take_a_gpu_per_worker_of_a_group(tmp_path):
    """A compute group of two all-reduces in NCCL: two GPUs, or one line on one GPU."""
    args = [*MLP_RUN, "--workers", "2", "--device", "cuda", "--strategy", "groups",
            "--groups", "1"]
    if GPUS >= 2:
        summary = run(tmp_path, *args)
        assert summary["device"] == "cuda:0, cuda:1"  # one GPU per worker of the group
        assert summary["test_accuracy"] >= 0.9 and summary["completed"]
        return
    res = shoal_command("train", "--out", str(tmp_path), *args)
    assert res.returncode == 2
    assert "2 processes on this host need a GPU each" in one_error_line(res.stderr)


def test_hogwild_under_device_auto_runs_on_the_cpu(tmp_path):
    """Hogwild steps parameters shared in host memory: ``auto`` gives it the CPU even where
    a GPU is visible (``--device cuda`` is refused in one line)."""
    summary = run(tmp_path, *MLP_RUN, "--epochs", "1", "--workers", "2", "--strategy",
                  "hogwild", "--momentum", "0")
    assert summary["device"] == "cpu" and summary["completed"]


# -- the training features a GPU is for ----------------------------------------------------------
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_learns_as_float32_does(tmp_path, lenet_gpu, precision):
    summary = run(tmp_path, *DIGITS, "--device", "cuda", "--epochs", "3", "--precision",
                  precision)
    assert summary["test_accuracy"] >= LEARNED
    assert summary["test_accuracy"] == pytest.approx(lenet_gpu[1]["test_accuracy"], abs=0.05)
    own = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=True)["ranks"][0]
    scaler = own["precision"]["scaler"]
    if precision == "16-mixed":  # float16's scaler ran on the GPU and is checkpointed
        assert scaler["scale"] > 0 and own["precision"]["skipped"] < summary["steps"] // 10
    else:
        assert scaler is None


CONV = ["--model", "resnet20", "--dataset", "synthetic", "--synthetic-shape", "3x16x16",
        "--workers", "1", "--device", "cuda", "--epochs", "2"]


def test_channels_last_learns_as_contiguous_does(tmp_path):
    """Three-channel images (a one-channel image is the same in either layout)."""
    plain = run(tmp_path / "plain", *CONV)
    last = run(tmp_path / "last", *CONV, "--channels-last")
    assert last["test_accuracy"] >= 0.9  # 10 classes; 100% on the CPU
    assert last["test_accuracy"] == pytest.approx(plain["test_accuracy"], abs=0.05)
    both = run(tmp_path / "bf16", *CONV, "--channels-last", "--precision", "bf16-mixed")
    assert both["test_accuracy"] == pytest.approx(plain["test_accuracy"], abs=0.05)


def test_compile_with_triton_learns_and_keeps_parameter_names(tmp_path, lenet_gpu):
    summary = run(tmp_path, *DIGITS, "--device", "cuda", "--epochs", "3", "--compile",
                  timeout=800)
    assert summary["test_accuracy"] >= LEARNED
    assert summary["test_accuracy"] == pytest.approx(lenet_gpu[1]["test_accuracy"], abs=0.05)
    assert model_accuracy(params(tmp_path), "lenet5") == pytest.approx(
        summary["test_accuracy"], abs=0.01)  # loads strictly: no "_orig_mod." in its names


def test_loader_processes_hand_over_pinned_batches():
    data = load_dataset("digits")
    loader = ShardLoader(data, EpochPlan(len(data.train), 64, 1, 0), 0, workers=2,
                         pin_memory=True)
    try:
        batches = list(itertools.islice(loader.epoch(0), 5))
    finally:
        loader.close()
    assert len(batches) == 5 and all(x.is_pinned() and y.is_pinned() for x, y, _ in batches)


def test_loader_processes_feed_the_gpu_the_same_batches(tmp_path, mlp_gpu):
    summary = run(tmp_path, *MLP_RUN, "--workers", "1", "--device", "cuda",
                  "--loader-workers", "2", exact=True)
    assert summary["device"] == "cuda:0" and summary["completed"]
    diff = max_param_diff(params(tmp_path), params(mlp_gpu[0]))
    assert diff <= 1e-6, diff  # the same rows in the same order, pinned or not


# -- checkpoints move between GPU and CPU -------------------------------------------------------
@pytest.mark.parametrize("first, then", [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_checkpoint_resumes_on_the_other_device(tmp_path, mlp_cpu, first, then):
    """Stopped mid-epoch on one device, resumed on the other: the run ends where the
    uninterrupted CPU run does, its records continuing from the checkpoint."""
    args = [*MLP_RUN, "--workers", "1"]
    stopped = run(tmp_path, *args, "--device", first, "--stop-at-step", "60", exact=True)
    assert stopped["steps"] == 60 and not stopped["completed"]
    summary = run(tmp_path, *args, "--device", then, "--resume", exact=True)
    assert summary["completed"] and summary["steps"] == mlp_cpu[1]["steps"] == 180
    assert summary["device"] == ("cuda:0" if then == "cuda" else "cpu")
    diff = max_param_diff(params(tmp_path), params(mlp_cpu[0]))
    assert diff < SAME_RUN, diff
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()
             if json.loads(line)["event"] == "step"]
    assert steps == sorted(set(steps)) and steps[-1] == 180


# -- parallel functions ---------------------------------------------------------------------------
def loss_and_grads(model, x, y):
    """The mean loss of this share and its gradients (on every process of the session)."""
    model.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss, [p.grad for p in model.parameters()]


def digits_epoch(processes: int | None) -> list[torch.Tensor]:
    """One epoch of SGD on digits with the gradient a parallel function of ``processes`` on
    the GPU(s); ``None``: the plain serial loop on the CPU. Returns the parameters."""
    data = load_dataset("digits")
    torch.manual_seed(0)
    device = "cpu" if processes is None else "cuda"
    model = MLP(data.input_shape, data.num_classes, width=64).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    order = torch.randperm(len(data.train.x), generator=torch.Generator().manual_seed(0))
    if processes is None:
        for idx in order.split(64):
            opt.zero_grad()
            F.cross_entropy(model(data.train.x[idx]), data.train.y[idx]).backward()
            opt.step()
        return [p.detach() for p in model.parameters()]
    grads = shoal.function(loss_and_grads, scatter=["x", "y"], reduce="avg")
    x, y = shoal.shared(data.train.x), shoal.shared(data.train.y)
    with shoal.fork(processes, device="cuda", timeout=120):
        for idx in order.split(64):
            _, g = grads(model, x, y, batch=idx)
            assert all(t.device.type == "cuda" for t in g)
            for p, gp in zip(model.parameters(), g, strict=True):
                p.grad = gp
            opt.step()
            shoal.broadcast(model)  # the workers' replicas follow
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("processes", [1, pytest.param(2, marks=two_gpus)])
def test_parallel_functions_on_the_gpu_match_the_serial_loop(processes):
    serial, parallel = digits_epoch(None), digits_epoch(processes)
    for a, b in zip(serial, parallel, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
