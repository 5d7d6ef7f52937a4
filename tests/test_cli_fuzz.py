"""Property-based tests of ``shoal train``: whatever the flags and config files say, the command
ends with success or one ``shoal: error:`` line (exit 0 or 2), never a traceback, never a
hang, and never touches a file outside ``--out`` (or the directory of the user's own files).

Arguments are drawn from the real flag set of ``shoal train`` with hostile values (huge,
negative, nan, inf, empty, unicode, wrong types); config files from every configuration key
and strategy option plus unknown ones, with values of every YAML type. Each example runs
``shoal.cli.main`` in this process, in a fresh directory, with one worker and at most a step
or two of training when the values happen to be valid. Flags that size the work (workers,
samples, shapes, restarts, the stop step) only take invalid or small values, and paths only
point inside the example's directory. Examples are derandomized, so CI sees the same ones.

``shoal plan``, ``shoal train --strategy auto``, ``shoal run`` and the asynchronous
strategies' flags are fuzzed the same way up to the work they would start (a plan's search,
a job's processes), which these examples do not run (:func:`checks_only`): everything that
checks the values runs for real.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.cli import build_parser, main

#: Seconds one example may take before it counts as a hang.
DEADLINE_S = 60
SETTINGS = settings(max_examples=100, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

HUGE = "99999999999999999999999"  # beyond int64
BIG = "1000000000000000000"  # 1e18: an int64, a float, a timedelta too large
#: Values any flag may get: numbers out of every range, non-numbers, odd text.
HOSTILE = ["", " ", "0", "-1", "1", "2", "0.5", "1.5", "-0", "nan", "inf", "-inf", "1e400",
           "1e-300", BIG, HUGE, "-" + HUGE, "1" + "0" * 400, "abc", "ünïcødé", "🐟", "1:2",
           "3x4x4", "1,2", ",", "--", "-x", "\t", "None", "true"]
#: The only values of the flags that size the work or reach outside the directory; the first
#: of each is what the run uses unless an example says otherwise.
POOLS = {
    "--workers": ["1", "0", "-1", "", "nan", "1.5", "two", HUGE],
    "--threads-per-worker": ["1", "2", "0", "-3", "", "x", HUGE],
    "--synthetic-samples": ["40", "64", "0", "-1", "", "1e3", HUGE],
    "--synthetic-classes": ["3", "10", "0", "1", "-2", "x", HUGE],
    "--synthetic-shape": ["1x8x8", "3x4x4", "8", "0x8x8", "1x-1x8", "", "x", "1x8x8x8", HUGE],
    "--image-size": ["8", "0", "-1", "", "x", HUGE],
    "--stop-at-step": ["1", "2", "0", "-1", "", "x", HUGE],
    "--max-restarts": ["0", "-1", "", "x", HUGE],
    "--out": ["run", "run/sub", "", " ", ".", "ü", "~", "run/../other", "run\nx"],
    "--data-dir": ["data", "", "{cfg}", "{cfg}/ok.yaml", "missing"],
    "--config": ["{cfg}/ok.yaml", "{cfg}/list.yaml", "{cfg}/bad.yaml", "{cfg}/opts.yaml",
                 "missing.yaml", "", "{cfg}"],
    "--resume": ["", "auto", "missing.pt", "{cfg}/ok.yaml", "run/checkpoint.pt"],
    "--init-from": ["run/checkpoint.pt", "", "missing.pt", "{cfg}/ok.yaml", "{cfg}"],
    "--dataset": ["digits", "synthetic", "mnist", "cifar10", "npz:missing.npz", "npz:",
                  "imagefolder:{cfg}", "imagefolder:missing", "imagenet", "", ":", "math:pi",
                  "{cfg}/fuzz_model.py:make", "no_such_module:f"],
    "--loader-workers": ["0", "auto", "1", "-1", "", "x", "1.5", HUGE],
    "--model": ["mlp", "lenet5", "lenet7", "", ":", "no_such_module:f", "math:pi",
                "shoal.models:MLP", "{cfg}/fuzz_exits.py:make", "{cfg}/fuzz_model.py:make",
                "{cfg}/fuzz_model.py:missing", "{cfg}/missing.py:make"],
    "--strategy": ["sync", "local-sgd", "easgd", "diloco", "", "magic", "shoal:Strategy",
                   "shoal.models:MLP"],
}
#: Flags left out: --debug prints tracebacks by design; --compile spends a minute compiling
#: on a CPU (tests/test_training_features.py checks its one-line error).
SKIPPED = {"--debug", "--compile"}
#: Every example starts from these (a tiny valid run); the flags drawn come after and win.
BASE = ["train", "--model", "mlp", "--dataset", "digits", "--epochs", "1", "--stop-at-step", "1",
        "--workers", "1", "--max-restarts", "0", "--threads-per-worker", "1",
        "--out", "run", "--progress", "none"]

USER_FILES = {
    "ok.yaml": "epochs: 1\nlr: 1e-3\n",
    "list.yaml": "- 1\n- 2\n",
    "bad.yaml": "epochs: [1\n",
    "opts.yaml": "strategy: local-sgd\ntau: 2\nmeasure-wait: true\n",
    "fuzz_exits.py": "import sys\n\ndef make(shape, n):\n    sys.exit(3)\n",
    "fuzz_model.py": "import math\nfrom torch import nn\n\n"
                     "def make(shape, n):\n    return nn.Sequential(nn.Flatten(), "
                     "nn.Linear(math.prod(shape), n))\n",
}


#: Numbers of every kind for the flags that take one.
NUMBERS = ["0", "-1", "1", "2", "3", "10", "0.5", "0.9", "1e-3", "-0", "nan", "inf", "-inf",
           "1e39", "1e308", "-1e308", "1e400", "1e-300", BIG, HUGE, "-" + HUGE, "1" + "0" * 400]


def _flags() -> dict[str, tuple[str, ...] | None]:
    """``shoal train``'s flags: flag -> the values it may take (``None``: no value; ``()``:
    any text; else its choices, or :data:`NUMBERS` when it takes a number); a ``--no-x``
    flag stands beside its ``--x``."""
    parser = build_parser()
    sub = next(a for a in parser._actions if getattr(a, "choices", None) and "train" in a.choices)
    flags: dict[str, tuple[str, ...] | None] = {}
    for action in sub.choices["train"]._actions:
        for option in action.option_strings:
            if not option.startswith("--") or option in SKIPPED:
                continue
            if action.nargs == 0:
                flags[option] = None
            elif action.choices:
                flags[option] = tuple(map(str, action.choices))
            elif action.type in (int, float):
                flags[option] = tuple(NUMBERS)
            else:
                flags[option] = ()
    return flags


FLAGS = _flags()
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
               max_size=6)


@st.composite
def flag_args(draw: st.DrawFn) -> list[str]:
    """A few of the real flags, each with a value from its pool, its choices or numbers,
    now and then a hostile value or any short text."""
    args: list[str] = []
    for flag in draw(st.lists(st.sampled_from(sorted(FLAGS)), max_size=4)):
        choices = FLAGS[flag]
        args.append(flag)
        if choices is None:
            continue
        if flag == "--resume" and draw(st.booleans()):
            continue  # --resume alone: <out>/checkpoint.pt
        if flag in POOLS:
            values = st.sampled_from(POOLS[flag])
        elif choices and draw(st.integers(0, 4)):
            values = st.sampled_from(choices)
        else:
            values = st.one_of(st.sampled_from(HOSTILE), TEXT)
        args.append(draw(values))
    return args


# -- config files ---------------------------------------------------------------------------
def _key_types() -> dict[str, object]:
    """Every configuration key and strategy option -> its annotation."""
    import typing

    from shoal.config import TrainConfig
    from shoal.schema import field_types
    from shoal.strategies import STRATEGIES

    types = {}
    for cls in STRATEGIES.values():
        types.update(typing.get_type_hints(cls.Options))
    types.update(field_types(TrainConfig))
    return types


KEY_TYPES = _key_types()
KEYS = sorted(KEY_TYPES)
#: Values of the keys that size the work or name paths (file keys use underscores).
FILE_POOLS: dict[str, list[object]] = {  # a file, unlike a command line, may hold a NUL
    key[2:]: [*values, "run\x00"] for key, values in POOLS.items()
    if key[2:] in ("dataset", "model", "strategy", "resume", "out")}
FILE_POOLS.update({
    "workers": [1, 0, -1, None, 1.5, "two", True, 10**30],
    "threads_per_worker": [1, 0, None, 2.5, "x", 10**30],
    "synthetic_samples": [40, 0, -5, 2.0, "64", 10**30],
    "synthetic_classes": [3, 0, 1, 2.5, None, 10**30],
    "synthetic_shape": [[1, 8, 8], [3, 4, 4], [8], [], [0, 8], "1x8x8", 3, [1.5, 8, 8],
                        [10**30], None],
    "image_size": [8, 0, None, "x", 10**30],
    "loader_workers": [0, 1, "auto", -1, None, 1.5, "x", True, 10**30],
    "stop_at_step": [1, 2, 0, -1, 1.5, "x", True, 10**30],
    "max_restarts": [0, -1, 1.5, "x", None, 10**30],
    "epochs": [1, 0, -1, 1.5, "ten", True, None, 10**30, float("nan")],
    "profile": [[1, 1], "1:1", 1, [2, 1], "a:b", [1], True, None, 1.5],
    "data_dir": ["data", "", None, "missing", "\x00", 5],
    "compile": [False, None, 1, "yes", "true"],  # not true: a minute of compiling
})
ANY_VALUE = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-2**70, 2**70),
              st.floats(), st.text(max_size=8), st.sampled_from(HOSTILE)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)


def typed_value(hint: object) -> st.SearchStrategy:
    """Values near the type ``hint`` wants: numbers of every size for numbers, any
    booleans, lists of those for tuples."""
    import typing

    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (tuple, list):
        return st.lists(typed_value(args[0] if args else int), max_size=3)
    if args:  # X | None
        return st.one_of(st.none(), *(typed_value(a) for a in args))
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.sampled_from([0, 1, 2, 3, -1, 10**18, 2**63, 10**30, 1.0, 2.5])
    if hint is float:
        return st.sampled_from([0.0, 0.5, 0.9, 1, 2, 1e-3, -1.0, float("nan"), float("inf"),
                                float("-inf"), 1e18, 1e308, 10**400, "1e-3", "1.0e+2"])
    return st.one_of(st.sampled_from(["", "none", "sgd", "cosine", "cpu", "fp16"]), TEXT)


@st.composite
def config_text(draw: st.DrawFn) -> tuple[str, object]:
    """A YAML config file: a mapping of real and unknown keys (with ``-`` or ``_``) to values
    of any type, now and then a file that is no mapping or no YAML at all; and the ``out``
    it gives (``None``: none)."""
    kind = draw(st.sampled_from(["mapping"] * 8 + ["scalar", "garbage", "empty"]))
    if kind == "scalar":
        return yaml.safe_dump(draw(ANY_VALUE)), None
    if kind == "garbage":
        return draw(st.sampled_from(["epochs: [1\n", "{a: 1, a: 2}", ":\n - :", "\t- x\n",
                                     "%YAML 9\n---\n", "a: !!python/object:os.system x\n",
                                     "\x00\x01", "*alias\n"])), None
    if kind == "empty":
        return "", None
    data: dict[object, object] = {}
    keys = st.sampled_from([*KEYS, "strategy_options"])
    if draw(st.integers(0, 4)) == 0:  # now and then an unknown key
        keys = st.one_of(keys, st.text(max_size=8))
    for key in draw(st.lists(keys, max_size=5)):
        if key == "strategy_options":
            value = draw(st.one_of(ANY_VALUE, st.dictionaries(
                st.sampled_from(KEYS), ANY_VALUE, max_size=3), st.dictionaries(
                st.sampled_from(KEYS), typed_value(float), max_size=3)))
        elif key in FILE_POOLS:
            value = draw(st.sampled_from(FILE_POOLS[key]))
        elif key in KEY_TYPES and draw(st.integers(0, 2)):
            value = draw(typed_value(KEY_TYPES[key]))
        else:
            value = draw(ANY_VALUE)
        if isinstance(key, str) and draw(st.booleans()):
            key = key.replace("_", "-")
        data[key] = value
    return yaml.safe_dump(data, allow_unicode=draw(st.booleans())), data.get("out")


# -- running one example --------------------------------------------------------------------
class Valid(BaseException):
    """The command got past its checks to the work :func:`checks_only` leaves out."""


class Hang(BaseException):
    """An example ran past :data:`DEADLINE_S` (a BaseException: nothing in shoal catches it)."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`Hang` in the block after ``seconds``; an outer timer (pytest-timeout's)
    is put back, less the time spent, after it."""
    def expire(signum: int, frame: object) -> None:
        raise Hang(f"no result after {seconds} s")

    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expire)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 1e-3))


@contextlib.contextmanager
def torch_state_kept() -> Iterator[None]:
    """Put back what a run in this process sets globally: threads and the RNG."""
    threads, rng = torch.get_num_threads(), torch.random.get_rng_state()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: relative path -> (size, modification time)."""
    files = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath, name)
            st_ = path.lstat()
            files[str(path.relative_to(root))] = (st_.st_size, st_.st_mtime_ns)
    return files


def last_value(args: list[str], flag: str) -> str | None:
    return next((args[i + 1] for i in range(len(args) - 2, -1, -1) if args[i] == flag), None)


def check_line(line: str, args: list[str], shown: str) -> None:
    """An error line has one prefix (not ``shoal: error: shoal train: ...``), and a flag's
    value is its value: only a missing one, or one that is itself an option (``-x``, ``--``),
    is "expected one argument" (not ``--plan-budget -5m``, ``--lr -inf``)."""
    assert not re.match(r"shoal: error: shoal( \w+)?:", line), shown
    lost = re.search(r"argument (\S+): expected one argument", line)
    if lost:
        flags = lost.group(1).split("/")
        at = max((i for i, a in enumerate(args) if a in flags), default=len(args))
        following = args[at + 1] if at + 1 < len(args) else None
        assert following is None or re.match(r"-[^\d.]", following) and not re.match(
            r"-(inf|nan)", following, re.IGNORECASE), shown


def run_shoal(args: list[str], config: str | None = None, config_out: object = None) -> None:
    """Run ``shoal ARGS`` in a fresh directory (``config``: the text of ``{cfg}/fuzz.yaml``,
    whose ``out`` is ``config_out``) and check the outcome."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp).resolve()
        cfg, work = root / "cfg", root / "work"
        cfg.mkdir()
        work.mkdir()
        for name, text in USER_FILES.items():
            (cfg / name).write_text(text)
        if config is not None:
            (cfg / "fuzz.yaml").write_text(config)
        args = [a.replace("{cfg}", str(cfg)) for a in args]
        before = snapshot(root)
        out, err = io.StringIO(), io.StringIO()
        cwd = os.getcwd()
        os.chdir(work)
        try:
            with deadline(DEADLINE_S), torch_state_kept(), contextlib.redirect_stdout(out), \
                    contextlib.redirect_stderr(err):
                try:
                    code = main(args)
                except SystemExit as exc:  # --help prints and exits, as argparse does
                    code = exc.code if isinstance(exc.code, int) else 1
                except Valid:  # past every check (see checks_only)
                    code = 0
        finally:
            os.chdir(cwd)
        stderr = err.getvalue()
        shown = f"shoal {' '.join(map(repr, args))}\n{stderr}"
        assert code in (0, 2), shown
        assert "Traceback" not in stderr, shown
        errors = [ln for ln in stderr.splitlines() if ln.startswith("shoal: error:")]
        assert len(errors) == (1 if code == 2 else 0), shown
        for line in errors:
            check_line(line, args, shown)
        out_arg = last_value(args, "--out")
        if out_arg is None:
            out_arg = config_out if isinstance(config_out, str) else "runs/latest"
        run_dir = (work / out_arg.replace("\x00", "")).resolve()
        changed = {p for p, s in snapshot(root).items() if before.get(p) != s}
        changed |= set(before) - set(snapshot(root))
        outside = sorted(p for p in changed
                         if not (root / p).resolve().is_relative_to(run_dir)
                         and not (root / p).is_relative_to(cfg))
        assert not outside, f"{shown}\nwrote outside --out {run_dir}: {outside}"


@SETTINGS
@given(flag_args())
def test_any_flags_end_in_success_or_one_error_line(args):
    run_shoal([*BASE, *args])


@SETTINGS
@given(config_text(), flag_args())
def test_any_config_file_ends_in_success_or_one_error_line(config, args):
    # The file's values are checked, then the flags that size the work (last, so they win)
    # keep it small; the file may choose the model, dataset, epochs and --out.
    pinned = [*BASE[1:]]
    for flag in ("--model", "--dataset", "--epochs", "--out"):
        i = pinned.index(flag)
        del pinned[i:i + 2]
    # the first drawn flag and its value, if it takes one (--allow-collapse takes none)
    first = args[:1 if args and FLAGS[args[0]] is None else 2]
    args = first if first[:1] not in (["--config"], ["--out"]) else []
    text, out = config
    run_shoal(["train", "--config", "{cfg}/fuzz.yaml", *args, *pinned], text, out)
