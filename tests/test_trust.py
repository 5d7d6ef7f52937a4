"""Nobody else's files steer shoal: planted planning sessions, trial files, links in --out.

The planning session's trials are instructions (a model to import, an output folder): a
hostile probe planted ``trials/sessions/session-N/trial-K.json`` in a shared --out and the
workers ran its model. These tests plant files as another user would and check that shoal
refuses them in one line and runs nothing of theirs.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.core.files import check_output_dir
from shoal.core.trust import Seal, open_own, private_dir
from shoal.errors import ShoalError

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
def test_a_seal_accepts_its_own_values_and_refuses_anything_else(tmp_path):
    seal = Seal()
    value = {"trial": 3, "settings": {"model": "mlp", "lr": 0.1}}
    assert seal.loads(seal.dumps(value), "x") == value
    forged = seal.dumps(value).replace("mlp", "/tmp/x/evil.py:make")
    with pytest.raises(ShoalError, match="not written by this shoal session"):
        seal.loads(forged, "trial-3.json")
    with pytest.raises(ShoalError, match="not written by this shoal session"):
        Seal().loads(seal.dumps(value), "trial-3.json")  # another session's secret
    for junk in ('{"model": "/tmp/x/evil.py:make"}', "not json", '{"body": 1, "mac": 2}'):
        with pytest.raises(ShoalError, match="not written by this shoal session"):
            seal.loads(junk, "trial-3.json")


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
    return subprocess.run([sys.executable, "-m", "shoal", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


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


def test_a_trial_file_the_planner_did_not_write_is_refused_by_the_session(tmp_path):
    """Even inside a session's own folder (someone got in), the workers run only trials
    sealed by their planner: a planted trial ends the session with one line."""
    from shoal.config import TrainConfig
    from shoal.plan.session import Session
    from shoal.sweep.runner import Launcher

    model, marker = _evil(tmp_path)
    base = TrainConfig(model="mlp", dataset="digits", epochs=2, batch_size=64, workers=1,
                       progress="none", out=str(tmp_path / "base")).validate()
    with Launcher(None, 120) as launcher:
        session = Session(launcher, base, 1, tmp_path / "sessions", timeout=120)
        try:
            good = dataclasses.replace(base, out=str(tmp_path / "good"), workers=None,
                                       stop_at_step=2)
            session.run(good)  # the session is up; now plant the next trial
            planted = dataclasses.replace(good, model=model, out=str(tmp_path / "theirs"))
            forged = Seal().dumps({"trial": 1, "settings": planted.to_dict()})
            (session.dir / "trial-1.json").write_text(forged)
            with pytest.raises(ShoalError, match="not written by this shoal session"):
                session._wait(session.dir / "trial-1.done", "trial 1")
        finally:
            session.close()
    assert not marker.exists() and not (tmp_path / "theirs").exists()
    assert stat.S_IMODE(session.dir.stat().st_mode) == 0o700
