"""Joining a running elastic job (shoal join OUT): worker 2 of 3 is killed (kill -9) mid-epoch,
a new worker joins at the next meeting point, takes its state from worker 0 (or, worker 0
lost, the lowest id left) over the process group, and the job ends with 3 workers, every
sample of every epoch trained exactly once.
And every way ``shoal join`` refuses, in one line. Real processes, Gloo on CPU."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from conftest import (
    REPO,
    TRAIN_ROWS,
    TorchWatch,
    assert_each_sample_once,
    one_error_line,
    popen,
    samples_trained,
    shoal,
    shoal_env,
    step_workers,
    train_here,
    wait_gone,
)

pytestmark = pytest.mark.timeout(300)

EPOCHS = 3


class HeldJob:
    """``shoal train`` in the background whose workers (all but rank ``SHOAL_TEST_KILL_RANK``,
    which dies at its ``held_after``-th forward) train slowly (``pace`` s a forward) after it while
    ``hold`` exists; its stderr lines are collected, and the hold is let go once a worker
    joined (or at :meth:`release`)."""

    def __init__(self, tmp_path, *args: str, kill: bool = True, workers: int = 3,
                 held_after: int = 40, model: str = "killed_then_held", killed: int = 2,
                 release_on_join: bool = True, env: dict[str, str] | None = None,
                 torchrun: bool = False, pace: float = 0.2) -> None:
        self.out, self.hold = tmp_path / "run", tmp_path / "hold"
        self.hold.touch()
        self.release_on_join = release_on_join
        self.env = {**shoal_env(), **(env or {})}
        self.env.update(SHOAL_TEST_KILL_AT=f"train:{held_after}", SHOAL_TEST_HOLD=str(self.hold),
                        SHOAL_TEST_PACE=str(pace), **({"SHOAL_TEST_KILL_RANK": str(killed)} if kill else {}))
        self.lines: list[str] = []
        self.joiners: list[subprocess.Popen] = []
        launch = ["torch.distributed.run", "--standalone", "--nproc-per-node", str(workers),
                  "-m", "shoal", "train"] if torchrun else ["shoal", "train", "--workers",
                                                            str(workers)]
        self.proc = popen(
            [sys.executable, "-m", *launch, "--out", str(self.out), "--progress", "plain",
             "--model", f"tests.fixtures_models:{model}", "--dataset", "digits",
             "--epochs", str(EPOCHS), "--schedule", "constant",
             "--log-every", "1", *args], self.env, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if " joined at step " in line and self.release_on_join:
                self.release()

    def release(self) -> None:
        self.hold.unlink(missing_ok=True)

    def wait_for(self, found, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not found():
            assert self.proc.poll() is None, f"the job ended before {what}:\n{self.stderr}"
            assert time.monotonic() < deadline, f"no {what} in {timeout:g} s:\n{self.stderr}"
            time.sleep(0.1)

    def wait_for_job_file(self) -> None:
        """Until the job has written the file ``shoal join`` reads."""
        self.wait_for(lambda: (self.out / ".shoal-join" / "job.json").exists(), "the job file")

    def wait_for_records(self, lines: int) -> None:
        """Until a worker has written ``lines`` lines of its ``--record-samples`` (it trained
        and exchanged)."""
        def written() -> int:
            return max((len(p.read_text().splitlines())
                        for p in (self.out / "samples").glob("worker*.jsonl")), default=0)
        self.wait_for(lambda: written() >= lines, f"{lines} lines of samples")

    def wait_line(self, text: str) -> None:
        self.wait_for(lambda: any(text in line for line in self.lines), repr(text))

    def join_in_background(self, **env: str) -> subprocess.Popen:
        """``shoal join OUT`` started now, its stderr piped (ended at :meth:`stop`)."""
        self.joiners.append(popen(
            [sys.executable, "-m", "shoal", "join", str(self.out)],
            {**self.env, "SHOAL_TEST_MARKER": uuid.uuid4().hex, **env},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
            start_new_session=True))
        return self.joiners[-1]

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def finish(self, timeout: float = 180.0) -> int:
        self.release()
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def stop(self) -> None:
        """Clean-up, whatever happened: the whole session killed."""
        self.release()
        for proc in [self.proc, *self.joiners]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        wait_gone(self.env["SHOAL_TEST_MARKER"], 5.0)


@pytest.fixture
def held(tmp_path):
    jobs: list[HeldJob] = []

    def start(*args: str, **kwargs) -> HeldJob:
        jobs.append(HeldJob(tmp_path, *args, **kwargs))
        return jobs[-1]

    yield start
    for job in jobs:
        job.stop()


# Worker 0 killed: worker 1, rank 0 from then on, admits the joiner, hands it its state and
# writes the records.
# sync+powersgd: PowerSGD starts afresh on every member at each change (its state is in the
# digest: the joiner's equals worker 0's), compressing again after a 2-step warm-up.
# diloco+streaming: fragments, overlap, int8 messages (all-gathered, with error feedback); at
# the meeting that sees the request the members exchange every fragment (as at an epoch's
# end) so that all work counts, and the joiner takes the state with no exchange in flight
# and no residual (its own starts at zero).
EXTRA = {"powersgd": ["--compress", "powersgd", "--powersgd-warmup", "2"],
         "streaming": ["--tau", "8", "--fragments", "2", "--overlap-steps", "1",
                       "--outer-precision", "int8"]}


# (Plain sync: the torchrun case below; diloco losing worker 2: the streaming case, its
# plain case loses worker 0.)
@pytest.mark.parametrize("strategy, killed", [("sync+powersgd", 2), ("local-sgd", 2),
                                              ("easgd", 2), ("diloco", 0),
                                              ("diloco+streaming", 2)])
def test_a_worker_joins_in_place_of_a_killed_one(held, strategy, killed):
    strategy, _, extra = strategy.partition("+")
    flags = EXTRA[extra] if extra else [] if strategy == "sync" else ["--tau", "4"]
    # held at 1 s a step from the kill on: some 75 s for the joiner to start and be admitted
    # however loaded the machine (0.2 s left 15 s, and a loaded machine ran out)
    job = held("--strategy", strategy, *flags, "--elastic", "--record-samples", killed=killed,
               pace=1.0)
    job.wait_line(f"worker {killed} left at step {42 if extra == 'streaming' else 39}")
    # its own marker: no process of the joiner's outlives it
    joined = shoal("join", str(job.out), env={**job.env, "SHOAL_TEST_MARKER": uuid.uuid4().hex},
                   timeout=240)
    assert job.finish() == 0, job.stderr
    assert joined.returncode == 0, joined.stderr
    assert "joining the job" in joined.stderr and joined.stray == []
    summary = json.loads((job.out / "summary.json").read_text())
    assert summary["completed"] and summary["workers"] == 3
    left, join = summary["membership_changes"]
    assert left["left"] == [killed] and left["workers"] == 2
    assert left["why"] == {str(killed): f"worker {killed} killed by signal 9"}
    assert join["joined"] == [3] and join["why"] == {"3": "joined"} and join["workers"] == 3
    # the joiner's state, digested after it took it, is worker 0's at the join
    assert join["joiner_state_sha256"] == {"3": join["state_sha256"]}
    assert f"worker 3 joined at step {join['step']}" in job.stderr
    counts = samples_trained(job.out)
    assert set(counts.values()) == {1}, "a sample was trained twice"
    assert sorted(counts) == [(e, s) for e in range(EPOCHS) for s in range(TRAIN_ROWS)]
    assert (job.out / "samples" / "worker3.jsonl").stat().st_size > 0
    workers = step_workers(job.out)
    assert workers[join["step"]] == 2 and workers[join["step"] + 1] == 3
    assert workers[max(workers)] == 3
    assert not (job.out / ".shoal-join").exists()  # taken away at the end


def test_a_worker_joins_a_torchrun_job_with_the_secret_its_ranks_have(held, monkeypatch):
    """torchrun --standalone, 3 ranks, sync --elastic, the join secret in SHOAL_JOIN_SECRET:
    rank 2 is killed (its keeper says so, torchrun sees no failure); ``shoal join OUT``
    without the secret, and ``shoal join --store`` (rank 0's address of the job's store, for
    a host that does not see OUT) with another secret, are refused in one line; ``shoal
    join --store`` with it joins, its job file in OUT gone; the job ends with 3 workers and
    torchrun's status 0, every sample once."""
    secret = "5a" * 32
    # three commands come before the join: a slower pace (1 s a step, while held) leaves them
    # some 50 s however loaded the machine, where 0.2 s left 10 s and a loaded CI ran out
    job = held("--elastic", "--record-samples", torchrun=True, pace=1.0,
               env={"SHOAL_JOIN_SECRET": secret})
    job.wait_line("worker 2 left at step 39")
    monkeypatch.delenv("SHOAL_JOIN_SECRET", raising=False)  # the refusals: in this process
    code, err = join_here(job.out)
    assert code == 2 and one_error_line(err) == (
        f"shoal: error: the job in {job.out} runs under torchrun, srun or mpirun: give shoal "
        "join the secret its ranks have, in SHOAL_SECRET")
    [said] = [line for line in job.lines if "shoal join --store " in line]
    at = said.split("shoal join --store ")[1].split(")")[0]
    monkeypatch.setenv("SHOAL_JOIN_SECRET", "a5" * 32)
    code, err = join_here("--store", at)
    assert code == 2 and one_error_line(err) == (  # the store is sealed with the ranks' secret
        f"shoal: error: the store at {at} holds no shoal job that takes joiners under the "
        "secret in SHOAL_SECRET (another job's secret? its ranks need the same; rank 0 says "
        "where it takes joiners)")
    (job.out / ".shoal-join" / "job.json").unlink()  # as on a host that does not see OUT
    monkeypatch.setenv("SHOAL_JOIN_SECRET", secret)
    code, err = join_here("--store", at)  # (the command's own process: the tests above)
    assert job.finish() == 0, job.stderr
    assert code == 0, err
    summary = json.loads((job.out / "summary.json").read_text())
    assert summary["completed"] and summary["workers"] == 3
    left, join = summary["membership_changes"]
    assert left["left"] == [2] and join["joined"] == [3]
    assert join["joiner_state_sha256"] == {"3": join["state_sha256"]}
    counts = samples_trained(job.out)
    assert set(counts.values()) == {1}, "a sample was trained twice"
    assert sorted(counts) == [(e, s) for e in range(EPOCHS) for s in range(TRAIN_ROWS)]
    assert not (job.out / ".shoal-join").exists()  # rank 0's keeper took it away


@pytest.mark.cold  # what the joiner's own process imports
@pytest.mark.parametrize("strategy, servers", [("async-easgd", 2), ("hogwild", 1)])
def test_a_worker_joins_an_asynchronous_job_in_place_of_a_killed_one(held, strategy, servers):
    """async-easgd on 2 servers: worker 2 (rank 4: the servers are ranks 0 and 1) is killed
    mid-epoch 2, its rest is dealt to workers 0 and 1, and a joiner, admitted by server 0 and
    served by both from then on, starts from the center as its first pull has it (both
    shards), is given the last third of the rest of each of their blocks and trains it: the
    job ends with 3 workers, every sample of every epoch once. hogwild: the same, its counts
    in the shared file server 0 reads, the joiner on the shared parameters themselves.
    (Server 0's refusals: test_elastic_async.py.)"""
    job = held("--strategy", strategy, *(["--tau", "4"] if strategy != "hogwild" else []),
               *(["--servers", str(servers)] if servers > 1 else []), "--elastic",
               "--record-samples", killed=2 + servers)
    job.wait_line("worker 2 left at step")
    joiner = job.join_in_background()
    # shoal join's own process imports no torch: its work runs in a process its server forks
    watch = TorchWatch(joiner.pid)
    job.wait_for(lambda: watch.look() or any("worker 3 joined at step" in line
                                             for line in job.lines), "the join")
    assert watch.forked and watch.torch
    job.release()
    _, err = joiner.communicate(timeout=240)
    assert joiner.returncode == 0, err
    assert job.finish() == 0, job.stderr
    summary = json.loads((job.out / "summary.json").read_text())
    assert summary["completed"] and summary["workers"] == 3 and not summary["degraded"]
    left, join = summary["membership_changes"]
    assert left["left"] == [2] and left["workers"] == 2
    assert join["joined"] == [3] and join["workers"] == 3 and join["epoch"] >= 2
    # the joiner's model, digested after its first pull, is the center server 0 sent it
    if strategy == "hogwild":
        assert join["state"] == "the shared parameters, mapped" and "state_sha256" not in join
    else:
        assert join["joiner_state_sha256"] == {"3": join["state_sha256"]}
    assert_each_sample_once(job.out, EPOCHS, TRAIN_ROWS)
    records = [json.loads(line) for line in
               (job.out / "samples" / "worker3.jsonl").read_text().splitlines()]
    assert sum(len(r["samples"]) for r in records) == join["samples_dealt_again"] > 0


def test_a_worker_joins_a_compute_groups_job_as_a_group_of_its_own(held):
    """groups on 4 workers (groups 0-1 and 2-3): worker 2 (rank 3), a leader, is killed and
    worker 3 takes its place; a joiner comes in as worker 4, a group of its own, starts
    from the center its first pull has, and is given a third of each group's rest (worker
    3 gives group 2-3's, as its leader now): the job ends with 4 workers, every sample of
    every epoch once."""
    # killed early: each group has its own rest only (46 group steps), slowed till the join
    job = held("--strategy", "groups", "--groups", "2", "--elastic", "--record-samples",
               workers=4, killed=3, held_after=10, pace=0.3)
    job.wait_line("worker 3 leads its compute group in worker 2's place")
    joiner = job.join_in_background()
    job.wait_line("worker 4 joined at step")
    _, err = joiner.communicate(timeout=240)
    assert joiner.returncode == 0, err
    assert job.finish() == 0, job.stderr
    summary = json.loads((job.out / "summary.json").read_text())
    assert summary["completed"] and summary["workers"] == 4 and not summary["degraded"]
    left, join = summary["membership_changes"]
    assert left["left"] == [2] and left["group_led_by"] == 3
    assert join["joined"] == [4] and join["workers"] == 4
    assert join["joiner_state_sha256"] == {"4": join["state_sha256"]}
    records = [json.loads(line) for line in
               (job.out / "samples" / "worker4.jsonl").read_text().splitlines()]
    assert sum(len(r["samples"]) for r in records) == join["samples_dealt_again"] > 0
    assert_each_sample_once(job.out, EPOCHS, TRAIN_ROWS)


@pytest.mark.parametrize("strategy", ["async-easgd", "easgd"])
def test_resumed_on_more_workers_than_its_checkpoint_holds_the_others_join(held, tmp_path,
                                                                          strategy):
    """``--resume --workers 3`` of a checkpoint of 2 workers that only 2 can go on from (an
    asynchronous job's; easgd's inside a round): the 2 start again and the launcher starts
    the third as ``shoal join`` would, which joins; the job ends with 3 workers, every
    sample of every epoch once, the join in the summary. Before: refused in one line.
    async-easgd is stopped by SIGTERM once joined and resumed so once more: its next joiner
    is worker 3, as server 0 numbers it (before, the joiner took id 2 again from the job
    file, its pair was never served and it failed)."""
    flags = ["--strategy", strategy, "--tau", "4", "--elastic", "--record-samples"]
    # the checkpoint of 2 workers: trained in this process (its workers from the session's
    # warm fork server), as the job below would have (no kill, no hold)
    train_here(tmp_path / "run", "--model", "tests.fixtures_models:killed_then_held",
               "--dataset", "digits", "--epochs", str(EPOCHS), "--schedule", "constant",
               "--log-every", "1", *flags, "--stop-at-step", "30", "--workers", "2")
    joiners = [2, 3] if strategy == "async-easgd" else [2]
    for me in joiners:
        last = me == joiners[-1]
        # slow till the join; the last run then trains on at full speed
        job = held(*flags, "--resume", kill=False, workers=3, held_after=0, release_on_join=last)
        job.wait_line(f"worker {me} joined at step ")
        if not last:
            job.proc.send_signal(signal.SIGTERM)
        assert job.finish() == (0 if last else 143), job.stderr
        assert "holds 2 workers' state" in job.stderr and "2 start again and 1 more join them" \
            in job.stderr and f"worker {me} finished with the job" in job.stderr, job.stderr
        assert "did not" not in job.stderr, job.stderr
    summary = json.loads((job.out / "summary.json").read_text())
    assert summary["completed"] and summary["workers"] == 3
    joins = [c for c in summary["membership_changes"] if "joined" in c]
    assert [c["joined"] for c in joins] == [[me] for me in joiners]
    for change, me in zip(joins, joiners, strict=True):
        assert change["joiner_state_sha256"] == {str(me): change["state_sha256"]}
    # (the joiner stopped by SIGTERM right after its join may have had no work count)
    assert (job.out / "samples" / f"worker{joiners[-1]}.jsonl").stat().st_size > 0
    assert_each_sample_once(job.out, EPOCHS, TRAIN_ROWS)


def test_sigterm_stops_an_asynchronous_job_and_its_joiner_and_it_resumes(held):
    """SIGTERM to the launcher of an asynchronous job a worker joined: the job stops,
    the joiner with it (server 0 tells it: the launcher's signal does not reach ``shoal
    join``'s process), each command ends (143 with the checkpoint's line, the join 0), and
    the job resumes from the checkpoint with every sample of every epoch trained once (the
    joiner's rest dealt to the others). Before, the joiner trained on alone and the
    launcher waited for it."""
    job = held("--strategy", "async-easgd", "--tau", "4", "--elastic", "--record-samples",
               "--max-workers", "3", kill=False, workers=2, held_after=10,
               release_on_join=False, pace=0.5)
    job.wait_for_job_file()
    joiner = job.join_in_background()
    job.wait_line("worker 2 joined at step")
    job.proc.send_signal(signal.SIGTERM)
    assert job.proc.wait(timeout=60) == 143, job.stderr
    _, err = joiner.communicate(timeout=60)
    assert joiner.returncode == 0, err
    assert "stopped by SIGTERM" in job.stderr and (job.out / "checkpoint.pt").exists()
    job.release()
    resume_here(job)
    summary = json.loads((job.out / "summary.json").read_text())
    assert summary["completed"] and summary["membership_changes"][0]["joined"] == [2]
    assert_each_sample_once(job.out, EPOCHS, TRAIN_ROWS)


@pytest.mark.parametrize("strategy", ["sync", "diloco", "async-easgd"])
def test_sigterm_to_a_joiner_makes_it_leave_and_the_job_goes_on(held, strategy):
    """SIGTERM to ``shoal join`` (a spot host's notice): its worker leaves right after its
    next meeting (asynchronous: once it sent its work), its work so far counted, and the
    command ends 0; the others deal its part between them and train to the end, the leave
    in the summary with its reason. Before, the worker died of the signal (the join ended
    1, "killed by signal 15") and the work since its last meeting was done again."""
    job = held("--strategy", strategy, *([] if strategy == "sync" else ["--tau", "4"]),
               "--elastic", "--record-samples", "--max-workers", "3", kill=False, workers=2,
               held_after=0, release_on_join=False)
    job.wait_for_job_file()
    joiner = job.join_in_background()
    job.wait_line("worker 2 joined at step")
    time.sleep(2)  # it trains a few steps
    joiner.send_signal(signal.SIGTERM)
    _, err = joiner.communicate(timeout=60)
    assert joiner.returncode == 0, err
    assert "worker 2 left the job after step" in err and "Traceback" not in err
    assert job.finish() == 0, job.stderr
    summary = json.loads((job.out / "summary.json").read_text())
    assert summary["completed"] and summary["workers"] == 2
    joined, left = summary["membership_changes"]
    assert joined["joined"] == [2] and left["left"] == [2] and left["workers"] == 2
    step = int(err.split("left the job after step ")[1].split()[0])
    assert left["why"] == {"2": f"worker 2 left at step {step} (SIGTERM to shoal join)"}
    assert_each_sample_once(job.out, EPOCHS, TRAIN_ROWS)


def test_a_job_of_one_worker_takes_a_joiner(held):
    """``--workers 1 --elastic --max-workers 2``: the job grows to 2 workers, every sample
    once. Before, a job of one worker ran inside the launcher's process with no store: it
    wrote no job file (``shoal join``: "no running elastic job") and no samples."""
    job = held("--strategy", "diloco", "--tau", "4", "--elastic", "--record-samples",
               "--max-workers", "2", kill=False, workers=1, held_after=0, pace=0.1)
    job.wait_for_job_file()
    code, err = join_here(job.out)  # (the command's own process: the tests above)
    assert code == 0, err
    assert job.finish() == 0, job.stderr
    summary = json.loads((job.out / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["membership_changes"][0]["joined"] == [1]
    assert_each_sample_once(job.out, EPOCHS, TRAIN_ROWS)


def test_sigterm_stops_a_job_down_to_its_last_worker(held):
    """A synchronous job that lost all but one worker has no meeting left to carry a stop
    vote: SIGTERM to its launcher was ignored, and the last worker trained on to the end.
    It now stops at its next step with a checkpoint (143), as with more workers."""
    job = held("--strategy", "sync", "--elastic", workers=2, killed=1, held_after=10)
    job.wait_line("worker 1 left at step")
    job.proc.send_signal(signal.SIGTERM)
    assert job.proc.wait(timeout=60) == 143, job.stderr
    assert "stopped by SIGTERM" in job.stderr and (job.out / "checkpoint.pt").exists()


def _left_to_a_joiner(held, tmp_path, strategy: str, ranks: str, joiner_pace: str = "",
                      **kwargs):
    """A job of 2 workers of ``strategy`` (``--tau 4``) that a third joins (held at
    ``joiner_pace`` s a step, if given), after which the processes of ``ranks`` (the first
    two workers') are killed (kill -9): the job, the joiner's process, and the file whose
    existence kills them."""
    kill = tmp_path / "kill"
    job = held("--strategy", strategy, "--tau", "4", "--elastic", "--record-samples",
               "--max-workers", "3", kill=False, workers=2, held_after=0,
               model="killed_when_told", release_on_join=False,
               env={"SHOAL_TEST_KILL_RANK": ranks, "SHOAL_TEST_KILL_FILE": str(kill)}, **kwargs)
    job.wait_for_job_file()
    joiner = job.join_in_background(**({"SHOAL_TEST_PACE": joiner_pace} if joiner_pace else {}))
    job.wait_line("worker 2 joined at step")
    kill.touch()
    return job, joiner, kill


def test_an_asynchronous_job_left_to_a_joiner_checkpoints_and_stops_when_it_leaves(held,
                                                                                  tmp_path):
    """An asynchronous job whose first workers are both killed (kill -9) goes on in the
    worker that joined, its checkpoints too (before, none was written once no first worker
    was left, and a resume went back to the last: 448 samples trained twice, the joins and
    losses gone from the summary); SIGTERM to that last worker's ``shoal join`` stops the
    job with a checkpoint (143, the join 0) instead of leaving it with no worker (before:
    "every worker was lost", exit 1). The resumed job trains every sample once."""
    job, joiner, kill = _left_to_a_joiner(held, tmp_path, "async-easgd", "1,2", pace=0.3)
    job.wait_line("; 1 go on")
    time.sleep(2)  # it trains on alone
    joiner.send_signal(signal.SIGTERM)
    _, err = joiner.communicate(timeout=60)
    assert joiner.returncode == 0 and "was the job's last worker: SIGTERM stopped" in err, err
    assert job.proc.wait(timeout=60) == 143, job.stderr + err
    assert "stopped by SIGTERM" in job.stderr and (job.out / "checkpoint.pt").exists()
    kill.unlink()
    job.release()
    resume_here(job)
    summary = json.loads((job.out / "summary.json").read_text())
    changes = summary["membership_changes"]
    assert changes[0]["joined"] == [2] and changes[-1]["joined"] == [0, 1], changes
    assert sorted(m for c in changes for m in c.get("left", [])) == [0, 1]
    assert_each_sample_once(job.out, EPOCHS, TRAIN_ROWS)


def test_the_job_goes_on_in_a_joiner_once_every_worker_started_with_it_is_lost(held, tmp_path):
    """Both workers shoal's launcher started are killed (kill -9) once a third joined: the
    job trains on in the joiner alone (it writes the records from then on) and admits a fourth,
    and the launcher holds the job's store until the joiners finished: every command exits
    0 (before: the launcher ended with its own workers, silently, and took the store with
    it)."""
    # the joiner, alone once the others are lost, trains at 1 s a step while held: its some
    # 240 steps outlast the waits below however loaded the machine (at 0.2 s a step, a loaded
    # machine's second joiner came after the job had ended)
    job, joiner, _ = _left_to_a_joiner(held, tmp_path, "diloco", "0,1", joiner_pace="1.0")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(joiner.stderr), daemon=True)
    reader.start()
    job.wait_for(lambda: any(" left at step" in line for line in lines), "the loss")
    # A second joiner, admitted by the first, alone now: it looks for joiners at its meeting
    # points (before, no vote told it) and checks the proof with the job's secret (before,
    # it refused every later joiner: "its proof does not match this job's secret").
    second = job.join_in_background()
    job.wait_for(lambda: any("worker 3 joined at step" in line for line in lines), "worker 3")
    job.release()
    _, err2 = second.communicate(timeout=240)
    joiner.wait(timeout=240)
    reader.join(timeout=10)
    err = "".join(lines)
    assert joiner.returncode == 0 and second.returncode == 0, err + err2
    assert "workers 0, 1 left at step" in err or "worker 1 left at step" in err, err
    assert job.finish() == 0, job.stderr
    assert "the job went on in the workers that joined it" in job.stderr
    summary = json.loads((job.out / "summary.json").read_text())
    assert summary["completed"] and summary["workers"] == 2
    changes = summary["membership_changes"]
    assert changes[0]["joined"] == [2]  # the joiner's own record of its join
    assert changes[0]["joiner_state_sha256"] == {"2": changes[0]["state_sha256"]}
    assert sorted(m for c in changes[1:] for m in c.get("left", [])) == [0, 1]
    assert changes[-1]["joined"] == [3]
    assert changes[-1]["joiner_state_sha256"] == {"3": changes[-1]["state_sha256"]}
    assert_each_sample_once(job.out, EPOCHS, TRAIN_ROWS)
    assert step_workers(job.out)[max(step_workers(job.out))] == 2


def test_a_torchrun_job_goes_on_in_a_joiner_once_every_rank_is_lost(held, tmp_path):
    """The same under torchrun: both ranks' workers killed once a third joined. Their
    keepers wait while the joiner trains (before, each said "every worker was lost" and
    failed, and torchrun ended the job under the joiner); torchrun exits 0 once the joiner
    finished the run, every sample once."""
    kill = tmp_path / "kill"
    job = held("--strategy", "diloco", "--tau", "4", "--elastic", "--record-samples",
               "--max-workers", "3", kill=False, workers=2, held_after=0, torchrun=True,
               model="killed_when_told", release_on_join=False,
               env={"SHOAL_TEST_KILL_RANK": "0,1", "SHOAL_TEST_KILL_FILE": str(kill),
                    "SHOAL_JOIN_SECRET": "5a" * 32})
    job.wait_for_job_file()
    joiner = job.join_in_background()
    job.wait_line("worker 2 joined at step")
    kill.touch()
    job.wait_line("rank 1 killed by signal 9")
    job.release()
    _, err = joiner.communicate(timeout=240)
    assert joiner.returncode == 0, err
    assert job.finish() == 0, job.stderr
    assert "every worker was lost" not in job.stderr
    summary = json.loads((job.out / "summary.json").read_text())
    assert summary["completed"] and summary["workers"] == 1
    assert sorted(m for c in summary["membership_changes"] for m in c.get("left", [])) == [0, 1]
    assert_each_sample_once(job.out, EPOCHS, TRAIN_ROWS)


@pytest.mark.parametrize("strategy, die_at", [
    ("sync", "train:1"),  # right after its first step counted, mid-epoch
    ("local-sgd", "short:16"),  # right after its epoch's last exchange (the soak's case)
    ("local-sgd", "eval:1"),  # right after worker 0's state reached it (its 1st eval: the check)
])
def test_a_joiner_killed_right_after_a_meeting_loses_nothing(held, strategy, die_at):
    """A joiner killed (kill -9) right after a meeting that counted its work, before it could
    write its --record-samples line: worker 0 writes that line for it (its work is in the
    model), and every sample is trained exactly once (sync: then DDP rebuilds its buckets, a
    broadcast that failed the job before). Killed in its handover instead, it trained
    nothing: the job goes on (before, the meeting for its digest was held again with its rank
    as the root) and the next step is the rest's, as dealt again without it."""
    job = held("--strategy", strategy, *([] if strategy == "sync" else ["--tau", "4"]),
               "--elastic", "--record-samples", "--max-workers", "3", "--heartbeat-timeout",
               "4", kill=False, workers=2, held_after=0, model="dies_at")
    job.wait_for_job_file()
    joined = shoal("join", str(job.out), timeout=240, env={
        **job.env, "SHOAL_TEST_MARKER": uuid.uuid4().hex, "SHOAL_TEST_DIE_AT": die_at,
        "SHOAL_TEST_DIE_AFTER_COUNT": "1"})
    assert joined.returncode == 1 and "process killed by signal 9" in joined.stderr, joined.stderr
    assert joined.stray == []
    assert job.finish() == 0, job.stderr
    summary = json.loads((job.out / "summary.json").read_text())
    join, left = summary["membership_changes"]
    assert join["joined"] == [2] and left["left"] == [2] and summary["workers"] == 2
    handover = die_at == "eval:1"
    assert join["joiner_state_sha256"] == ({} if handover else {"2": join["state_sha256"]})
    assert_each_sample_once(job.out, EPOCHS, TRAIN_ROWS)
    records = job.out / "samples" / "worker2.jsonl"
    if handover:
        assert not records.exists()
    else:
        last = json.loads(records.read_text().splitlines()[-1])
        assert last["recorded_by"] == 0 and last["step"] >= join["step"]


def test_an_asynchronous_joiner_lost_before_its_first_step_stands_at_the_jobs_step(held):
    """async-easgd: a joiner admitted, then killed at its first training forward (before
    any exchange). Its loss is recorded at the job's step (the furthest worker's, as its
    join is), not at step 0, its own count, which it never had (before: the timeline had
    the loss before the join). The job ends on its 2 workers, every sample once."""
    job = held("--strategy", "async-easgd", "--tau", "4", "--elastic", "--record-samples",
               "--max-workers", "3", kill=False, workers=2, held_after=0, model="dies_at")
    job.wait_for_job_file()
    job.wait_for_records(2)  # the job's step is past 0 when it joins
    joined = shoal("join", str(job.out), timeout=240, env={
        **job.env, "SHOAL_TEST_MARKER": uuid.uuid4().hex, "SHOAL_TEST_DIE_AT": "train:1"})
    assert joined.returncode == 1 and "killed by signal 9" in joined.stderr, joined.stderr
    assert job.finish() == 0, job.stderr
    summary = json.loads((job.out / "summary.json").read_text())
    join, left = summary["membership_changes"]
    assert join["joined"] == [2] and left["left"] == [2] and summary["workers"] == 2
    assert left["step"] >= join["step"] > 0
    assert_each_sample_once(job.out, EPOCHS, TRAIN_ROWS)


def test_a_joiner_admitted_before_the_clock_starts_does_not_hold_it(held):
    """async-easgd: a joiner admitted while worker 1 still builds its model (the run's clock
    waits for every worker to be able to train). The joiner trains what it is dealt and
    the clock starts without it (before: the clock waited for it too, which never says it
    started, and the job hung until --timeout)."""
    job = held("--strategy", "async-easgd", "--tau", "4", "--elastic", "--max-workers", "3",
               "--timeout", "60", kill=False, workers=2, model="mlp_late_in",
               env={"SHOAL_TEST_LATE_IN": "shoal worker 1", "SHOAL_TEST_LATE_S": "6"})
    job.wait_for_job_file()
    joined = shoal("join", str(job.out), timeout=120,
                   env={**job.env, "SHOAL_TEST_MARKER": uuid.uuid4().hex})
    assert joined.returncode == 0, joined.stderr
    assert job.finish(timeout=60) == 0, job.stderr
    summary = json.loads((job.out / "summary.json").read_text())
    [join] = summary["membership_changes"]
    assert join["joined"] == [2] and join["step"] == 0 and summary["workers"] == 3


def test_a_member_lost_as_a_worker_joins(held):
    """A member killed (kill -9) as the group grows by a joiner (the race benchmarks/
    soak_mpirun.py met: a kill during a join): the new group cannot form, so the members
    left and the joiner agree on a group again, without the dead one; the joiner takes
    worker 0's state and trains to the end (before, it ended in an error and the job went
    on without it), every sample trained once."""
    # 0.5 s a step while held: its 90 steps leave the joiner some 45 s to start, not 18 s
    job = held("--strategy", "diloco", "--tau", "4", "--elastic", "--record-samples",
               "--max-workers", "4", "--heartbeat-timeout", "4", kill=False, workers=3,
               held_after=0, model="dies_in_grow", env={"SHOAL_TEST_KILL_RANK": "1"},
               pace=0.5)
    job.wait_for_job_file()
    joined = shoal("join", str(job.out), env={**job.env, "SHOAL_TEST_MARKER": uuid.uuid4().hex},
                   timeout=240)
    assert job.finish() == 0, job.stderr
    assert joined.returncode == 0, joined.stderr
    assert joined.stray == []
    summary = json.loads((job.out / "summary.json").read_text())
    assert summary["completed"] and summary["workers"] == 3
    left, join = summary["membership_changes"]
    assert left["left"] == [1] and left["why"] == {"1": "worker 1 killed by signal 9"}
    assert join["joined"] == [3] and join["workers"] == 3 and join["step"] == left["step"]
    assert join["joiner_state_sha256"] == {"3": join["state_sha256"]}
    assert_each_sample_once(job.out, EPOCHS, TRAIN_ROWS)
    assert (job.out / "samples" / "worker3.jsonl").stat().st_size > 0


def resume_here(job: HeldJob) -> None:
    """``shoal train`` of ``job`` again with ``--resume auto``, through the command's main()
    in this process (its workers from the session's warm fork server), which must succeed:
    the job's test hooks are spent by then (hold and kill files gone)."""
    from shoal.cli import main

    assert main([*job.proc.args[3:], "--resume", "auto"]) == 0, "the resumed job failed"


def join_here(*args) -> tuple[int, str]:
    """``shoal join ARGS`` through the command's main() in this process (its whole code path
    but an interpreter's start, 2-3 s): its status and stderr."""
    from shoal.cli import main

    with contextlib.redirect_stderr(io.StringIO()) as said:
        code = main(["join", *map(str, args)])
    return code, said.getvalue()


def test_join_refuses_a_job_at_its_size_then_a_finished_one(held):
    # one epoch is enough: held from its first step till the refusal, at 0.5 s a step (its 45
    # steps leave some 22 s for it)
    job = held("--elastic", "--epochs", "1", kill=False, workers=2, held_after=0, pace=0.5)
    job.wait_for_job_file()
    code, err = join_here(job.out)
    assert code == 2
    assert "has 2 workers, its most (--max-workers 2)" in one_error_line(err)
    assert job.finish() == 0, job.stderr
    code, err = join_here(job.out)
    assert code == 2
    assert "has finished" in one_error_line(err)


def test_join_refuses_a_job_without_elastic(tmp_path):
    # what a running job's --out holds (config.json, no summary yet) without --elastic: the
    # job file is the only way in, and such a job writes none
    out = tmp_path / "job"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"elastic": False, "strategy": "sync"}))
    code, err = join_here(out)  # (the command's own process: the "is not a folder" case)
    assert code == 2
    assert "started without --elastic" in one_error_line(err)


def _job_file(out, folder_mode=0o700, file_mode=0o600, owner=None, link=False):
    folder = out / ".shoal-join"
    folder.mkdir(parents=True)
    os.chmod(folder, folder_mode)
    if link:
        (out / "elsewhere.json").write_text("{}")
        (folder / "job.json").symlink_to(out / "elsewhere.json")
    else:
        (folder / "job.json").write_text("{}")
        os.chmod(folder / "job.json", file_mode)
    if owner is not None:
        os.chown(folder, owner, -1)


@pytest.mark.parametrize("make, expected", [
    (lambda out: out.mkdir(), "no running elastic job in"),
    (lambda out: _job_file(out, folder_mode=0o777), "is not a private folder of yours"),
    (lambda out: _job_file(out, file_mode=0o644), "readable or writable by others"),
    (lambda out: _job_file(out, link=True), "is a symbolic link"),
    (lambda out: _job_file(out), "is not a job file of shoal's"),
    (lambda out: None, "is not a folder"),
])
def test_join_refuses_what_it_cannot_trust_in_one_line(tmp_path, make, expected):
    out = tmp_path / "run"
    make(out)
    if expected == "is not a folder":  # the command as a user starts it (2-3 s)
        res = shoal("join", str(out), timeout=60)
        code, err = res.returncode, res.stderr
    else:
        code, err = join_here(out)
    assert code == 2
    assert expected in one_error_line(err)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the folder away")
def test_join_refuses_a_folder_of_another_user(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    _job_file(out, owner=12345)
    code, err = join_here(out)
    assert code == 2
    assert "is not a private folder of yours" in one_error_line(err)


def test_a_request_at_the_cap_waits_for_a_lost_members_place_instead_of_refused():
    """Worker 2 of 3 died (shoal's launcher said so in the store) and the members have not
    met since: a replacement's request at the job's most workers is neither refused nor
    admitted yet; once the group is re-formed without worker 2, the same request is
    admitted at the next round, with the id it was given. Worker 0's decisions, on a real
    store."""
    import torch.distributed as dist

    from shoal.core.admission import admit, answer, ask, take_ticket
    from shoal.core.membership import Membership
    from shoal.core.trust import Seal
    from shoal.core.waits import ended_key

    store = dist.HashStore()
    m = Membership(store, 0, 3, lambda member: f"beat/{member}", 10.0, 30.0, "cpu")
    m.seal = Seal()
    m.grow = lambda epoch, members, joined: joined  # the new group itself: not this test's
    ticket = take_ticket(m.keys)
    ask(m.keys, m.seal, ticket)
    store.set(ended_key(2), "killed by signal 9")
    assert admit(m, 3, timeout=5.0) == []
    assert not m.keys.check([f"join/{ticket}/answer"]) and m._asked()
    m.members = [0, 1]  # the members met and re-formed the group without worker 2
    assert admit(m, 3, timeout=5.0) == [3]
    reply = answer(m.keys, ticket, timeout=1.0)
    assert reply["members"] == [0, 1, 3] and reply["joined"] == [3]
    assert reply["rounds"] == m.join_rounds == 2 and not m._asked()


def test_a_job_files_first_joiner_id_is_read_back_only_within_its_bounds(tmp_path):
    """The first joiner's id a job file gives (past the earlier joiners of a resumed
    asynchronous job) becomes a worker id and a rank: one below the job's workers or past a
    C int is not a job file of shoal's."""
    from shoal.config import TrainConfig
    from shoal.errors import ShoalError
    from shoal.train.membership.jobfile import publish, read_job

    out = tmp_path / "run"
    out.mkdir()
    cfg = TrainConfig(out=str(out), elastic=True).validate()
    publish(cfg, 29500, "ab" * 32, 3, first_id=5)
    assert read_job(out)["first_id"] == 5
    path = out / ".shoal-join" / "job.json"
    for bad in (2, 1 << 31, "5x"):
        job = json.loads(path.read_text())
        path.write_text(json.dumps({**job, "first_id": bad}))
        with pytest.raises(ShoalError, match="is not a job file of shoal's"):
            read_job(out)
