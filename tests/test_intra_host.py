"""The intra-host shared-memory all-reduce (``--intra-host``: shoal/core/intrahost.py and
segment.py): its sums against Gloo's and a fixed-order reference, its copies (broadcast,
gathers, scatter) against Gloo's, its fallback, and what it leaves in /dev/shm (nothing)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import shoal
from shoal.core import intrahost
from shoal.core import segment as shm
from shoal.core.descendants import pid_alive
from shoal.core.hostpath import attach_hosts, join_host
from shoal.core.intrahost import HostsReducer, SharedReducer
from shoal.errors import JobError, ShoalError, WorkerError
from shoal.strategies.diloco import DiLoCoOptions
from shoal.strategies.sync import SyncOptions

from conftest import checkpoint_params, train_here, train_together

DTYPES = (torch.float32, torch.float64, torch.bfloat16)
SLOT = 4096  # bytes: small, so that 5000 elements go in several chunks
SIZES = (1, 7, 1001, 5000)


def ours() -> set[str]:
    """The shared-memory segments of shoal's in /dev/shm now."""
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith("shoal-ih-")}


def left_behind(before: set[str]) -> set[str]:
    """Segments new since ``before`` whose creator has ended: what a finished job left.
    Another test's job running beside this one (pytest-xdist) holds its own segments while
    its creator lives; those are not this job's."""
    return {n for n in ours() - before
            if (pid := shm.creator(n)) is not None and not pid_alive(pid)}


def _compare() -> list[str]:
    """On every rank: the fast path's sums against Gloo's and against the inputs added in
    rank order; returns what differed."""
    comm = shoal.init(device="cpu", timeout=60)
    n, rank = comm.world_size, comm.rank
    reducer = join_host(comm, "shm", slot_bytes=SLOT, timeout=60)
    assert reducer is not None
    wrong = []
    for direct in (reducer.direct_bytes, 0):  # 0: the reduce-scatter path from 3 ranks on
        reducer.direct_bytes = direct
        for dtype in DTYPES:
            for numel in SIZES:
                for scale in (None, 1.0 / n):
                    gen = torch.Generator().manual_seed(1000 * rank + numel)
                    x = torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)
                    mine = x.clone() if scale is None else torch.mul(x, scale)
                    got = reducer.all_reduce(x.clone(), scale)
                    rows = [torch.empty_like(mine) for _ in range(n)]
                    dist.all_gather(rows, mine)
                    ordered = torch.add(rows[0], rows[1])
                    for row in rows[2:]:
                        ordered.add_(row)
                    gloo = mine.clone()
                    dist.all_reduce(gloo)
                    what = f"{dtype} x{numel} scale {scale} direct {direct}"
                    if not torch.equal(got, ordered):
                        wrong.append(f"{what}: not the rank-order sum")
                    if n == 2 and not torch.equal(got, gloo):
                        wrong.append(f"{what}: not Gloo's sum bit for bit")
                    # Another order of the same terms: apart by rounding only.
                    bound = 2 * n * torch.finfo(dtype).eps * sum(r.double().abs() for r in rows)
                    if ((got.double() - gloo.double()).abs() > bound).any():
                        wrong.append(f"{what}: beyond rounding from Gloo's sum")
    return wrong + _compare_copies(reducer, rank, n)


def _compare_copies(reducer: SharedReducer, rank: int, n: int) -> list[str]:
    """On every rank: the fast path's broadcast, all-gather, gather and scatter against
    Gloo's, bit for bit, for every dtype a parallel function may move (in several chunks
    where the tensor is larger than a slot); returns what differed."""
    wrong = []
    for dtype in (*DTYPES, torch.int64, torch.bool):
        for numel in SIZES:
            gen = torch.Generator().manual_seed(1000 * rank + numel)
            x = (torch.randn(numel, generator=gen, dtype=torch.float64) * 100).to(dtype)
            what, src = f"{dtype} x{numel}", n - 1
            got, gloo = reducer.broadcast(x.clone(), src), x.clone()
            dist.broadcast(gloo, src)
            rows = [torch.empty_like(x) for _ in range(n)]
            reducer.all_gather(x, rows)
            at_root = [torch.empty_like(x) for _ in range(n)] if rank == 0 else None
            reducer.all_gather(x, at_root)
            gloo_rows = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(gloo_rows, x)
            shares = [x + i if dtype != torch.bool else x ^ (i % 2 == 1) for i in range(n)]
            part, gloo_part = torch.empty_like(x), torch.empty_like(x)
            reducer.scatter(shares if rank == src else None, part, src)
            dist.scatter(gloo_part, shares if rank == src else None, src)
            checks = {"broadcast": torch.equal(got, gloo),
                      "all-gather": all(map(torch.equal, rows, gloo_rows)),
                      "gather": at_root is None or all(map(torch.equal, at_root, gloo_rows)),
                      "scatter": torch.equal(part, gloo_part)}
            wrong += [f"{what}: {name} is not Gloo's" for name, ok in checks.items() if not ok]
    return wrong


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_sums_equal_gloo_and_rank_order(workers):
    before = ours()
    results = shoal.launch(_compare, workers=workers)
    assert results == [[]] * workers
    assert not left_behind(before)  # unlinked once every rank mapped it


def _compare_hosts(hosts: list[list[int]]) -> list[str]:
    """On every rank, its ranks laid out on ``hosts`` as if on several: the sums host by
    host, each in rank order, then across hosts (2 hosts: one exact addition)."""
    comm = shoal.init(device="cpu", timeout=60)
    reducer, why = attach_hosts(comm, hosts, SLOT, 60)
    assert why is None and isinstance(reducer, HostsReducer), why
    wrong = []
    for dtype in DTYPES:
        for numel in SIZES:
            for scale in (None, 1.0 / comm.world_size):
                gen = torch.Generator().manual_seed(1000 * comm.rank + numel)
                x = torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)
                mine = x.clone() if scale is None else torch.mul(x, scale)
                got = reducer.all_reduce(x.clone(), scale)
                rows = [torch.empty_like(mine) for _ in range(comm.world_size)]
                dist.all_gather(rows, mine)
                sums = []
                for host in hosts:
                    total = rows[host[0]].clone()
                    for r in host[1:]:
                        total.add_(rows[r])
                    sums.append(total)
                expected = torch.add(sums[0], sums[1])
                if not torch.equal(got, expected):
                    wrong.append(f"{dtype} x{numel} scale {scale}: not the hosts' sum")
    return wrong


@pytest.mark.parametrize("hosts", [[[0, 1], [2, 3]], [[0], [1, 2]]], ids=["2x2", "1+2"])
def test_sums_across_hosts_go_host_by_host(hosts):
    before = ours()
    workers = sum(map(len, hosts))
    assert shoal.launch(_compare_hosts, hosts, workers=workers) == [[]] * workers
    assert not left_behind(before)


def _die_inside() -> None:
    """Rank 1 is killed (kill -9) while rank 0 waits for it in an all-reduce."""
    comm = shoal.init(device="cpu", timeout=60)
    reducer = join_host(comm, "shm", timeout=60)
    assert reducer is not None
    reducer.all_reduce(torch.ones(10))
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    reducer.all_reduce(torch.ones(10))


def test_a_killed_rank_ends_the_job_and_leaves_no_segment():
    before = ours()
    with pytest.raises(WorkerError, match="rank 1"):
        shoal.launch(_die_inside, workers=2)
    assert not left_behind(before)


def test_a_dead_creators_segment_is_swept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True, timeout=30)
    stale = f"shoal-ih-{int(dead.stdout)}-{'0' * 32}"
    live = f"shoal-ih-{os.getpid()}-{'1' * 32}"
    for name in (stale, live, "shoal-ih-other"):
        (tmp_path / name).write_bytes(b"")
    assert shm.sweep_stale(str(tmp_path)) == [stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live, "shoal-ih-other"])


def test_segment_is_owner_only_and_checked(tmp_path):
    name = shm.segment_name()
    segment = shm.create_segment(name, 4096, str(tmp_path))
    assert (tmp_path / name).stat().st_mode & 0o777 == 0o600
    with pytest.raises(ValueError, match="not 8192 bytes"):
        shm.open_segment(name, 8192, str(tmp_path))
    with pytest.raises(ValueError, match="not a segment name"):
        shm.open_segment("../etc", 4096, str(tmp_path))
    segment.close()


def test_counters_wrap_around(tmp_path):
    # Two ranks as threads on one mapping, their 32-bit barrier counters about to wrap.
    size = intrahost.segment_bytes(2, SLOT)
    name = shm.segment_name()
    segment = shm.create_segment(name, size, str(tmp_path))
    for rank in range(2):
        segment[64 * rank:64 * rank + 4] = (2**32 - 3).to_bytes(4, "little")
    reducers = [SharedReducer(segment, r, 2, slot_bytes=SLOT, timeout=30) for r in range(2)]
    got: list[list[float]] = [[], []]

    def work(rank: int) -> None:
        for step in range(6):
            got[rank].append(reducers[rank].all_reduce(torch.full((3,), rank + step * 1.0))[0]
                             .item())

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert got == [[1.0 + 2 * s for s in range(6)]] * 2


class _Comm(SimpleNamespace):
    """A rank 0 whose peers said ``seen`` (host, why not) to the fast path's checks."""

    def gather_objects(self, obj):  # noqa: ANN001, ANN201
        return self.seen

    def broadcast_object(self, obj):  # noqa: ANN001, ANN201
        return obj


def fake_comm(seen: list) -> _Comm:
    return _Comm(active=True, rank=0, world_size=len(seen), device=torch.device("cpu"),
                 seen=seen)


def test_auto_falls_back_to_gloo_saying_why(caplog):
    two_hosts = fake_comm([("a", None), ("b", None)])
    with caplog.at_level(logging.DEBUG, "shoal.intrahost"):
        assert join_host(two_hosts, "auto") is None
        # a host that cannot take it: the line a user sees (WARNING); across hosts, by
        # design, only at DEBUG (--debug)
        no_shm = fake_comm([("a", None), ("a", "no /dev/shm here")])
        assert join_host(no_shm, "auto") is None
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.DEBUG, "shoal: the job's sums go through Gloo: the job spans 2 hosts, "
                       "one process each"),
        (logging.WARNING, "shoal: the job's sums go through Gloo: rank 1: no /dev/shm here")]
    with pytest.raises(ShoalError, match="--intra-host shm: rank 1: its tensors are on cuda"):
        join_host(fake_comm([("a", None), ("a", "its tensors are on cuda")]), "shm")
    assert join_host(two_hosts, "gloo") is None


def test_options_refuse_shm_with_compression():
    with pytest.raises(ShoalError, match="--intra-host shm sums uncompressed"):
        SyncOptions(intra_host="shm", compress="fp16").validate()
    with pytest.raises(ShoalError, match="--intra-host must be one of auto, gloo, shm"):
        SyncOptions(intra_host="mpi").validate()


#: Every strategy whose exchanges are sums among the job's processes, as a user runs it.
_SUMMING = {
    "sync": ["--strategy", "sync"],
    "local-sgd": ["--strategy", "local-sgd", "--tau", "2"],
    "easgd": ["--strategy", "easgd", "--tau", "2"],
    "diloco": ["--strategy", "diloco", "--tau", "4"],
    "streaming-diloco": ["--strategy", "diloco", "--tau", "4", "--fragments", "2",
                         "--overlap-steps", "1"],
    "diloco-bf16": ["--strategy", "diloco", "--tau", "4", "--outer-precision", "bf16"],
}


def test_training_on_shm_equals_gloo(tmp_path):
    """Each strategy's run through the host's memory ends with the parameters, bit for bit,
    and the bytes of the same run on Gloo (2 workers: the sums' order is the same)."""
    before = ours()
    flags = ["--model", "lenet5", "--dataset", "digits", "--epochs", "1", "--batch-size", "64",
             "--lr", "0.05", "--momentum", "0.9", "--seed", "3"]
    runs = {tmp_path / f"{name}-{mode}": [*flags, *strategy, "--intra-host", mode]
            for name, strategy in _SUMMING.items() for mode in ("gloo", "shm")}
    summaries = train_together(runs, workers=2)
    for name in _SUMMING:
        gloo, shm = (tmp_path / f"{name}-{mode}" for mode in ("gloo", "shm"))
        a, b = (checkpoint_params(out / "checkpoint.pt") for out in (gloo, shm))
        assert all(torch.equal(a[k], b[k]) for k in a), name
        assert summaries[shm]["bytes_sent"] == summaries[gloo]["bytes_sent"], name
        assert summaries[shm]["steps"] > 5 and summaries[shm]["bytes_sent"] > 0, name
    assert not left_behind(before)


def test_one_replica_a_host_on_one_host_is_one_worker_with_its_rows(tmp_path):
    """``--host-sync`` on one host: its processes step as one replica from the mean over
    their rows (an uneven last batch weighed by rows), so DiLoCo on 2 processes of 32 rows
    ends where DiLoCo on 1 worker of 64 rows does, to float32 rounding."""
    flags = ["--strategy", "diloco", "--tau", "4", "--model", "lenet5", "--dataset", "digits",
             "--epochs", "2", "--lr", "0.05", "--momentum", "0.9", "--seed", "3",
             "--schedule", "constant"]
    train_here(tmp_path / "one", *flags, "--workers", "1", "--batch-size", "64")
    train_here(tmp_path / "host", *flags, "--workers", "2", "--batch-size", "32", "--host-sync")
    a, b = (checkpoint_params(tmp_path / run / "checkpoint.pt") for run in ("one", "host"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


def test_host_sync_needs_the_hosts_memory(tmp_path, capsys):
    with pytest.raises(ShoalError, match="--host-sync averages each host's gradients through "
                                         "its memory: leave out --intra-host gloo"):
        DiLoCoOptions(host_sync=True, intra_host="gloo").validate()
    from shoal.cli import main

    assert main(["train", "--strategy", "diloco", "--workers", "2", "--elastic", "--host-sync",
                 "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == (
        "shoal: error: --host-sync keeps each host's processes one replica through its memory, "
        "which a re-formed group does not follow: leave out --elastic")
    assert not (tmp_path / "run").exists()



def _mapped_then_idle(name: str, size: int, parent: int, conn) -> None:
    """Rank 1 of a reducer whose segment is ``name``: maps it, says so, never sums."""
    from ps_doubles import send_to_parent

    SharedReducer(shm.open_segment(name, size), 1, 2, slot_bytes=SLOT, timeout=60,
                  pids=[parent, os.getpid()])
    send_to_parent(conn, "mapped")
    threading.Event().wait(60)


def test_a_rank_killed_before_a_sum_is_named_at_once_not_at_the_timeout():
    """Rank 1's process ends (kill -9) while rank 0 waits for it inside a sum: rank 0 names
    it within a second (it watches each rank's process), not after the 60 s timeout."""
    from ps_doubles import Children

    name, size = shm.segment_name(), intrahost.segment_bytes(2, SLOT)
    segment = shm.create_segment(name, size)
    with Children() as kids:
        try:
            kids.start(_mapped_then_idle, name, size, os.getpid())
            assert kids.recv(0) == "mapped"
        finally:
            shm.unlink_segment(name)
        reducer = SharedReducer(segment, 0, 2, slot_bytes=SLOT, timeout=60,
                                pids=[os.getpid(), kids.procs[0].pid])
        os.kill(kids.procs[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(JobError, match="rank 1's process ended inside the shared-memory"):
            reducer.all_reduce(torch.ones(10))
        assert time.monotonic() - start < 1.0
