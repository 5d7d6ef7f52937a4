"""Nobody else's files or messages steer shoal: planted planning sessions, forged commands
to a session's workers, strangers on its socket, links in --out.

The planning session's trials are instructions (a model to import, an output folder): a
hostile probe planted ``trials/sessions/session-N/trial-K.json`` in a shared --out and the
workers ran its model. Trials now travel sealed on the session's links
(:mod:`shoal.core.pool`). These tests plant files and send commands as someone else would
and check that shoal refuses them in one line and runs nothing of theirs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import stat
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from shoal.core.files import check_output_dir
from shoal.core.pool import join_pool
from shoal.core.trust import SEAL_KEY_VAR, Seal, open_own, private_dir
from shoal.errors import ShoalError

from conftest import run

ROOT = os.geteuid() == 0
NOBODY = 65534
EVIL = '''
from pathlib import Path
import torch

def make(input_shape, num_classes):
    Path({marker!r}).write_text("ran")
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(num_classes))
'''


def _evil(tmp_path: Path) -> tuple[str, Path]:
    """A model factory that leaves a marker file when anyone imports and calls it."""
    marker = tmp_path / "evil-ran"
    (tmp_path / "evil.py").write_text(EVIL.format(marker=str(marker)))
    return f"{tmp_path / 'evil.py'}:make", marker


# -- the pieces ------------------------------------------------------------------------------
def test_a_seal_accepts_its_own_tags_and_refuses_anything_else(monkeypatch):
    seal = Seal()
    parts = (b"nonce", b"c\x00", b'{"train": {"model": "mlp"}}')
    tag = seal.tag(*parts)
    assert len(tag) == 32 and seal.check(tag, *parts)
    assert Seal(bytes.fromhex(seal.key_hex)).check(tag, *parts)  # the workers' copy
    assert not seal.check(tag, *parts[:2], b'{"train": {"model": "/tmp/x/evil.py:make"}}')
    assert not seal.check(tag, b"another nonce", *parts[1:])
    assert not Seal().check(tag, *parts)  # another session's secret
    assert not seal.check(tag[:16], *parts) and not seal.check(b"", *parts)
    monkeypatch.delenv(SEAL_KEY_VAR, raising=False)
    with pytest.raises(ShoalError, match=f"no session secret in {SEAL_KEY_VAR}"):
        Seal.from_environment()
    monkeypatch.setenv(SEAL_KEY_VAR, seal.key_hex)
    assert Seal.from_environment().check(tag, *parts)


def test_a_private_folder_is_made_owner_only_and_refused_when_it_is_not(tmp_path):
    made = private_dir(tmp_path / "a" / "b")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    private_dir(made)  # one's own private folder: fine again
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    with pytest.raises(ShoalError, match="not a private folder of yours .*mode 0777"):
        private_dir(open_folder)
    (tmp_path / "link").symlink_to(made)
    with pytest.raises(ShoalError, match="is not a folder"):
        private_dir(tmp_path / "link")


@pytest.mark.skipif(not ROOT, reason="needs root to make a folder of another user's")
def test_a_folder_of_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ShoalError, match=f"owner uid {NOBODY}"):
        private_dir(theirs)
    with pytest.raises(ShoalError, match=f"--out {theirs} is not a folder of yours"):
        check_output_dir(theirs)


def test_an_out_folder_inside_a_world_writable_folder_without_sticky_bit_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ShoalError, match="lies inside .*shared, which anyone can write"):
        check_output_dir(shared / "run")
    shared.chmod(0o777 | stat.S_ISVTX)  # like /tmp: others cannot rename what is ours
    check_output_dir(shared / "run")
    check_output_dir(tmp_path / "mine")


def test_open_own_never_follows_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "lock").symlink_to(victim)
    with pytest.raises(ShoalError, match="symbolic link"):
        open_own(tmp_path / "lock", os.O_RDWR | os.O_CREAT)
    assert victim.read_text() == "precious"


# -- shoal as a user runs it -----------------------------------------------------------------
def _shoal(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "shoal", *args], timeout=timeout, cwd=cwd)


def test_a_link_planted_as_the_lock_file_is_refused_and_its_target_untouched(tmp_path):
    """``--out``'s lock file was opened through links and truncated: a link planted there
    to another file destroyed that file."""
    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (out / ".shoal.lock").symlink_to(victim)
    res = _shoal("train", "--model", "mlp", "--epochs", "1", "--out", str(out), cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "symbolic link" in lines[0], res.stderr
    assert victim.read_text() == "precious"


def test_a_link_planted_as_the_log_is_replaced_not_written_through(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (out / "metrics.jsonl").symlink_to(victim)
    res = _shoal("train", "--model", "mlp", "--epochs", "1", "--out", str(out), "--overwrite",
                 cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert victim.read_text() == "precious"
    assert not (out / "metrics.jsonl").is_symlink() and "epoch" in (out / "metrics.jsonl").read_text()


@pytest.mark.skipif(not ROOT, reason="needs root to plant a folder as another user")
def test_shoal_plan_refuses_a_planted_sessions_folder_and_runs_nothing_of_it(tmp_path):
    """The probe's case: another user made --out/trials/sessions/session-1 (mode 777) and put
    a trial in it naming their model."""
    model, marker = _evil(tmp_path)
    out = tmp_path / "plan"
    planted = out / "trials" / "sessions" / "session-1"
    planted.mkdir(parents=True)
    for folder in (out / "trials", out / "trials" / "sessions", planted):
        folder.chmod(0o777)
        os.chown(folder, NOBODY, NOBODY)
    (planted / "trial-0.json").write_text(f'{{"model": "{model}", "dataset": "digits"}}')
    res = _shoal("plan", "--model", "mlp", "--workers", "2", "--epochs", "2",
                 "--plan-budget", "20s", "--target-accuracy", "0.9", "--out", str(out),
                 cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{out / 'trials'}, which anyone can write" in lines[0], res.stderr
    assert not marker.exists()


def test_a_command_the_planner_did_not_send_is_refused_by_the_session_workers(tmp_path):
    """Whoever reaches a planning session's worker (here: a controller of its own, which the
    worker joined) cannot make it act: a command naming another model, sealed with any
    secret but this session's, is refused; the worker leaves with one line, and nothing of
    the command runs."""
    from shoal.config import TrainConfig

    model, marker = _evil(tmp_path)
    planted = TrainConfig(model=model, dataset="digits", out=str(tmp_path / "theirs")).to_dict()
    address = str(tmp_path / "socket")
    fake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fake.bind(address)
    fake.listen()
    fake.settimeout(60)
    worker = subprocess.Popen([sys.executable, "-m", "shoal.plan.worker", address], cwd=tmp_path,
                              env={**os.environ, SEAL_KEY_VAR: Seal().key_hex},
                              stderr=subprocess.PIPE, text=True)
    try:
        conn = Connection(fake.accept()[0].detach())
        conn.send_bytes(os.urandom(16))  # the nonce the worker signs
        assert conn.poll(60) and conn.recv_bytes()  # its hello
        for kind in ("load", "train"):
            command = json.dumps({kind: planted}).encode()
            with contextlib.suppress(OSError):
                conn.send_bytes(Seal().tag(command) + command)
        _, err = worker.communicate(timeout=60)
    finally:
        worker.kill()
        fake.close()
    assert worker.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "not sent by this shoal session" in lines[0], err
    assert not marker.exists() and not (tmp_path / "theirs").exists()


def test_a_stranger_cannot_take_a_workers_place_in_a_planning_session(tmp_path, caplog):
    """A connection to the planner's socket that does not hold the session's secret is
    refused (and said so) before the workers join: it takes no rank, it gets no command,
    and the session's own worker trains the trial."""
    from shoal.config import TrainConfig
    from shoal.plan.session import PlanningSession
    from shoal.sweep.runner import Launcher

    strangers: list = []

    class StrangerFirst(Launcher):
        def job(self, program, processes, workers, out, name, secrets=None):
            strangers.append(join_pool(program[2], 0, Seal(), 10.0))  # as rank 0, its own secret
            super().job(program, processes, workers, out, name, secrets)

    base = TrainConfig(model="mlp", dataset="digits", epochs=2, batch_size=64, workers=1,
                       progress="none", out=str(tmp_path / "base")).validate()
    with StrangerFirst(None, 120) as launcher:
        session = PlanningSession(launcher, base, 1, tmp_path / "sessions", timeout=120)
        try:
            session.run(dataclasses.replace(base, out=str(tmp_path / "good"), workers=None,
                                            stop_at_step=2))
        finally:
            session.close()
    assert (tmp_path / "good" / "summary.json").is_file()
    stranger, = strangers
    assert stranger.poll(10)
    with pytest.raises(EOFError):
        stranger.recv_bytes()
    assert any(r.levelno == logging.WARNING and "refused a connection" in r.getMessage()
               for r in caplog.records)
    assert stat.S_IMODE(session.dir.stat().st_mode) == 0o700
