"""An emulated slow cluster on one machine: K network-namespace "hosts" behind a rate-limited switch.

Each host is a Linux network namespace with one veth link to a "switch" namespace holding a
bridge. Both ends of every link get a ``tbf`` (token bucket) qdisc, so each host sends and
receives at most ``rate`` (e.g. ``100mbit``); nothing else about the machine changes: the
namespaces share its CPUs, memory, file system and host name, and traffic never leaves it
(private addresses ``10.77.0.0/24`` inside namespaces this module creates). A multi-node job
runs across them with ``torchrun``, one node per namespace, through c10d rendezvous::

    sudo python -m shoal.emulate --hosts 2 --rate 100mbit -- -m shoal train --model lenet5 ...

Hosts can be uneven: ``--emulate-slow 1:0.25`` runs host 1's processes in a cgroup of their
own that lets them use a quarter of one core (:mod:`shoal.core.cpulimit`: the kernel throttles
them), and ``--link-rate 1:10mbit`` gives host 1's link its own rate.
The hosts share the machine's cores: each host's processes are told their share
(``SHOAL_NODE_CORES``, the cores over the hosts), which a worker's default thread count
follows (:func:`shoal.core.env.default_threads`).

Everything carries a unique name prefix and is torn down on exit, on errors and on
SIGINT/SIGTERM; when the process that made a cluster is killed outright (SIGKILL), a watcher
it started first (:func:`shoal.core.guard.after_death`) removes the cluster within seconds.
``python -m shoal.emulate --cleanup`` removes every ``shoalemu-*`` left all the same.
Needs root (``CAP_NET_ADMIN``). netem (latency, loss) is not used: only ``tbf``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from shoal.core import cpulimit
from shoal.core.cpulimit import CpuLimit, check_fraction
from shoal.core.env import NODE_CORES
from shoal.core.guard import after_death, guarded_command
from shoal.core.hostspec import burst_bytes, link_rates, rate_bits, slow_hosts
from shoal.core.limits import check_processes
from shoal.core.logs import install as install_logging
from shoal.core.trust import SEAL_KEY_VAR, open_own
from shoal.errors import ShoalError

log = logging.getLogger("shoal.emulate")
out_log = logging.getLogger("shoal.out")  # its results

#: Every namespace this module creates starts with this.
PREFIX = "shoalemu"
SUBNET = "10.77.0"
RENDEZVOUS_PORT = 29400
def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise ShoalError(f"`{' '.join(cmd)}` failed: {res.stderr.strip() or res.returncode}")
    return res


def _tc(netns: str, *args: str) -> None:
    cmd = ["ip", "netns", "exec", netns, "tc", *args]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise ShoalError(f"`{' '.join(cmd)}` failed: {res.stderr.strip() or res.returncode}")


def namespaces(prefix: str = PREFIX) -> list[str]:
    """Network namespaces whose names start with ``prefix``."""
    if shutil.which("ip") is None:
        return []
    res = _ip("netns", "list", check=False)
    return [line.split()[0] for line in res.stdout.splitlines()
            if line.strip() and line.split()[0].startswith(prefix)]


def can_emulate() -> str | None:
    """``None`` when namespaces can be made here; otherwise why not (one line)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the `ip` and `tc` commands (iproute2) are not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    name = f"{PREFIX}-probe-{uuid.uuid4().hex[:6]}"
    res = _ip("netns", "add", name, check=False)
    if res.returncode != 0:
        return f"`ip netns add` is not permitted here: {res.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Kill what runs in, and delete, every namespace and cpu cgroup starting with ``prefix``;
    return them."""
    found = namespaces(prefix)
    for ns in found:
        _kill_namespace(ns)
        _ip("netns", "del", ns, check=False)
    return found + cpulimit.cleanup(prefix)


def _kill_namespace(ns: str) -> None:
    """SIGKILL the processes inside namespace ``ns`` (only ours: we made the namespace)."""
    res = _ip("netns", "pids", ns, check=False)
    for pid in res.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


@dataclass
class Cluster:
    """``hosts`` namespaces joined through a bridge, each link limited to ``rate`` both ways
    (``links``: host -> its own rate), the processes of each host in ``slow`` held to that
    fraction of one core.

    Use as a context manager; :meth:`torchrun` runs a job with one node per host.
    """

    hosts: int = 2
    rate: str = "1gbit"
    slow: dict[int, float] = field(default_factory=dict)
    links: dict[int, str] = field(default_factory=dict)
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    _made: list[str] = field(default_factory=list, init=False, repr=False)
    _limits: dict[int, CpuLimit] = field(default_factory=dict, init=False, repr=False)
    _reaper: subprocess.Popen | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= 200:
            raise ShoalError(f"--hosts must be between 1 and 200, got {self.hosts}")
        rate_bits(self.rate)  # a one-line error for a bad rate, before anything is made
        for flag, given in (("--emulate-slow", self.slow), ("--link-rate", self.links)):
            bad = sorted(h for h in given if not 0 <= h < self.hosts)
            if bad:
                raise ShoalError(f"{flag}: host {bad[0]} is out of range: the cluster has "
                                 f"{self.hosts} hosts (0-{self.hosts - 1})")
        for host, fraction in self.slow.items():
            check_fraction(fraction, f"--emulate-slow {host}:{fraction:g}")
        for rate in self.links.values():
            rate_bits(rate)

    def host_rate(self, i: int) -> str:
        """Host ``i``'s link rate, each way."""
        return self.links.get(i, self.rate)

    # -- names --------------------------------------------------------------------------------
    @property
    def prefix(self) -> str:
        return f"{PREFIX}-{self.tag}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def host(self, i: int) -> str:
        """The namespace of host ``i``."""
        return f"{self.prefix}-h{i}"

    def ifname(self, i: int) -> str:
        """Host ``i``'s interface (at most 15 characters, as Linux requires)."""
        return f"se{self.tag}h{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    # -- life cycle ---------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def setup(self) -> None:
        """Create the switch, the hosts, their rate-limited links and the slow hosts' CPU
        throttles (tears down on failure)."""
        why = can_emulate() or (cpulimit.can_throttle() if self.slow else None)
        if why is not None:
            raise ShoalError(f"cannot emulate a cluster: {why}")
        try:
            self._start_reaper()
            self._add_netns(self.switch)
            _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
            _ip("link", "set", "br0", "up", netns=self.switch)
            for i in range(self.hosts):
                ns, mine, port = self.host(i), self.ifname(i), f"se{self.tag}s{i}"
                self._add_netns(ns)
                _ip("link", "add", mine, "netns", ns, "type", "veth", "peer", "name", port,
                    "netns", self.switch)
                _ip("link", "set", port, "master", "br0", netns=self.switch)
                _ip("addr", "add", f"{self.address(i)}/24", "dev", mine, netns=ns)
                burst = burst_bytes(rate_bits(self.host_rate(i)))
                for where, dev in ((ns, mine), (self.switch, port)):
                    _ip("link", "set", dev, "up", netns=where)
                    _tc(where, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                        self.host_rate(i), "burst", str(burst), "latency", "50ms")
                _ip("link", "set", "lo", "up", netns=ns)
            for i, fraction in sorted(self.slow.items()):
                self._limits[i] = CpuLimit(self.host(i), fraction)
                self._limits[i].create()
        except BaseException:
            self.teardown()
            raise

    def _start_reaper(self) -> None:
        """A watcher that removes this cluster's namespaces and cgroups if this process dies
        without tearing them down (SIGKILL): :func:`shoal.core.guard.after_death`."""
        cmd = [sys.executable, "-m", "shoal.emulate", "--cleanup-tag", self.tag]
        self._reaper = subprocess.Popen(after_death(cmd), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, start_new_session=True)

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def teardown(self) -> None:
        """Kill everything inside this cluster's namespaces and delete them and its cgroups."""
        for ns in reversed(self._made):
            _kill_namespace(ns)
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        for limit in self._limits.values():
            limit.remove()
        self._limits.clear()
        cleanup(self.prefix)  # whatever a failed set-up made before it was booked
        if self._reaper is not None:  # nothing left for it: stopped before it runs anything
            self._reaper.kill()
            self._reaper.wait(timeout=10)
            self._reaper = None

    # -- running jobs -------------------------------------------------------------------------
    def exec_args(self, i: int, env: dict[str, str] | None = None) -> list[str]:
        """The command prefix that runs a program on host ``i``."""
        pairs = [f"{k}={v}" for k, v in (env or {}).items()]
        return ["ip", "netns", "exec", self.host(i), "env", *pairs]

    def torchrun_args(self, i: int, nproc_per_node: int = 1, run_id: str | None = None
                      ) -> list[str]:
        """``torchrun`` as node ``i`` of a job with one node per host (c10d rendezvous on host 0).

        The namespaces share the machine's host name, so the node holding the rendezvous
        says ``is_host=1`` and every node names its own address (``--local-addr``).
        """
        torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
        return [
            torchrun, "--nnodes", str(self.hosts), "--nproc-per-node", str(nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.address(0)}:{RENDEZVOUS_PORT}",
            "--rdzv-id", run_id or self.tag, "--rdzv-conf", f"is_host={int(i == 0)}",
            "--local-addr", self.address(i), "--max-restarts", "0",
            "--monitor-interval", "0.5",
        ]

    def node_cores(self) -> int:
        """A host's share of the machine's cores: the hosts share them, so a worker's default
        threads (:func:`shoal.core.env.default_threads`) are its host's, not the machine's."""
        return max(1, len(os.sched_getaffinity(0)) // self.hosts)

    def torchrun(self, program: Sequence[str], nproc_per_node: int = 1, timeout: float = 600,
                 env: dict[str, str] | None = None, log: Path | None = None) -> int:
        """Run ``torchrun ... PROGRAM`` on every host; return the first non-zero exit status.

        ``program`` is what follows torchrun's own options (``-m shoal train ...``). ``env``
        reaches every node's processes through their environment (not their command line,
        which anyone on the machine can read), with the job's secret (``SHOAL_SECRET``, a fresh
        one unless this process has one). Output goes to ``log`` when given (else to
        this process's), appended, never through a symbolic link. When a node fails, the
        others are stopped; nothing outlives this call, and nothing outlives this process
        (each host's torchrun dies with it, see :mod:`shoal.core.guard`).
        """
        # Each host runs torchrun's agent (an interpreter with torch) and its workers.
        check_processes(f"{self.hosts} emulated hosts x {nproc_per_node} workers",
                        self.hosts * (1 + nproc_per_node))
        run_id = uuid.uuid4().hex[:8]
        # The job's secret (shoal.core.secret), fresh unless given: the hosts share no key file.
        env = {SEAL_KEY_VAR: os.environ.get(SEAL_KEY_VAR) or secrets.token_hex(32), **(env or {})}
        procs: list[subprocess.Popen] = []
        out = os.fdopen(open_own(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab") \
            if log is not None else None
        try:
            for i in range(self.hosts):
                node_env = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": self.ifname(i),
                            NODE_CORES: str(self.node_cores())}
                cmd = [*self.exec_args(i), *self.torchrun_args(i, nproc_per_node, run_id), *program]
                procs.append(subprocess.Popen(guarded_command(cmd), start_new_session=True,
                                              stdout=out, env=node_env,
                                              stderr=subprocess.STDOUT if out else None))
                if i in self._limits:  # before it forks: only exec()s come first (guard, ip, env)
                    self._limits[i].add(procs[-1].pid)
            deadline = time.monotonic() + timeout
            while True:
                codes = [p.poll() for p in procs]
                failed = [c for c in codes if c not in (None, 0)]
                if failed:
                    return failed[0]
                if all(c == 0 for c in codes):
                    return 0
                if time.monotonic() > deadline:
                    raise ShoalError(f"the emulated job did not finish in {timeout:.0f} s")
                time.sleep(0.2)
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            if out is not None:
                out.close()


@contextlib.contextmanager
def terminate_as_exception() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into an exception so ``finally`` blocks tear down namespaces."""
    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old: dict[int, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        old[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shoal.emulate [--hosts K] [--rate R] -- PROGRAM...`` (see module docstring)."""
    p = argparse.ArgumentParser(
        prog="python -m shoal.emulate",
        description="Run a torchrun job across K emulated hosts (network namespaces) joined by "
                    "rate-limited links. Needs root.")
    p.add_argument("--hosts", type=int, default=2, help="emulated machines (default 2)")
    p.add_argument("--rate", default="1gbit", help="per-link bandwidth, each way (default 1gbit)")
    p.add_argument("--emulate-slow", "--slow", default=None, metavar="HOST:FRACTION[,...]",
                   help="hold a host's processes to a fraction of one core (1:0.25: host 1 at a "
                        "quarter of a core), with a cgroup of the cpu controller")
    p.add_argument("--link-rate", "--emulate-link-rate", default=None,
                   metavar="HOST:RATE[,...]", help="a host's own link rate (1:10mbit)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="workers per host (default 1)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before giving up")
    p.add_argument("--cleanup", action="store_true",
                   help=f"only remove namespaces and cgroups named {PREFIX}-* left by killed runs")
    p.add_argument("--cleanup-tag", default=None, help=argparse.SUPPRESS)  # a cluster's reaper
    p.add_argument("--check", action="store_true", help="only say whether emulation works here")
    p.add_argument("program", nargs=argparse.REMAINDER,
                   help="after --: torchrun's program, e.g. -m shoal train --model lenet5")
    args = p.parse_args(argv)
    install_logging()  # its lines as a command's: results on stdout, notices on stderr
    try:
        if args.cleanup_tag is not None:  # the reaper of a cluster whose owner died
            if not re.fullmatch(r"[0-9a-f]{6}", args.cleanup_tag):
                raise ShoalError(f"--cleanup-tag: not a cluster's tag: {args.cleanup_tag!r}")
            cleanup(f"{PREFIX}-{args.cleanup_tag}")
            return 0
        if args.cleanup:
            removed = cleanup()
            out_log.info(f"removed {len(removed)} namespace(s) and cgroup(s)"
                         + (": " + ", ".join(removed) if removed else ""))
            return 0
        if args.check:
            why = can_emulate()
            out_log.info("emulation works here" if why is None else f"cannot emulate: {why}")
            return 0 if why is None else 1
        program = args.program[1:] if args.program[:1] == ["--"] else args.program
        if not program:
            raise ShoalError("nothing to run: give torchrun's program after --, "
                             "e.g. -- -m shoal train --model lenet5")
        slow = slow_hosts(args.emulate_slow) if args.emulate_slow else {}
        links = link_rates(args.link_rate) if args.link_rate else {}
        with terminate_as_exception(), Cluster(args.hosts, args.rate, slow, links) as cluster:
            log.info(f"shoal.emulate: {args.hosts} hosts in namespaces {cluster.prefix}-*, torn "
                     "down at the end")
            return cluster.torchrun(program, args.nproc_per_node, args.timeout)
    except ShoalError as exc:
        log.error(f"shoal: error: {exc}")
        return 2
    except KeyboardInterrupt:
        log.error("shoal: interrupted; emulated cluster torn down")
        return 130


if __name__ == "__main__":
    sys.exit(main())
