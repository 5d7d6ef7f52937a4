"""What a detached worker reports to server 0, and what server 0 tells the other servers:
one frozen dataclass per kind, an enum of the kinds, and their form on the wire.

They travel over the parameter servers' report channel
(:meth:`~shoal.ps.client.ServerClient.report`) as a plain dict, ``{"kind": kind, **fields}``
(:func:`encode`), which the transport pickles as it always did. The side that takes them
(server 0's coordinator, another server's follower) rebuilds the typed message with
:func:`decode_report` or :func:`decode_word`: a kind it does not know, a field missing or
one of the wrong type is refused with :class:`BadReport`, one line, before any handler sees
it. An asynchronous checkpoint keeps the epoch reports not recorded yet in the same form.

- a worker's records (:class:`Started`, :class:`Progress`, :class:`EpochEnd`,
  :class:`CheckpointPart`, :class:`Final`) each say where it is (:class:`Where`);
- a worker that fails says so (:class:`Failed`): the job ends as the echo of it;
- under ``--elastic`` a worker tells the shares it takes and the parts it gives
  (:class:`Adopt`, :class:`Give`), that it waits (:class:`Idle`), joined (:class:`Joined`)
  or leaves (:class:`Leave`); a compute group's leader tells its lost members' rows
  (:class:`Rows`), and a member in a lost leader's place says so (:class:`Lead`);
- server 0's words to the other servers (:class:`Word`): a joiner to serve, a new leader, a
  worker that rests or works again, a joiner's first pull taken.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, Union

from shoal.errors import ShoalError


class BadReport(ShoalError):
    """A message of a kind the side taking it does not know, or with fields it lacks."""


class ReportKind(str, enum.Enum):
    """A worker's report kinds (their value: the wire's ``"kind"``)."""

    STARTED = "started"
    PROGRESS = "progress"
    EPOCH = "epoch"
    CHECKPOINT = "checkpoint"
    FINAL = "final"
    FAILED = "failed"
    ADOPT = "adopt"
    GIVE = "give"
    IDLE = "idle"
    JOINED = "joined"
    LEAVING = "leaving"
    ROWS = "rows"
    LEAD = "lead"

    def __str__(self) -> str:
        return self.value


class WordKind(str, enum.Enum):
    """Server 0's word kinds to the other servers of an ``--elastic`` job."""

    SERVE = "serve"
    LEAD = "lead"
    REST = "rest"
    TAKEN = "taken"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Message:
    """A typed message: its kind (:attr:`KIND`) and its fields."""

    KIND: ClassVar[ReportKind | WordKind]

    def fields(self) -> dict[str, Any]:
        """Its fields as they travel, in order."""
        return dict(vars(self))

    @classmethod
    def of_fields(cls, values: dict[str, Any]) -> Message:
        """From the fields of its wire form (``"kind"`` left out).

        Raises:
            BadReport: a field missing, unknown, or of the wrong type.
        """
        hints = _hints(cls)
        if missing := sorted(hints.keys() - values.keys()):
            raise BadReport(f"{cls.KIND} message without its fields {missing}")
        if unknown := sorted(values.keys() - hints.keys()):
            raise BadReport(f"{cls.KIND} message with fields it has not: {unknown}")
        return cls(**{name: _typed(values[name], hint, f"{cls.KIND}.{name}")
                      for name, hint in hints.items()})


class Report(Message):
    """A worker's report to server 0."""

    KIND: ClassVar[ReportKind]


class Word(Message):
    """Server 0's word to another server: about worker (or joiner) ``client``."""

    KIND: ClassVar[WordKind]


# -- a worker's records ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Where(Report):
    """Where a worker is, as each of its records says: its id, step, samples, time and byte
    totals, learning rate and seconds since its start."""

    worker: int
    step: int
    samples: int
    times: dict[str, float]
    bytes: int
    lr: float
    elapsed_s: float


@dataclass(frozen=True)
class Started(Where):
    """The worker can train (the run's clock starts once every live worker can)."""

    KIND = ReportKind.STARTED


@dataclass(frozen=True)
class Progress(Where):
    """``--eval-every-steps``: the samples the worker has ``trained``."""

    KIND = ReportKind.PROGRESS
    trained: int


@dataclass(frozen=True)
class EpochEnd(Where):
    """The worker's ``sums`` (loss sum, correct, samples) of ``epoch`` (from 0, its
    trainer's count after the epoch) and its model's ``buffers`` (``None``: nothing trained)."""

    KIND = ReportKind.EPOCH
    epoch: int
    sums: list[float]
    buffers: dict[str, Any] | None


@dataclass(frozen=True)
class CheckpointPart(Where):
    """The worker's part of a checkpoint (``own``: its position and state)."""

    KIND = ReportKind.CHECKPOINT
    own: dict[str, Any]


@dataclass(frozen=True)
class Final(Where):
    """The worker's end: how it stopped, its last epoch, time, device and trace lane."""

    KIND = ReportKind.FINAL
    stopped: bool
    stopped_by: str | None
    epoch: int
    train_time_s: float
    device: str
    trace: list[Any] | None


@dataclass(frozen=True)
class Failed(Report):
    """The worker failed with ``error`` (its first line): the job ends."""

    KIND = ReportKind.FAILED
    worker: int
    error: str


# -- a worker's side of --elastic -----------------------------------------------------------------
@dataclass(frozen=True)
class Adopt(Report):
    """The worker takes deal ``deal``'s shares at ``offset`` of block ``epoch``."""

    KIND = ReportKind.ADOPT
    deal: int
    epoch: int
    offset: int


@dataclass(frozen=True)
class Give(Report):
    """The worker gives give-deal ``deal``'s joiner its part from ``offset`` of ``epoch``."""

    KIND = ReportKind.GIVE
    deal: int
    epoch: int
    offset: int


@dataclass(frozen=True)
class Idle(Report):
    """The worker has trained its schedule, ``deals`` deals read: it waits for its release."""

    KIND = ReportKind.IDLE
    deals: int


@dataclass(frozen=True)
class Joined(Report):
    """A joiner's first state, by its ``digest`` (``None``: hogwild's shared parameters)."""

    KIND = ReportKind.JOINED
    digest: str | None


@dataclass(frozen=True)
class Leave(Report):
    """The worker leaves (SIGTERM to its ``shoal join``)."""

    KIND = ReportKind.LEAVING


@dataclass(frozen=True)
class Rows(Report):
    """A compute group's leader (``group``): its lost member ``worker``'s ``rows`` of each
    block (from 0) it never reported."""

    KIND = ReportKind.ROWS
    worker: int
    group: int
    rows: dict[int, int]


@dataclass(frozen=True)
class Lead(Report):
    """A compute group's member in lost leader ``group``'s place, with the ``acts`` (shares
    taken, parts given, in order) that the leader may not have told."""

    KIND = ReportKind.LEAD
    group: int
    acts: tuple[Adopt | Give, ...]

    def fields(self) -> dict[str, Any]:
        return {"group": self.group, "acts": [encode(act) for act in self.acts]}

    @classmethod
    def of_fields(cls, values: dict[str, Any]) -> Message:
        acts = values.get("acts")
        if not isinstance(acts, list | tuple):
            raise BadReport(f"a lead message's acts are not a list: {type(acts).__name__}")
        decoded = tuple(_decode(act, ACTS, "act") for act in acts)
        return super().of_fields({**values, "acts": decoded})


# -- server 0's words to the other servers ----------------------------------------------------------
@dataclass(frozen=True)
class Serve(Word):
    """Serve joiner ``client`` (waiting ``connect_timeout`` seconds for it to connect)."""

    KIND = WordKind.SERVE
    client: int
    connect_timeout: float


@dataclass(frozen=True)
class Leads(Word):
    """Worker ``client`` leads its compute group in its lost leader's place."""

    KIND = WordKind.LEAD
    client: int


@dataclass(frozen=True)
class Rest(Word):
    """Worker ``client`` rests (nothing to push) or, not ``resting``, works again."""

    KIND = WordKind.REST
    client: int
    resting: bool


@dataclass(frozen=True)
class Taken(Word):
    """Joiner ``client``'s first pull was taken for the records: forget it."""

    KIND = WordKind.TAKEN
    client: int


M = TypeVar("M", bound=Message)

#: Each report kind's class.
REPORTS: dict[str, type[Report]] = {cls.KIND.value: cls for cls in (
    Started, Progress, EpochEnd, CheckpointPart, Final, Failed, Adopt, Give, Idle, Joined,
    Leave, Rows, Lead)}
ACTS: dict[str, type[Adopt | Give]] = {"adopt": Adopt, "give": Give}  #: a :class:`Lead`'s acts
#: Each word kind's class.
WORDS: dict[str, type[Word]] = {cls.KIND.value: cls for cls in (Serve, Leads, Rest, Taken)}
#: The report kinds of an ``--elastic`` job only.
ELASTIC_KINDS = frozenset({ReportKind.ADOPT, ReportKind.GIVE, ReportKind.IDLE, ReportKind.JOINED,
                           ReportKind.LEAVING, ReportKind.ROWS, ReportKind.LEAD})


def encode(message: Message) -> dict[str, Any]:
    """``message``'s wire form: ``{"kind": kind, **fields}``."""
    return {"kind": message.KIND.value, **message.fields()}


def decode_report(obj: object, elastic: bool = True) -> Report:
    """The report whose wire form is ``obj``; not ``elastic``: one of a job without
    ``--elastic``.

    Raises:
        BadReport: not a report of a known kind with its fields.
    """
    report = _decode(obj, REPORTS, "report kind")
    if report.KIND in ELASTIC_KINDS and not elastic:
        raise BadReport(f"a {report.KIND} report, which only an --elastic job's workers send")
    return report


def decode_epoch(obj: object) -> EpochEnd:
    """The epoch report whose wire form is ``obj`` (an asynchronous checkpoint's).

    Raises:
        BadReport: not an epoch report with its fields.
    """
    return _decode(obj, {ReportKind.EPOCH.value: EpochEnd}, "epoch report kind")


def decode_word(obj: object) -> Word:
    """Server 0's word whose wire form is ``obj``.

    Raises:
        BadReport: not a word of a known kind with its fields.
    """
    return _decode(obj, WORDS, "word from server 0")


def _decode(obj: object, kinds: Mapping[str, type[M]], what: str) -> M:
    if not isinstance(obj, dict):
        raise BadReport(f"a message that is no dict: {type(obj).__name__}")
    kind = obj.get("kind")
    cls = kinds.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise BadReport(f"unknown {what}: {kind!r}")
    message = cls.of_fields({k: v for k, v in obj.items() if k != "kind"})
    assert isinstance(message, cls)
    return message


@functools.cache
def _hints(cls: type[Message]) -> dict[str, Any]:
    """``cls``'s fields, in order, and their types."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _typed(value: Any, hint: Any, name: str) -> Any:
    """``value`` as field ``name`` of type ``hint`` takes it: numbers converted, a value of
    another kind refused."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    try:
        if hint in (int, float):
            if isinstance(value, bool | bytes):
                raise TypeError
            return hint(value)
        if hint is str and isinstance(value, str):
            return value
        if hint is bool and isinstance(value, int):
            return bool(value)
        if origin is dict and isinstance(value, dict):
            return {_typed(k, args[0], name): _typed(v, args[1], name) for k, v in value.items()}
        if origin is list and isinstance(value, list | tuple):
            return [_typed(v, args[0], name) for v in value]
        if origin is tuple and isinstance(value, list | tuple):
            return tuple(value)
        if hint is Any:
            return value
    except (TypeError, ValueError):
        pass
    raise BadReport(f"{name} is not {hint.__name__ if isinstance(hint, type) else hint}: "
                    f"{type(value).__name__}")


__all__ = ["ACTS", "ELASTIC_KINDS", "REPORTS", "WORDS", "Adopt", "BadReport", "CheckpointPart",
           "EpochEnd", "Failed", "Final", "Give", "Idle", "Joined", "Lead", "Leads", "Leave",
           "Message", "Progress", "Report", "ReportKind", "Rest", "Rows", "Serve", "Started",
           "Taken", "Where", "Word", "WordKind", "decode_epoch", "decode_report", "decode_word", "encode"]
