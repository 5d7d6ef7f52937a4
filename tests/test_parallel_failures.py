"""A parallel session fails loudly and never hangs: dead workers, stuck workers, Ctrl-C; a
broken session stays broken until a new fork; a session listens on loopback only; its
trace shows every rank's calls."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shoal
from shoal.core.timeline import COMM, COMPUTE
from shoal.errors import WorkerError

from conftest import REPO, is_loopback, listening_sockets, marked_processes, shoal_env

pytestmark = pytest.mark.timeout(90)


@contextlib.contextmanager
def marked_fork(n: int, **kwargs):
    """fork() whose workers carry a marker; afterwards none of them may be left."""
    marker = uuid.uuid4().hex
    os.environ["SHOAL_TEST_MARKER"] = marker
    try:
        session = shoal.fork(n, **kwargs)
    finally:
        del os.environ["SHOAL_TEST_MARKER"]
    try:
        yield session
    finally:
        shoal.close()
        assert not session.procs or all(p.exitcode is not None for p in session.procs)
        assert [p for p in marked_processes(marker) if p != os.getpid()] == [], "stray workers"


def fails_within(seconds: float, why: str, fn, rows: int, match: str) -> WorkerError:
    """Call ``fn`` with ``x`` of ``rows`` rows scattered in the open session: it must raise a
    WorkerError matching ``match`` within ``seconds``; returns the error."""
    f = shoal.function(fn, scatter=["x"], reduce="sum")
    start = time.monotonic()
    with pytest.raises(WorkerError, match=match) as info:
        f(torch.ones(rows))
    assert time.monotonic() - start < seconds, why
    return info.value


def exit_on_rank1(x):
    if dist.get_rank() == 1:
        os._exit(3)
    return x.sum()


def spin_on_rank1(x):
    while dist.get_rank() == 1:
        pass
    return x.sum()


def total(x):
    return x.sum()


def rank_sum():
    return dist.get_rank() if dist.is_initialized() else 0


def sleep_while_rank1_is_killed(x):
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(20)
    return x.sum()


def wait_on_rank2_while_rank1_is_killed(x):
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if dist.get_rank() == 2:
        time.sleep(60)
    t = torch.zeros(1)
    dist.broadcast(t, src=2)  # rank 0 waits here for rank 2, which is alive but busy
    return x.sum()


def test_dead_worker_raises_with_its_rank():
    with marked_fork(2, timeout=60) as session:
        error = fails_within(10, "noticing a dead worker took too long",
                             exit_on_rank1, 4, "rank 1: worker process exited with code 3")
        assert error.rank == 1
        assert session.closed
        with pytest.raises(shoal.ShoalError, match="broken by rank 1's failure"):
            session.check_open()


def test_worker_killed_between_calls_is_noticed_at_the_next_call():
    with marked_fork(2, timeout=60) as session:
        f = shoal.function(total, scatter=["x"], reduce="sum")
        assert f(torch.ones(4)).item() == 4
        session.procs[0].kill()
        session.procs[0].join(5)
        with pytest.raises(WorkerError, match="rank 1: worker process killed by signal 9"):
            f(torch.ones(4))


def test_calls_after_a_worker_failure_raise_until_a_new_fork():
    model = nn.Linear(2, 1)
    fail = shoal.function(exit_on_rank1, scatter=["x"], reduce="sum")
    ranks = shoal.function(rank_sum, reduce="sum")
    broken = r"rank 1: the parallel session is broken by rank 1's failure \(worker process exited " \
             r"with code 3\); call shoal.fork\(\) again"
    with marked_fork(2, timeout=60):
        assert ranks() == 1
        with pytest.raises(WorkerError, match="rank 1: worker process exited with code 3"):
            fail(torch.ones(4))
        for later in (ranks, lambda: fail(torch.ones(4)), lambda: shoal.all_reduce(model),
                      lambda: shoal.broadcast(model), lambda: shoal.replicate(model), ranks):
            with pytest.raises(WorkerError, match=broken) as info:
                later()  # not silently serial
            assert info.value.rank == 1 and "\n" not in str(info.value)
        with marked_fork(2, timeout=60):  # a new session starts afresh
            assert ranks() == 1
    assert ranks() == 0  # closed: calls are serial again


def test_worker_killed_mid_call_is_noticed_while_rank_0_sleeps():
    with marked_fork(2, timeout=60) as session:
        error = fails_within(8, "rank 0 noticed only when its own 20 s share ended",
                             sleep_while_rank1_is_killed, 4, "rank 1: worker process killed by signal 9")
        assert error.rank == 1
        assert session.closed


def test_worker_killed_mid_call_releases_rank_0_from_a_collective():
    with marked_fork(3, timeout=60):
        fails_within(8, "rank 0 stayed in the collective",
                     wait_on_rank2_while_rank1_is_killed, 6, "rank 1: worker process killed by signal 9")


def _other_interface() -> str | None:
    """A network interface other than loopback that has an IPv4 address, if any."""
    for _, name in socket.if_nameindex():
        if name == "lo":
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        return name
    return None


def test_session_listens_on_loopback_only(monkeypatch):
    # Even a user's GLOO_SOCKET_IFNAME naming the network (kept for their own jobs) must not
    # put the session's process group on it; the variable is theirs again afterwards.
    other = _other_interface()
    if other is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", other)
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    with marked_fork(2, timeout=60) as session:
        pids = [os.getpid()] + [p.pid for p in session.procs]
        sockets = listening_sockets(pids)
        assert {pid for pid, _, _ in sockets} == set(pids)  # the store and every rank's Gloo
        assert [s for s in sockets if not is_loopback(s[1])] == []
        assert os.environ.get("GLOO_SOCKET_IFNAME") == before
        assert shoal.function(total, scatter=["x"], reduce="sum")(torch.ones(4)).item() == 4


def test_stuck_worker_times_out():
    with marked_fork(2, timeout=3):
        fails_within(15, "a stuck worker took too long to time out",
                     spin_on_rank1, 4, "rank 1: did not answer within 3 s")


def test_context_manager_closes_cleanly():
    with marked_fork(3, timeout=60) as session:
        with session:
            f = shoal.function(total, scatter=["x"], reduce="sum")
            assert f(torch.ones(9)).item() == 9
        assert session.closed and all(p.exitcode == 0 for p in session.procs)


CTRL_C = textwrap.dedent("""
    import faulthandler, signal, sys, time
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's diagnostics on a hang
    import torch, torch.distributed as dist
    import shoal

    def slow(x, where):
        if where == "everywhere" or dist.get_rank() == 1:
            time.sleep(120)
        return x.sum()

    if __name__ == "__main__":
        f = shoal.function(slow, scatter=["x"], reduce="sum")
        with shoal.fork(2, timeout=300):
            print("running", flush=True)
            f(torch.ones(4), sys.argv[1])
""")


@pytest.mark.parametrize("where", ["everywhere", "worker"])
def test_ctrl_c_stops_every_worker(tmp_path, where):
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C)
    marker = uuid.uuid4().hex
    # As from a terminal: a suite started in the background by a non-interactive shell has
    # SIGINT ignored, which children inherit, and Python then installs no Ctrl-C handler.
    proc = subprocess.Popen([sys.executable, str(script), where], cwd=REPO, env=shoal_env(marker),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "running"
        time.sleep(1.0)
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGUSR1)  # every thread's stack, on stderr
            time.sleep(1.0)
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"the controller outlived Ctrl-C by 30 s; its stderr:\n{err}")
        assert time.monotonic() - start < 10
        assert proc.returncode != 0 and "KeyboardInterrupt" in err
        deadline = time.monotonic() + 10
        while marked_processes(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marked_processes(marker) == [], "workers outlived Ctrl-C"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_function_a_worker_cannot_import_is_an_error(tmp_path, monkeypatch):
    (tmp_path / "ghostmod.py").write_text("def total(x):\n    return x.sum()\n")
    with marked_fork(2, timeout=60) as session:
        monkeypatch.syspath_prepend(str(tmp_path))  # after the fork: importable here only
        import ghostmod

        f = shoal.function(ghostmod.total, scatter=["x"], reduce="sum")
        with pytest.raises(WorkerError, match="rank 1: could not load total .*No module named 'ghostmod'"):
            f(torch.ones(4))
        assert not session.closed
        assert shoal.function(total, scatter=["x"], reduce="sum")(torch.ones(4)).item() == 4


def summed_after_all_reduce(x):
    shoal.all_reduce(x.sum(0), op="sum")
    return x.sum()


def test_trace_has_every_ranks_calls(tmp_path):
    path = tmp_path / "trace.json"
    with marked_fork(2, timeout=60, trace=path) as session:
        f = shoal.function(summed_after_all_reduce, scatter=["x"], reduce="sum")
        assert f(torch.ones(8, 3)).item() == 24
        assert f(torch.ones(6, 3)).item() == 18
        totals = session.timeline.totals
        assert totals[COMPUTE] > 0 and totals[COMM] > 0 and session.bytes_sent > 0
        assert not path.exists()  # written when the session closes
    trace = json.loads(path.read_text())
    lanes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert lanes == {0: "rank 0", 1: "rank 1"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] == rank]
        assert {"data", "compute", "comm"} <= {e["cat"] for e in mine}, mine
        bodies = [e for e in mine if e["name"] == "summed_after_all_reduce"]
        assert len(bodies) == 2 and all(e["cat"] == "compute" for e in bodies)
        assert [e["cat"] for e in mine if e["name"] == "all_reduce"] == ["comm", "comm"]
    assert trace["otherData"]["world_size"] == 2
    assert all(trace["otherData"]["bytes_sent"][r] > 0 for r in ("0", "1"))
    assert list(tmp_path.iterdir()) == [path]  # written in place, no temporary file left
    with pytest.raises(shoal.ShoalError, match="trace's directory .* does not exist"):
        shoal.fork(2, trace=tmp_path / "missing" / "trace.json")  # before any worker starts
    assert shoal.parallel.current() is None


def test_without_a_session_a_call_is_the_serial_function():
    assert shoal.parallel.current() is None
    x = torch.arange(21.0).reshape(7, 3)
    f = shoal.function(lambda x: (x.mean(0), x.shape[0]), scatter=["x"], reduce=["avg", "sum"])
    mean, rows = f(x, num_slices=3)
    torch.testing.assert_close(mean, x.mean(0))
    assert rows == 7
    with shoal.fork(1) as session:  # a session of one: no workers, same answers
        assert session.procs == []
        torch.testing.assert_close(f(x)[0], x.mean(0))


NO_CLOSE = textwrap.dedent("""
    import torch, shoal

    def total(x):
        return x.sum()

    if __name__ == "__main__":
        shoal.fork(2)
        print(shoal.function(total, scatter=["x"], reduce="sum")(torch.ones(4)).item())
""")


def test_program_that_never_closes_exits_cleanly(tmp_path):
    script = tmp_path / "no_close.py"
    script.write_text(NO_CLOSE)
    marker = uuid.uuid4().hex
    try:
        res = subprocess.run([sys.executable, str(script)], cwd=REPO, env=shoal_env(marker),
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and res.stdout.strip() == "4.0", res.stderr
        assert marked_processes(marker) == []  # not killed for us: they exited with it
    finally:
        for pid in marked_processes(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
