"""A one-host job's store lets in its own user only (shoal.core.gate): a client of the same
uid, in another process, works through the gate as on a plain TCPStore; one of another uid
(root turned nobody, in a process of its own) is closed before its first command reaches the
store, cannot reach the store's own listener at all, and is reported once; the store keeps
its keys; the gate's threads and sockets end with the store; a real job trains through it."""

from __future__ import annotations

import gc
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from shoal.core.gate import INNER_HOST, port_filter, refused_line, supported
from shoal.core.processes import loopback_store

from conftest import REPO, train

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not supported(), reason="the gate is Linux only (/proc)")]

NOBODY = 65534
SECRET = bytes(range(32))

#: A client of the job's store, sealed with its secret, in another process of the same uid.
SAME_USER = r"""
import sys
from datetime import timedelta
import torch.distributed as dist
from shoal.core.sealed import SealedStore
port = int(sys.argv[1])
inner = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=10),
                      wait_for_workers=False)
store = SealedStore(inner, bytes(range(32)))
assert store.get("from-parent") == b"hello"
store.set("from-child", "world")
assert store.add("counter", 5) == 7
assert store.compare_set("vote", "", "commit") == b"commit"
assert store.compare_set("vote", "other", "abort") == b"commit"
store.wait(["from-parent", "from-child"], timedelta(seconds=5))
store.wait(["late"], timedelta(seconds=10))  # set by the parent once it saw ours
print("ok", store.get("late").decode())
"""

#: Another user's client: torch imported as root, then the process turns nobody before it
#: makes any socket. Prints one line per attempt.
OTHER_USER = r"""
import encodings.idna, os, socket, sys  # idna: read by socket calls, later unreadable
from datetime import timedelta
import torch.distributed as dist
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
port = int(sys.argv[1])
try:
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=5),
                          wait_for_workers=False)
    store.set("intruder", "x")
    print("torch: reached", store.get("intruder"))
except Exception as exc:
    print("torch: refused", type(exc).__name__)
raw = socket.create_connection(("127.0.0.1", port), timeout=5)  # the kernel takes it...
raw.sendall(b"\x00" * 64)
try:
    print("raw:", "closed" if raw.recv(1) == b"" else "answered")  # ...the gate closes it
except ConnectionResetError:
    print("raw: closed")
inner = socket.socket()
inner.settimeout(2)
try:
    inner.connect((sys.argv[2], port))
    print("inner: reached")
except OSError as exc:
    print("inner: refused", type(exc).__name__)
"""


def _gate_threads(port: int) -> list[str]:
    """The threads of the gate of the store at ``port`` (another test's may live on)."""
    names = {f"shoal-store-gate-{port}", f"shoal-store-gate-{port}-conn"}
    return [t.name for t in threading.enumerate() if t.name in names]


def _python(script: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                          text=True, timeout=120, env=env, cwd=REPO, **kwargs)


def test_a_client_of_the_same_user_works_through_the_gate():
    store = loopback_store(10.0, SECRET)
    store.set("from-parent", "hello")
    store.add("counter", 2)
    child = subprocess.Popen([sys.executable, "-c", SAME_USER, str(store.port)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO)
    try:
        store.wait(["from-child"], timedelta(seconds=60))
        assert store.get("from-child") == b"world"
        store.set("late", "done")
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0 and out.split() == ["ok", "done"], err
    assert store.add("counter", 0) == 7 and store.get("vote") == b"commit"
    del store


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_a_client_of_another_user_is_closed_before_its_first_command(caplog):
    caplog.set_level(logging.WARNING, logger="shoal.store")
    store = loopback_store(10.0, SECRET)
    store.set("kept", "yes")
    mine = dist.TCPStore("127.0.0.1", store.port, None, False, timeout=timedelta(seconds=10),
                         wait_for_workers=False)  # a plain client of the same user
    res = _python(OTHER_USER, str(store.port), INNER_HOST)
    assert res.stdout.splitlines() == ["torch: refused DistNetworkError", "raw: closed",
                                       "inner: refused TimeoutError"], res.stdout + res.stderr
    assert not mine.check(["intruder"])  # its set never reached the store
    assert store.get("kept") == b"yes"  # and the job's keys are all there
    refused = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert refused == [refused_line(NOBODY)]  # its many tries, said once
    del store, mine


def test_the_gate_ends_with_its_store_and_cuts_its_clients():
    store = loopback_store(10.0, SECRET)
    port = store.port
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    deadline = time.monotonic() + 10
    while len(_gate_threads(port)) < 3 and time.monotonic() < deadline:  # accepting, 2 carried
        time.sleep(0.01)
    assert len(_gate_threads(port)) >= 3, _gate_threads(port)
    start = time.monotonic()
    del store
    gc.collect()
    while _gate_threads(port) and time.monotonic() - start < 10:
        time.sleep(0.01)
    assert _gate_threads(port) == [] and time.monotonic() - start < 5
    client.settimeout(5)
    assert client.recv(1) == b""  # cut, not left hanging
    client.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_the_filter_lets_in_its_ports_from_loopback_only():
    """The store's listener drops a connection from any port but the gate's, and from any
    address but 127.0.0.1 (another user could bind the gate's port on 127.0.0.3)."""
    from shoal.core.gate import attach_filter

    with socket.socket() as listener, socket.socket() as allowed:
        allowed.bind(("127.0.0.1", 0))
        port = allowed.getsockname()[1]
        attach_filter(listener, port_filter([1, port]))
        listener.bind((INNER_HOST, 0))
        listener.listen()
        allowed.settimeout(5)
        allowed.connect(listener.getsockname())
        for source in (("127.0.0.1", 0), ("127.0.0.3", port)):
            with socket.socket() as other:
                other.bind(source)
                other.settimeout(1)
                with pytest.raises(TimeoutError):
                    other.connect(listener.getsockname())


def test_a_job_trains_through_the_gate(tmp_path: Path):
    summary = train(tmp_path / "out", "--workers", "2", "--epochs", "1", "--dataset", "digits")
    assert summary["completed"], summary
