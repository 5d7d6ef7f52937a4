"""The emulated cluster: namespaces, rate-limited links, a torchrun job across them, teardown."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from shoal import emulate
from shoal.core.env import NODE_CORES, default_threads
from shoal.core.hostspec import rate_bits
from shoal.emulate import Cluster, can_emulate, namespaces
from shoal.errors import ShoalError

from conftest import REPO, checkpoint_params, run, train_together

WHY_NOT = can_emulate()
SERVER = """import socket, sys
s = socket.create_server((sys.argv[1], 29555)); print("listening", flush=True)
conn, _ = s.accept(); print(conn.recv(100).decode(), flush=True)"""
CLIENT = """import socket, sys
socket.create_connection((sys.argv[1], 29555), timeout=10).sendall(b"hello from host 0")"""
needs_namespaces = pytest.mark.skipif(WHY_NOT is not None, reason=f"cannot emulate: {WHY_NOT}")


def test_rates():
    assert rate_bits("100mbit") == 100e6 and rate_bits("1Gbit") == 1e9 and rate_bits("500kbit") == 5e5
    for bad in ("100", "fast", "0mbit", "100 mb"):
        with pytest.raises(ShoalError, match="bandwidth"):
            rate_bits(bad)


@needs_namespaces
def test_cluster_sets_up_links_and_tears_down():
    cluster = Cluster(hosts=2, rate="100mbit")
    try:
        cluster.setup()
        assert set(namespaces(cluster.prefix)) == {cluster.switch, cluster.host(0), cluster.host(1)}
        qdisc = subprocess.run(["ip", "netns", "exec", cluster.host(0), "tc", "qdisc", "show",
                                "dev", cluster.ifname(0)], capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        # A TCP message from host 0 to host 1, across the switch.
        server = subprocess.Popen([*cluster.exec_args(1), sys.executable, "-c", SERVER,
                                   cluster.address(1)], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "listening"
            client = subprocess.run([*cluster.exec_args(0), sys.executable, "-c", CLIENT,
                                     cluster.address(1)], capture_output=True, text=True, timeout=30)
            assert client.returncode == 0, client.stderr
            assert server.stdout.readline().strip() == "hello from host 0"
        finally:
            server.kill()
            server.wait()
    finally:
        cluster.teardown()
    assert namespaces(cluster.prefix) == []


@needs_namespaces
def test_failed_setup_leaves_nothing(monkeypatch):
    cluster = Cluster(hosts=2, rate="1gbit")

    def broken_tc(netns, *args):
        raise ShoalError("tc exploded")

    monkeypatch.setattr(emulate, "_tc", broken_tc)
    with pytest.raises(ShoalError, match="tc exploded"):
        cluster.setup()
    assert namespaces(cluster.prefix) == []


@needs_namespaces
def test_torchrun_job_across_two_hosts(tmp_path):
    """`python -m shoal.emulate` runs a torchrun job of `shoal train` on two hosts of two
    processes each and cleans up. Its sums go host by host (``--intra-host shm``: each
    host's memory, then one leader a host across the link): the parameters are those of
    the same 4 workers summing through Gloo on one host, to float32 rounding (another
    order of the same terms), and the bytes handed to the sums the same."""
    flags = ["--model", "mlp", "--epochs", "1", "--stop-at-step", "5", "--threads-per-worker",
             "1", "--seed", "1"]
    res = run([sys.executable, "-m", "shoal.emulate", "--hosts", "2", "--nproc-per-node", "2",
               "--rate", "1gbit", "--", "-m", "shoal", "train", *flags, "--intra-host", "shm",
               "--progress", "none", "--out", str(tmp_path / "hosts")], timeout=180, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((tmp_path / "hosts" / "summary.json").read_text())
    assert summary["workers"] == 4 and summary["steps"] == 5 and summary["bytes_sent"] > 0
    assert namespaces(_cluster(res.stderr)) == []
    flat = train_together({tmp_path / "flat": [*flags, "--intra-host", "gloo"]}, workers=4)
    assert flat[tmp_path / "flat"]["bytes_sent"] == summary["bytes_sent"]
    a, b = (checkpoint_params(tmp_path / run / "checkpoint.pt") for run in ("hosts", "flat"))
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6), k


def test_one_replica_a_host_couples_the_hosts_as_its_strategy_says(tmp_path):
    """``--host-sync``: each emulated host's two processes step together (their gradients
    averaged through the host's memory) and DiLoCo couples the two hosts: the parameters
    are those of DiLoCo on two workers, one a host, each taking the host's rows (its
    batch twice as large), to float32 rounding."""
    flags = ["--strategy", "diloco", "--tau", "4", "--model", "lenet5", "--epochs", "1",
             "--lr", "0.05", "--momentum", "0.9", "--seed", "3", "--schedule", "constant"]
    res = run([sys.executable, "-m", "shoal.emulate", "--hosts", "2", "--nproc-per-node", "2",
               "--rate", "1gbit", "--", "-m", "shoal", "train", *flags, "--host-sync",
               "--batch-size", "32", "--threads-per-worker", "1", "--progress", "none",
               "--out", str(tmp_path / "hosts")], timeout=180, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    assert namespaces(_cluster(res.stderr)) == []
    train_together({tmp_path / "two": [*flags, "--batch-size", "64"]}, workers=2)
    a, b = (checkpoint_params(tmp_path / run / "checkpoint.pt") for run in ("hosts", "two"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


def _cluster(stderr):
    """The namespaces' prefix the emulated cluster said it made (other tests' clusters may
    come and go meanwhile)."""
    match = re.search(r"in namespaces (shoalemu-[0-9a-f]{6})-\*", stderr)
    assert match, stderr
    return match.group(1)


@needs_namespaces
def test_failing_job_is_torn_down(tmp_path):
    res = run([sys.executable, "-m", "shoal.emulate", "--hosts", "2", "--", "-m",
               "shoal.no_such_module"], timeout=120, cwd=REPO)
    assert res.returncode not in (0, 2), res.stdout + res.stderr  # torchrun's failure, passed on
    assert namespaces(_cluster(res.stderr)) == []


def test_cli_errors(capsys):
    assert emulate.main(["--rate", "fast", "--", "-m", "shoal"]) == 2
    assert capsys.readouterr().err.startswith("shoal: error: bandwidth 'fast'")
    assert emulate.main(["--hosts", "2"]) == 2
    assert "nothing to run" in capsys.readouterr().err


def test_an_emulated_hosts_workers_thread_on_its_share_of_the_cores(monkeypatch):
    """The emulated hosts share the machine's cores, so a worker's default threads are its
    host's share (SHOAL_NODE_CORES, set for every host), not every core of the machine: two
    hosts on two cores ran two threads each, 0.69 s a step against 0.10 s with one."""
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv(NODE_CORES, raising=False)
    assert default_threads(1) == cores
    assert Cluster(hosts=2).node_cores() == max(1, cores // 2)
    monkeypatch.setenv(NODE_CORES, "1")
    assert default_threads(1) == 1 and default_threads(4) == 1
    for ignored in ("0", "x", str(cores + 8)):  # nonsense, or more than this process may use
        monkeypatch.setenv(NODE_CORES, ignored)
        assert default_threads(1) == cores
