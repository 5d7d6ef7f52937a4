"""Where workers compute: ``--device auto/cpu/cuda`` against the GPUs a host has.

NCCL runs one rank per GPU, so a synchronous job takes ``cuda`` only with a GPU per local
worker; an asynchronous job's workers meet only through the servers' host memory and may
share GPUs. The counts of GPUs are faked here (no GPU on the machines that run ``make
test``); ``tests/test_gpu.py`` runs the same on real ones.
"""

from __future__ import annotations

import os

import pytest
import torch

import shoal
from shoal.config import TrainConfig
from shoal.core.env import pick_device, resolve_device
from shoal.core.processes import loopback_gloo_interface
from shoal.errors import ShoalError
from shoal.train import job_device
from shoal.train.launch import job_topology

from conftest import marked_processes, one_error_line, shoal_env
from conftest import shoal as shoal_command


@pytest.fixture
def gpus(monkeypatch):
    """Make torch see ``n`` GPUs (``gpus(n)``); returns the devices made current."""
    current: list[int] = []

    def fake(n: int) -> list[int]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", current.append)
        return current
    return fake


def test_auto_takes_the_gpus_only_when_each_local_worker_gets_one(gpus):
    gpus(1)
    assert pick_device("auto", 0, 1) == torch.device("cuda", 0)
    # Two workers on one GPU would be two NCCL ranks on one device: both stay on the CPU.
    assert [pick_device("auto", r, 2) for r in (0, 1)] == [torch.device("cpu")] * 2
    gpus(2)
    assert [pick_device("auto", r, 2) for r in (0, 1)] == [torch.device("cuda", 0),
                                                             torch.device("cuda", 1)]
    gpus(0)
    assert pick_device("auto", 0, 1) == torch.device("cpu")


def test_workers_that_share_gpus_take_them_round_robin(gpus):
    current = gpus(2)
    got = [pick_device("cuda", r, 3, share=True) for r in range(3)]
    assert got == [torch.device("cuda", i) for i in (0, 1, 0)] and current == [0, 1, 0]
    gpus(1)
    assert resolve_device("auto", 4, share=True) == "cuda"


@pytest.mark.parametrize(("count", "expected"), [
    (0, "--device cuda, but torch sees no CUDA GPU"),
    (1, "--device cuda: 2 processes on this host need a GPU each (NCCL runs one rank per GPU), "
        "and 1 is visible: start at most 1, or use the CPU"),
])
def test_cuda_with_too_few_gpus_is_one_line(gpus, count, expected):
    gpus(count)
    with pytest.raises(ShoalError) as exc:
        pick_device("cuda", 1, 2)
    assert str(exc.value) == expected


def cfg(strategy: str, device: str = "auto", **options) -> TrainConfig:
    return TrainConfig(strategy=strategy, device=device, strategy_options=options)


def device_of(c: TrainConfig, workers: int) -> TrainConfig:
    """``c`` with its device picked for a job of ``workers`` workers, all on this host."""
    return job_device(c, job_topology(c, workers), workers)


def test_the_job_picks_its_device_once_by_its_strategy(gpus):
    gpus(1)
    assert device_of(cfg("sync"), 1).device == "cuda"
    assert device_of(cfg("sync"), 2).device == "cpu"
    # Asynchronous workers exchange through host memory: two share the one GPU ...
    assert device_of(cfg("async-sgd", "cuda"), 2).device == "cuda"
    assert device_of(cfg("async-easgd"), 3).device == "cuda"
    assert device_of(cfg("groups", "cuda", groups=2), 2).device == "cuda"
    # ... but a compute group of two all-reduces in NCCL, and hogwild steps host memory.
    with pytest.raises(ShoalError, match="2 processes on this host need a GPU each"):
        device_of(cfg("groups", "cuda", groups=1), 2)
    assert device_of(cfg("groups", groups=1), 2).device == "cpu"
    assert device_of(cfg("hogwild"), 2).device == "cpu"
    assert device_of(cfg("sync", "cpu"), 1).device == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
@pytest.mark.parametrize("strategy", ["sync", "async-sgd"])
def test_device_cuda_without_a_gpu_is_one_line_before_any_worker(tmp_path, strategy):
    env = shoal_env()
    res = shoal_command("train", "--out", str(tmp_path / "run"), "--device", "cuda", "--workers", "2",
                "--strategy", strategy, "--epochs", "1", env=env)
    assert res.returncode == 2
    assert one_error_line(res.stderr) == "shoal: error: --device cuda, but torch sees no CUDA GPU"
    assert res.stray == [] and marked_processes(env["SHOAL_TEST_MARKER"]) == []
    assert not (tmp_path / "run").exists()


def nccl_interface() -> str | None:
    return os.environ.get("NCCL_SOCKET_IFNAME")


@pytest.mark.skipif(loopback_gloo_interface() is None, reason="no loopback interface")
def test_a_local_jobs_nccl_bootstrap_stays_on_loopback():
    """shoal's own workers are on one host: NCCL's bootstrap sockets, like Gloo's, listen on
    loopback only (NCCL would otherwise pick the machine's network interface)."""
    assert shoal.launch(nccl_interface, workers=1) == [loopback_gloo_interface()]
