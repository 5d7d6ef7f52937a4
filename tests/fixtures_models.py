"""User models for the tests, loaded the way users load theirs: --model tests.fixtures_models:NAME."""

import atexit
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn


def tiny(input_shape, num_classes):
    """A user's own model: flatten + linear."""
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), num_classes))


class _FailOnRank(nn.Module):
    """Behaves like `tiny` until step 3 on rank 1, then fails the way `how` says."""

    def __init__(self, input_shape, num_classes, how):
        super().__init__()
        self.net = tiny(input_shape, num_classes)
        self.calls = 0
        self.how = how

    def forward(self, x):
        if self.training:
            self.calls += 1
            if os.environ.get("RANK") == "1" and self.calls == 3:
                if self.how == "raise":
                    raise RuntimeError("injected failure in the model")
                if self.how == "sleep":  # alive, but never comes to the next collective
                    time.sleep(1000)
                os.kill(os.getpid(), 9)
        return self.net(x)


def raises_on_rank1(input_shape, num_classes):
    return _FailOnRank(input_shape, num_classes, "raise")


def killed_on_rank1(input_shape, num_classes):
    return _FailOnRank(input_shape, num_classes, "kill")


def sleeps_on_rank1(input_shape, num_classes):
    return _FailOnRank(input_shape, num_classes, "sleep")


def wrong_output(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), 3))


class _KilledAt(nn.Module):
    """`tiny`, whose process kills itself (SIGKILL, as `kill -9` does) on its
    ``SHOAL_TEST_KILL_AT``-th forward pass (``train:N`` or ``eval:N``) in the process of rank
    ``SHOAL_TEST_KILL_RANK`` (of each of a comma-separated list): an asynchronous job's
    worker mid-epoch, or its server 0 (rank 0) at its N-th evaluation.
    ``SHOAL_TEST_KILL_SIGNAL``: another signal (19: SIGSTOP).
    With ``SHOAL_TEST_KILL_AFTER_COUNT`` (an asynchronous ``--elastic`` worker) it dies
    instead right after that forward's work next counts at server 0, before it records it
    (``--record-samples``). With ``SHOAL_TEST_KILL_IN_EXCHANGE`` (a compute group's leader)
    it dies as its next exchange with the servers starts: the server never applies it, while
    its group's all-reduce of that step succeeded. With ``SHOAL_TEST_KILL_ONCE=PATH`` only
    the first process to come there does, creating ``PATH`` (a job restarted after it
    trains on)."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.net = tiny(input_shape, num_classes)
        self.calls = {"train": 0, "eval": 0}
        self.armed = False

    def forward(self, x):
        mode = "train" if self.training else "eval"
        self.calls[mode] += 1
        rank = next((os.environ[v] for v in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
                     if v in os.environ), None)  # torchrun's, OpenMPI's, MPICH's, srun's
        if rank in os.environ.get("SHOAL_TEST_KILL_RANK", "").split(","):
            when, _, count = os.environ.get("SHOAL_TEST_KILL_AT", "").partition(":")
            if when == mode and self.calls[mode] == int(count) and self._first():
                self.armed = True
                if not os.environ.get("SHOAL_TEST_KILL_AFTER_COUNT") and \
                        not os.environ.get("SHOAL_TEST_KILL_IN_EXCHANGE"):
                    os.kill(os.getpid(), int(os.environ.get("SHOAL_TEST_KILL_SIGNAL", "9")))
        return self.net(x)

    @staticmethod
    def _first() -> bool:
        once = os.environ.get("SHOAL_TEST_KILL_ONCE")
        if not once:
            return True
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True


def batchnorm_killed_after_step(input_shape, num_classes):
    """A model with BatchNorm (buffers DDP broadcasts at every forward) whose process of rank
    ``SHOAL_TEST_KILL_RANK`` kills itself (SIGKILL) right after its optimizer's
    ``SHOAL_TEST_KILL_AT``-th step (``step:N``): every meeting of that step is done, the next
    one is the next forward's buffer broadcast."""
    if os.environ.get("RANK") == os.environ.get("SHOAL_TEST_KILL_RANK"):
        steps = {"n": 0}
        at = int(os.environ["SHOAL_TEST_KILL_AT"].partition(":")[2])

        def after_step(optimizer, args, kwargs):
            steps["n"] += 1
            if steps["n"] == at:
                os.kill(os.getpid(), signal.SIGKILL)

        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(after_step)
    features = int(torch.tensor(input_shape).prod())
    return nn.Sequential(nn.Flatten(), nn.Linear(features, 32), nn.BatchNorm1d(32), nn.ReLU(),
                         nn.Linear(32, num_classes))


def killed_at(input_shape, num_classes):
    model = _KilledAt(input_shape, num_classes)
    if os.environ.get("SHOAL_TEST_KILL_AFTER_COUNT") \
            and os.environ.get("RANK") == os.environ.get("SHOAL_TEST_KILL_RANK"):
        from shoal.train.membership.tracker.detached import AsyncElastic

        count = AsyncElastic._count

        def count_or_die(self):
            if model.armed and self.t.strategy.counted > self.at:
                os.kill(os.getpid(), signal.SIGKILL)
            count(self)

        AsyncElastic._count = count_or_die
    if os.environ.get("SHOAL_TEST_KILL_IN_EXCHANGE") \
            and os.environ.get("RANK") == os.environ.get("SHOAL_TEST_KILL_RANK"):
        from shoal.strategies.asynchronous import AsyncStrategy

        exchange = AsyncStrategy.exchange

        def exchange_or_die(self, payload, reply):
            if model.armed:
                os.kill(os.getpid(), signal.SIGKILL)
            exchange(self, payload, reply)

        AsyncStrategy.exchange = exchange_or_die
    return model


class _KilledThenHeld(_KilledAt):
    """`killed_at`, whose other processes, once past the forward the kill comes at, sleep
    ``SHOAL_TEST_PACE`` seconds in each training forward while the file ``SHOAL_TEST_HOLD``
    exists: a job that waits (slowly training on) for a worker to join it."""

    def forward(self, x):
        out = super().forward(x)
        count = int(os.environ.get("SHOAL_TEST_KILL_AT", "train:0").partition(":")[2])
        if self.training and self.calls["train"] > count \
                and os.path.exists(os.environ.get("SHOAL_TEST_HOLD", "")):
            time.sleep(float(os.environ.get("SHOAL_TEST_PACE", "0.1")))
        return out


def killed_then_held(input_shape, num_classes):
    return _KilledThenHeld(input_shape, num_classes)


class _KilledWhenTold(_KilledThenHeld):
    """`killed_then_held` (the job's pace), whose processes of the ranks in
    ``SHOAL_TEST_KILL_RANK`` (comma-separated) kill themselves (SIGKILL) at their first
    training forward once the file ``SHOAL_TEST_KILL_FILE`` exists."""

    def forward(self, x):
        if self.training and os.path.exists(os.environ.get("SHOAL_TEST_KILL_FILE", "")) \
                and os.environ.get("RANK") in os.environ.get("SHOAL_TEST_KILL_RANK", "").split(","):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)


def killed_when_told(input_shape, num_classes):
    return _KilledWhenTold(input_shape, num_classes)


class _DiesAt(_KilledThenHeld):
    """`killed_then_held` (the job's pace), whose process, given ``SHOAL_TEST_DIE_AT`` (a
    joiner's), kills itself (SIGKILL) at its ``train:N`` or ``eval:N``-th forward, or
    ``short:N``: its first training forward on fewer than N rows (an epoch's last step).
    With ``SHOAL_TEST_DIE_AFTER_COUNT`` it dies instead right after the next meeting that
    counts (:meth:`Membership._agree` said so): its vote carried its work into the shared
    state, nothing of its own ran after it (``--record-samples`` wrote nothing yet). Not
    where the file ``SHOAL_TEST_DIE_UNLESS`` existed when the model was built (a job
    restarted from its checkpoint goes on)."""

    def __init__(self, input_shape, num_classes):
        super().__init__(input_shape, num_classes)
        self.die = {"train": 0, "eval": 0}
        spared = os.path.exists(os.environ.get("SHOAL_TEST_DIE_UNLESS", ""))
        self.when, _, count = ("" if spared else os.environ.get("SHOAL_TEST_DIE_AT", "")).partition(":")
        self.count = int(count or 0)
        self.armed = False

    def forward(self, x):
        mode = "train" if self.training else "eval"
        self.die[mode] += 1
        if self.when == mode and self.die[mode] == self.count \
                or self.when == "short" and self.training and len(x) < self.count:
            self.when = ""
            self.armed = True
            if not os.environ.get("SHOAL_TEST_DIE_AFTER_COUNT"):
                os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)


def dies_at(input_shape, num_classes):
    model = _DiesAt(input_shape, num_classes)
    if model.when and os.environ.get("SHOAL_TEST_DIE_AFTER_COUNT"):
        from shoal.core.membership import Membership

        agree = Membership._agree

        def agree_then_die(self, ok):
            counts = agree(self, ok)
            if counts and model.armed:
                os.kill(os.getpid(), signal.SIGKILL)
            return counts

        Membership._agree = agree_then_die
    return model


def dies_in_grow(input_shape, num_classes):
    """`killed_then_held` (the job's pace), whose process of rank ``SHOAL_TEST_KILL_RANK``
    kills itself (SIGKILL) as its group grows by a joiner (:meth:`Membership.grow`): a
    member lost in the middle of a join."""
    model = killed_then_held(input_shape, num_classes)
    if os.environ.get("RANK") == os.environ.get("SHOAL_TEST_KILL_RANK"):
        from shoal.core.membership import Membership

        def grow_and_die(self, epoch, members, joined):
            os.kill(os.getpid(), signal.SIGKILL)

        Membership.grow = grow_and_die
    return model


def _hold(path):
    with open(path, "w"):
        pass
    release = os.environ.get("SHOAL_TEST_RELEASE_FILE")  # the hold ends once it exists
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (release and os.path.exists(release)):
        time.sleep(0.05)


def held_at_exit(input_shape, num_classes):
    """`tiny`; the process of rank ``SHOAL_TEST_HOLD_RANK``, once its work is done, holds in
    its interpreter's exit: it writes the file ``SHOAL_TEST_HOLD_FILE``, then sleeps (a job
    caught in its shutdown)."""
    if os.environ.get("RANK") is not None and os.environ.get("RANK") == os.environ.get(
            "SHOAL_TEST_HOLD_RANK"):
        atexit.register(_hold, os.environ["SHOAL_TEST_HOLD_FILE"])
    return tiny(input_shape, num_classes)


def _launcher() -> int:
    """The pid of the launcher that started this process (its process name holds it; shoal
    forks its processes from a server of the launcher's, so it need not be the parent)."""
    import multiprocessing

    from shoal.core.guard import launcher_of

    return launcher_of(multiprocessing.current_process().name) or os.getppid()


class _SigtermAt(nn.Module):
    """The zoo's mlp, whose process of rank ``SHOAL_TEST_TERM_RANK`` sends SIGTERM to its
    launcher (``shoal train``, which passes it on to every process of the job, as Slurm's
    notice reaches them) and to itself on its ``SHOAL_TEST_TERM_AT``-th training forward:
    that rank stops after exactly that step, the others wherever the signal finds them."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        from shoal.models import build_model

        self.net = build_model("mlp", input_shape, num_classes)
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if (os.environ.get("RANK") == os.environ.get("SHOAL_TEST_TERM_RANK")
                    and self.calls == int(os.environ.get("SHOAL_TEST_TERM_AT", "0"))):
                os.kill(_launcher(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)
        return self.net(x)


def sigterm_at(input_shape, num_classes):
    return _SigtermAt(input_shape, num_classes)


def mlp_late_in(input_shape, num_classes):
    """The zoo's mlp; built in the process named ``SHOAL_TEST_LATE_IN`` (``shoal worker 2``),
    it is ready only ``SHOAL_TEST_LATE_S`` (60) seconds later: a worker that is not ready
    before a short job ends, or before a joiner comes."""
    import setproctitle

    from shoal.models import build_model

    if setproctitle.getproctitle() == os.environ.get("SHOAL_TEST_LATE_IN"):
        time.sleep(float(os.environ.get("SHOAL_TEST_LATE_S", "60")))
    return build_model("mlp", input_shape, num_classes)


def _note(what):
    """Append ``what`` and this process's id to the file ``SHOAL_TEST_COUNT_FILE``."""
    path = os.environ.get("SHOAL_TEST_COUNT_FILE")
    if path:
        with open(path, "a") as f:
            f.write(f"{what} {os.getpid()}\n")


def counted(input_shape, num_classes):
    """The zoo's mlp; each build noted (:func:`_note`)."""
    from shoal.models import build_model

    _note("model")
    return build_model("mlp", input_shape, num_classes)


def counted_digits(seed=0):
    """The digits data set (``--dataset tests.fixtures_models:counted_digits``); each load
    noted (:func:`_note`)."""
    from shoal.data import DataOptions, load_dataset

    _note("data")
    return load_dataset("digits", DataOptions(seed=seed))


class _NanFrom(nn.Module):
    """`tiny`, whose training outputs are NaN from its ``SHOAL_TEST_NAN_AT``-th training forward
    on (every rank, or rank ``SHOAL_TEST_NAN_RANK`` alone): a run that diverges at a known
    step. With ``SHOAL_TEST_NAN_SEEN`` (a folder), a rank whose parameters turned non-finite
    without its own NaN (pulled from a server, stepped by another) leaves a file there."""

    #: The environment variable with the forward it starts at, and what outputs become.
    at_key, factor = "SHOAL_TEST_NAN_AT", float("nan")

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.net = tiny(input_shape, num_classes)
        self.calls = 0
        only = os.environ.get("SHOAL_TEST_NAN_RANK")
        self.injects = only is None or only == os.environ.get("RANK")

    def forward(self, x):
        out = self.net(x)
        if self.training:
            self.calls += 1
            if self.injects and self.calls >= int(os.environ.get(self.at_key, "1000000000")):
                return out * self.factor
            seen = os.environ.get("SHOAL_TEST_NAN_SEEN")
            if seen and not all(torch.isfinite(p).all() for p in self.parameters()):
                bad = sum(int((~torch.isfinite(p)).sum()) for p in self.parameters())
                (Path(seen) / f"rank{os.environ.get('RANK')}-{self.calls}").write_text(
                    f"pid {os.getpid()} model {id(self):#x} injects {self.injects}: {bad} "
                    f"non-finite of {sum(p.numel() for p in self.parameters())}, "
                    f"output finite {bool(torch.isfinite(out).all())}\n")
        return out


def nan_from(input_shape, num_classes):
    return _NanFrom(input_shape, num_classes)


class _CollapseFrom(_NanFrom):
    """`tiny`, whose training outputs are zeros from its ``SHOAL_TEST_COLLAPSE_AT``-th training
    forward on: its training loss sits at chance (ln C, the first class always guessed) once
    it had learned, and no gradient moves the model any more (a tested center stays good)."""

    at_key, factor = "SHOAL_TEST_COLLAPSE_AT", 0.0


def collapse_from(input_shape, num_classes):
    return _CollapseFrom(input_shape, num_classes)


class _CollapseEverywhereFrom(_CollapseFrom):
    """`collapse_from`, whose evaluations are at chance too once its training is (from its
    ``SHOAL_TEST_COLLAPSE_AT``-th training forward on): a synchronous run collapsed at a known
    step, whatever the CPU's arithmetic, where a real blow-up's path depends on it."""

    def forward(self, x):
        out = super().forward(x)
        if not self.training and self.calls >= int(os.environ[self.at_key]):
            return out * 0.0
        return out


def collapse_everywhere_from(input_shape, num_classes):
    return _CollapseEverywhereFrom(input_shape, num_classes)



class _SlowStart(nn.Module):
    """`tiny`, whose move to its device (a trainer's first touch of it, in the rank's own
    process) takes ``SHOAL_TEST_SLOW_START`` seconds on rank ``SHOAL_TEST_SLOW_RANK``: a
    worker whose start-up is slow (a straggler's host)."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.net = tiny(input_shape, num_classes)

    def to(self, *args, **kwargs):
        if os.environ.get("RANK") == os.environ.get("SHOAL_TEST_SLOW_RANK"):
            time.sleep(float(os.environ.get("SHOAL_TEST_SLOW_START", "0")))
        return super().to(*args, **kwargs)

    def forward(self, x):
        return self.net(x)


def slow_start(input_shape, num_classes):
    return _SlowStart(input_shape, num_classes)


def mesh_fails_once(input_shape, num_classes):
    """The zoo's mlp, whose process of rank 1 (while the file ``SHOAL_TEST_ONCE_FILE`` does
    not exist yet: it creates it) fails as a job does when Gloo's mesh does not form as it
    starts (a peer closed a fresh connection): the same error, before any step."""
    from shoal.errors import JobError
    from shoal.models import build_model

    path = os.environ.get("SHOAL_TEST_ONCE_FILE")
    if os.environ.get("RANK") == "1" and path and not os.path.exists(path):
        open(path, "w").close()
        raise JobError("could not join the job at 127.0.0.1:1 as rank 1 of 2: Gloo "
                       "connectFullMesh failed with [gloo/transport/tcp/pair.cc:553] "
                       "Connection closed by peer [127.0.0.1]:6340")
    return build_model("mlp", input_shape, num_classes)
