"""The job's store, authenticated (shoal.core.sealed, shoal.core.secret): a client that is not
part of the job can neither read nor address its keys, and a value written at a key's real
(blinded) name without the secret, or replayed, is ignored and reported once while the job
goes on. The wrapper's pieces on a real TCPStore, a Gloo group formed over it, and one real
``shoal train --elastic`` job forged at from outside. Gloo on CPU."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shoal.cli import main
from shoal.core.env import Environment
from shoal.core.processes import loopback_store
from shoal.core.sealed import MAGIC, SealedStore, forged_line
from shoal.core.secret import SECRET_VAR, derived_secret, job_secret, use_secret_file
from shoal.emulate import Cluster, can_emulate
from shoal.errors import ShoalError

from conftest import assert_went_on_without, shoal_env, train_losing

pytestmark = pytest.mark.timeout(600)


def _outsider(port: int, timeout: float = 2.0) -> dist.TCPStore:
    """A client of the store at ``port`` that is not part of the job (no secret)."""
    return dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False)


@pytest.fixture
def served():
    """A sealed store served here (5 s timeouts), a client of it, and an outsider's client."""
    server = loopback_store(5.0)
    yield server, server.client(), _outsider(server.port)
    del server


def _write(outsider: dist.TCPStore, name: str, value: str | bytes) -> None:
    """``outsider`` sets ``name``, and waits until the store has it (a TCPStore client's set
    is not answered: a call on another connection could otherwise come first)."""
    outsider.set(name, value)
    outsider.get(name)


def _forgeries(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "unauthenticated" in r.getMessage()]


def test_values_are_sealed_and_names_blinded_so_an_outsider_reads_nothing(served):
    server, client, outsider = served
    keys = dist.PrefixStore("shoal/0", client)
    keys.set("abort", "rank 1 failed")
    assert keys.get("abort") == b"rank 1 failed" and server.get("shoal/0/abort") == b"rank 1 failed"
    assert keys.add("hb/0/1", 5) == 5 and keys.add("hb/0/1", 0) == 5
    # The outsider knows the logical names (they are in shoal's source) and finds none.
    assert outsider.num_keys() >= 2
    assert not outsider.check(["shoal/0/abort"]) and not outsider.check(["shoal/0/hb/0/1"])
    with pytest.raises(dist.DistStoreError):
        outsider.get("shoal/0/abort")
    raw = outsider.get(client.name("shoal/0/abort"))  # only with the secret's blinded name
    assert raw.startswith(MAGIC) and len(client.name("shoal/0/abort")) == 2 + 32


def test_a_forged_value_is_ignored_once_reported_and_the_real_one_taken(served, caplog):
    server, client, outsider = served
    name = client.name("shoal/0/elastic/1/members")
    _write(outsider, name, "0,5")  # a forged member list at the real name
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(client.get("shoal/0/elastic/1/members")))
    with caplog.at_level(logging.WARNING, logger="shoal.store"):
        reader.start()
        time.sleep(0.5)  # the reader meets the forged value and waits on
        assert reader.is_alive() and not got
        assert not server.check(["shoal/0/elastic/1/members"])
        server.set("shoal/0/elastic/1/members", "0,1")
        reader.join(10)
    assert got == [b"0,1"]
    assert _forgeries(caplog) == [forged_line("shoal/0/elastic/1/members")]  # once
    # the other blocking reads wait the same way, until the store's timeout
    _write(outsider, client.name("shoal/0/abort"), b"\x00shoal-sealed-1\x00" + bytes(60))
    with pytest.raises(dist.DistStoreError, match="no sealed value of shoal/0/abort"):
        client.wait(["shoal/0/abort"], timedelta(seconds=1))


class _SlowWaits:
    """A store whose waits of under 10 ms time out before answering, as torch's wait does
    on a loaded machine when its reply takes longer than the wait's last millisecond."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def wait(self, keys, timeout) -> None:
        if timeout.total_seconds() < 0.01:
            raise dist.DistStoreError(f"wait timeout after 1ms, keys: {keys}")
        self._inner.wait(keys, timeout)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_a_forged_value_at_the_wait_s_end_is_named_even_when_torch_s_wait_times_out(served,
                                                                                   caplog):
    """A wait that meets only a forged value ends at its deadline with shoal's line, not
    torch's timeout of the wait's last millisecond (a fresh clone's suite met that once);
    a key that never came keeps torch's timeout."""
    server, client, outsider = served
    _write(outsider, client.name("shoal/0/abort"), b"\x00shoal-sealed-1\x00" + bytes(60))
    client._inner = _SlowWaits(client._inner)
    with pytest.raises(dist.DistStoreError, match="no sealed value of shoal/0/abort"):
        client.wait(["shoal/0/abort"], timedelta(seconds=0.3))
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        client.wait(["shoal/0/never"], timedelta(seconds=0.3))


def test_a_reader_woken_before_its_key_is_there_waits_for_the_real_value(served, caplog):
    """torch's store wakes the waiters of a key on any compare-and-set of it, a failed one on
    a missing key too, and a woken get then answers an empty value. One member's empty read
    of a meeting's decision made that meeting failed for it alone (the others committed):
    the group then re-formed again and again until the job failed. A reader, a waiter and
    a checker all wait for the real value, with no forgery reported; an empty value at the
    key (as a delete between wait and get leaves it) is no value either."""
    server, client, outsider = served
    key = "shoal/0/elastic/0/0/decision"
    got: dict[str, object] = {}

    def read(how: str) -> None:
        reader = server.client()
        try:
            if how == "wait":
                reader.wait([key], timedelta(seconds=4))
            got[how] = reader.get(key)
        except RuntimeError as exc:
            got[how] = exc

    readers = [threading.Thread(target=read, args=(how,), daemon=True) for how in ("get", "wait")]
    with caplog.at_level(logging.WARNING, logger="shoal.store"):
        for reader in readers:
            reader.start()
        time.sleep(0.3)
        ends = time.monotonic() + 0.6
        while time.monotonic() < ends:  # probes that wake the readers (torch's compare_set)
            outsider.compare_set(client.name(key), b"probe", b"probe")
            assert not client.check([key])
            time.sleep(0.02)
        _write(outsider, client.name(key), b"")
        assert not client.check([key])
        assert all(reader.is_alive() for reader in readers)
        dist.PrefixStore("shoal/0", client).set("elastic/0/0/decision", "commit")
        for reader in readers:
            reader.join(timeout=5)
    assert got == {"get": b"commit", "wait": b"commit"}
    assert _forgeries(caplog) == []


def test_a_value_superseded_then_replayed_is_refused(served, caplog):
    server, client, outsider = served
    name = client.name("shoal/0/ended/1")
    client.set("shoal/0/ended/1", "old")
    old = outsider.get(name)  # what a sniffer saw on the wire
    server.set("shoal/0/ended/1", "new")
    assert server.get("shoal/0/ended/1") == b"new"  # answered: the set came first
    assert client.get("shoal/0/ended/1") == b"new"
    _write(outsider, name, old)
    with caplog.at_level(logging.WARNING, logger="shoal.store"):
        assert not client.check(["shoal/0/ended/1"])
        client.set_timeout(timedelta(seconds=1))
        with pytest.raises(dist.DistStoreError):
            client.get("shoal/0/ended/1")
    assert _forgeries(caplog) == [forged_line("shoal/0/ended/1")]
    # A value sealed for another key does not verify at this one either.
    _write(outsider, client.name("shoal/0/ended/2"), outsider.get(client.name("shoal/0/ended/1")))
    assert not client.check(["shoal/0/ended/2"])


def test_compare_set_takes_sealed_values_and_counts_a_forged_one_as_none(served, caplog):
    server, client, outsider = served
    assert client.compare_set("d", "x", "y") == b"x"  # absent: torch's answer
    assert client.compare_set("d", "", "commit") == b"commit"
    assert server.compare_set("d", "", "abort") == b"commit"  # the first vote stands
    assert server.compare_set("d", "commit", "commit+stop") == b"commit+stop"
    assert client.get("d") == b"commit+stop"
    _write(outsider, client.name("e"), "fail")  # a forged decision before anyone voted
    with caplog.at_level(logging.WARNING, logger="shoal.store"):
        assert client.compare_set("e", "", "commit") == b"commit"
    assert server.get("e") == b"commit" and _forgeries(caplog) == [forged_line("e")]
    assert client.delete_key("e") and not client.check(["e"])


def test_a_gloo_group_forms_over_it_and_a_forged_members_address_is_ignored(served, caplog):
    server, _, outsider = served
    # Gloo's rendezvous keys under the group's prefix: "<prefix>/0/<rank>", each rank's address.
    _write(outsider, server.name("g/0/1"), b"forged address of rank 1")
    sums: dict[int, torch.Tensor] = {}

    def rank(r: int) -> None:
        group = dist.ProcessGroupGloo(dist.PrefixStore("g", server.client()), r, 2,
                                      timedelta(seconds=30))
        t = torch.full((3,), float(r + 1))
        group.allreduce([t]).wait()
        sums[r] = t

    with caplog.at_level(logging.WARNING, logger="shoal.store"):
        ranks = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
        ranks[0].start()
        time.sleep(1.0)  # rank 0 meets the forged address first; rank 1's real one comes later
        ranks[1].start()
        for t in ranks:
            t.join(60)
    assert sums.keys() == {0, 1} and all(torch.equal(s, torch.full((3,), 3.0)) for s in sums.values())
    assert forged_line("g/0/1") in _forgeries(caplog)


def test_the_secret_given_in_a_file_or_the_environment_or_derived(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_VAR, raising=False)
    monkeypatch.delenv("SHOAL_JOIN_SECRET", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    env = Environment(rank=0, world_size=2, local_world_size=2, launcher="torchrun",
                      master_port=29511)
    derived = job_secret(env)
    key_file = tmp_path / "config" / "shoal" / "secret"
    assert oct(key_file.stat().st_mode & 0o777) == "0o600" and len(key_file.read_bytes()) == 32
    assert derived == derived_secret(env) != derived_secret(Environment(master_port=29512))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-job")
    assert derived_secret(env) != derived
    key_file.chmod(0o644)
    with pytest.raises(ShoalError, match="not a file of yours that only you can read"):
        job_secret(env)
    secret = tmp_path / "secret"
    secret.write_text("ab" * 32 + "\n")
    secret.chmod(0o640)
    with pytest.raises(ShoalError, match="--secret-file .* chmod 600"):
        use_secret_file(secret)
    with pytest.raises(ShoalError, match="^--secret-file needs a file name$"):
        use_secret_file("")
    with pytest.raises(ShoalError, match=f"--secret-file {tmp_path} is not a file of yours"):
        use_secret_file(tmp_path)  # a folder: refused before it is opened as a file
    secret.chmod(0o600)
    use_secret_file(secret)
    assert os.environ[SECRET_VAR] == "ab" * 32 and job_secret(env) == bytes.fromhex("ab" * 32)
    assert job_secret(Environment(secret="cd" * 16)) == bytes.fromhex("cd" * 16)
    monkeypatch.setenv(SECRET_VAR, "too short")
    with pytest.raises(ShoalError, match="SHOAL_SECRET must be a secret of at least 32 hex"):
        job_secret(env)


def test_a_secret_file_others_can_read_is_one_line(tmp_path, capsys):
    import shoal

    secret = tmp_path / "secret"
    secret.write_text("ab" * 32)
    secret.chmod(0o644)
    with pytest.raises(ShoalError, match="is not a file of yours that only you can read"):
        shoal.init(secret_file=str(secret))  # before anything joins
    code = main(["train", "--out", str(tmp_path / "run"), "--secret-file", str(secret)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0
    assert err.startswith(f"shoal: error: --secret-file {secret} is not a file of yours")


def _forge(out: Path, found: dict[str, object]) -> None:
    """From outside the job in ``out`` (a client without its secret): the literal keys of
    issue 55 written, then, with the blinded names a sniffer of the job's traffic would see
    (computed here from the job file's secret), forged values of the keys shoal acts on. What
    the outsider could read is put in ``found``."""
    path, deadline = out / ".shoal-join" / "job.json", time.monotonic() + 120
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    job = json.loads(path.read_text())
    outsider = _outsider(job["store"][1], timeout=10.0)
    literal = {"shoal/0/ended/1": "killed by signal 9", "shoal/0/abort": "forged",
               "shoal/0/elastic/1/members": "0", "shoal/0/elastic/0/3/decision": "fail"}
    blinded = {**literal, "shoal/0/ended/0": "killed by signal 9",
               "shoal/0/elastic/0/4/decision": "fail", "shoal/0/elastic/1/here/2": "1"}
    for key, value in literal.items():
        outsider.set(key, value)
    sniffed = SealedStore(outsider, bytes.fromhex(job["key"]))
    for key, value in blinded.items():
        outsider.set(sniffed.name(key), value)
    found["readable"] = [k for k in ("shoal/0/joined/all", "shoal/0/generation/0", "shoal/job")
                         if outsider.check([k])]


def test_forgeries_from_outside_a_running_job_change_nothing_and_are_reported(tmp_path):
    # One --elastic job of 3 workers in which worker 2 kills itself at its 40th forward: the
    # group re-forms once (elastic/1/members), with the forgeries all in place before any rank
    # starts (the job file, which holds the store's port, comes first).
    out, found = tmp_path / "run", {}
    forger = threading.Thread(target=_forge, args=(out, found), daemon=True)
    forger.start()
    res = train_losing(out, 2, "train:40", "--schedule", "constant")
    forger.join(30)
    assert res.returncode == 0, res.stderr
    assert res.stray == [] and found["readable"] == []
    assert_went_on_without(out, 2, 2)  # worker 1 not expelled, 0 not lost, nobody added
    for key in ("shoal/0/ended/1", "shoal/0/abort", "shoal/0/elastic/1/members"):
        lines = res.stderr.count(forged_line(key) + "\n")
        assert lines == 1, f"{key}: reported {lines} times\n{res.stderr}"  # once, by one rank
    assert "shoal: error" not in res.stderr and "exited with code 75" not in res.stderr


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="a network namespace needs unshare and root")
def test_a_third_host_cannot_reach_a_one_host_jobs_store(tmp_path):
    # The store of a job on one host listens on loopback only: from another host (a network
    # namespace of its own) nothing answers at its port, forged or not.
    server = loopback_store(5.0)
    probe = ("import socket,sys; s=socket.socket(); s.settimeout(5); "
             f"sys.exit(s.connect_ex(('127.0.0.1', {server.port})) == 0)")
    res = subprocess.run(["unshare", "--net", "sh", "-c", f"ip link set lo up 2>/dev/null; "
                          f"exec {sys.executable} -c \"{probe}\""], capture_output=True,
                         text=True, timeout=60, env=shoal_env())
    if "Operation not permitted" in res.stderr:
        pytest.skip("no network namespaces here")
    assert res.returncode == 0, res.stderr
    assert server.port > 0


# One process per emulated host: host 0 serves a job's store on its network address (as a
# job spanning hosts does), host 1 is a member, host 2 an outsider who can reach the port.
HOST_ROLE = """import json, logging, sys
from datetime import timedelta
import torch.distributed as dist
from shoal.core.sealed import SealedStore
role, addr, port, secret = sys.argv[1], sys.argv[2], int(sys.argv[3]), bytes.fromhex(sys.argv[4])
logging.basicConfig(level=logging.WARNING, format="%(message)s")
inner = dist.TCPStore(addr, port, None, role == "serve", timeout=timedelta(seconds=60),
                      wait_for_workers=False)
if role == "forge":
    for name, value in json.loads(sys.argv[5]).items():
        inner.set(name, value)
        inner.get(name)
    print(json.dumps([k for k in json.loads(sys.argv[6]) if inner.check([k])]), flush=True)
    sys.exit()
store = SealedStore(inner, secret)
if role == "serve":
    print("serving", flush=True)
    store.wait(["shoal/0/done"])
else:
    seen = {k: store.check([f"shoal/0/{k}"]) for k in ("ended/1", "abort", "elastic/1/members")}
    store.set("shoal/0/elastic/1/members", "0,1")
    seen["members"] = store.get("shoal/0/elastic/1/members").decode()
    store.set("shoal/0/done", "1")
    print(json.dumps(seen), flush=True)
"""


@pytest.mark.skipif(can_emulate() is not None, reason=f"cannot emulate: {can_emulate()}")
def test_forgeries_from_a_third_host_change_nothing_and_are_reported(tmp_path):
    secret, port = os.urandom(32), 29541
    literal = {"shoal/0/ended/1": "killed by signal 9", "shoal/0/abort": "forged",
               "shoal/0/elastic/1/members": "0,5"}
    sniffed = SealedStore(dist.HashStore(), secret)  # its names: what a sniffer would see
    forged = {**literal, **{sniffed.name(k): v for k, v in literal.items()}}
    with Cluster(hosts=3, rate="1gbit") as cluster:
        common = [cluster.address(0), str(port), secret.hex()]
        server = subprocess.Popen([*cluster.exec_args(0), sys.executable, "-c", HOST_ROLE,
                                   "serve", *common], stdout=subprocess.PIPE, text=True,
                                  env=shoal_env())
        try:
            assert server.stdout.readline().strip() == "serving"
            forger = subprocess.run(
                [*cluster.exec_args(2), sys.executable, "-c", HOST_ROLE, "forge", *common,
                 json.dumps(forged), json.dumps(list(literal))],
                capture_output=True, text=True, timeout=60, env=shoal_env())
            assert forger.returncode == 0, forger.stderr
            assert json.loads(forger.stdout) == list(literal)  # it wrote them: the port answered
            member = subprocess.run(
                [*cluster.exec_args(1), sys.executable, "-c", HOST_ROLE, "member", *common],
                capture_output=True, text=True, timeout=60, env=shoal_env())
            assert member.returncode == 0, member.stderr
            server.wait(timeout=30)
        finally:
            server.kill()
            server.wait()
    assert json.loads(member.stdout) == {"ended/1": False, "abort": False,
                                         "elastic/1/members": False, "members": "0,1"}
    for key in literal:
        assert member.stderr.count(forged_line(key)) == 1, member.stderr
