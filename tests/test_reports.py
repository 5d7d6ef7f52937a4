"""The typed report protocol above the parameter servers' transport (shoal.train.membership.messages) and
the membership changes' records (shoal.train.membership.changes): each message round-trips through its
wire form, a malformed or unknown one is refused in one line, and a change's record is the
JSON summary.json and the checkpoints always held."""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import re
from pathlib import Path

import pytest
import torch

from shoal.errors import ShoalError
from shoal.train.membership.changes import (
    joined_change,
    membership_change,
    of_records,
    records,
    resumed_change,
)
from shoal.train.membership.messages import (
    REPORTS,
    WORDS,
    Adopt,
    BadReport,
    CheckpointPart,
    EpochEnd,
    Failed,
    Final,
    Give,
    Idle,
    Joined,
    Lead,
    Leads,
    Leave,
    Progress,
    Rest,
    Rows,
    Serve,
    Started,
    Taken,
    decode_epoch,
    decode_report,
    decode_word,
    encode,
)

WHERE = {"worker": 1, "step": 12, "samples": 96, "times": {"compute": 1.5, "comm": 0.25},
         "bytes": 4096, "lr": 0.1, "elapsed_s": 2.5}
MESSAGES = [
    Started(**WHERE), Progress(**WHERE, trained=96),
    EpochEnd(**WHERE, epoch=1, sums=[3.5, 40.0, 96.0], buffers={"bn.mean": torch.ones(2)}),
    EpochEnd(**WHERE, epoch=2, sums=[0.0, 0.0, 0.0], buffers=None),
    CheckpointPart(**WHERE, own={"progress": {"step": 12}, "elastic": {"at": 90}}),
    Final(**WHERE, stopped=True, stopped_by="SIGTERM", epoch=2, train_time_s=2.0, device="cpu",
          trace=None),
    Failed(worker=1, error="ValueError: boom"), Adopt(deal=2, epoch=0, offset=10),
    Give(deal=3, epoch=1, offset=0), Idle(deals=4), Joined(digest="ab12"), Joined(digest=None),
    Leave(), Rows(worker=3, group=2, rows={0: 5, 1: 7}),
    Lead(group=0, acts=(Adopt(deal=1, epoch=0, offset=10), Give(deal=2, epoch=0, offset=12))),
]
WORD_MESSAGES = [Serve(client=5, connect_timeout=1.5), Leads(client=3),
                 Rest(client=1, resting=True), Taken(client=5)]


def _same(a: object, b: object) -> bool:
    """Equal, comparing tensors by value."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and _same(vars(a), vars(b))
    return a == b


def test_every_report_and_word_kind_has_a_class_and_round_trips_through_its_wire_form():
    assert {type(m).KIND.value for m in MESSAGES} == set(REPORTS)
    assert {type(m).KIND.value for m in WORD_MESSAGES} == set(WORDS)
    for message in MESSAGES:
        wire = pickle.loads(pickle.dumps(encode(message)))  # as the transport carries it
        assert type(wire) is dict and wire["kind"] == message.KIND.value
        assert _same(decode_report(wire), message), message
    for word in WORD_MESSAGES:
        assert decode_word(pickle.loads(pickle.dumps(encode(word)))) == word


def test_the_wire_form_keeps_the_fields_and_their_order_of_the_old_dicts():
    """A worker's records are ``{"kind", worker, step, samples, times, bytes, lr, elapsed_s,
    then its own}``, as the Reporter built them; an asynchronous checkpoint keeps its pending
    epoch reports in this form and reads them back."""
    epoch = MESSAGES[2]
    assert list(encode(epoch)) == ["kind", "worker", "step", "samples", "times", "bytes", "lr",
                                   "elapsed_s", "epoch", "sums", "buffers"]
    assert encode(Adopt(deal=2, epoch=0, offset=10)) == \
        {"kind": "adopt", "deal": 2, "epoch": 0, "offset": 10}
    assert encode(Rest(client=1, resting=False)) == {"kind": "rest", "client": 1, "resting": False}
    assert _same(decode_epoch(encode(epoch)), epoch)
    # numbers as the old handlers took them (int(), float()): a block's rows keyed by text
    assert decode_report({"kind": "rows", "worker": 3, "group": 2, "rows": {"0": 5}}) == \
        Rows(worker=3, group=2, rows={0: 5})


@pytest.mark.parametrize("obj, match", [
    ({"kind": "drop"}, "unknown report kind: 'drop'"),
    ({"deals": 1}, "unknown report kind: None"),
    ({"kind": ["idle"], "deals": 1}, r"unknown report kind: \['idle'\]"),
    (["idle", 1], "no dict: list"),
    (None, "no dict: NoneType"),
    ({"kind": "idle"}, r"idle message without its fields \['deals'\]"),
    ({"kind": "idle", "deals": 1, "more": 2}, r"idle message with fields it has not: \['more'\]"),
    ({"kind": "idle", "deals": "many"}, "idle.deals is not int: str"),
    ({"kind": "idle", "deals": None}, "idle.deals is not int: NoneType"),
    ({"kind": "joined", "digest": 7}, "joined.digest is not str: int"),
    ({"kind": "failed", "worker": 1, "error": b"x"}, "failed.error is not str: bytes"),
    ({"kind": "lead", "group": 0, "acts": 3}, "acts are not a list: int"),
    ({"kind": "lead", "group": 0, "acts": [{"kind": "idle", "deals": 1}]}, "unknown act: 'idle'"),
    ({"kind": "epoch", "worker": 0}, "epoch message without its fields"),
])
def test_a_malformed_or_unknown_report_is_refused_in_one_line(obj, match):
    with pytest.raises(BadReport, match=match) as caught:
        decode_report(obj)
    assert isinstance(caught.value, ShoalError) and "\n" not in str(caught.value)


def test_a_job_without_elastic_refuses_the_elastic_kinds_and_a_checkpoint_any_but_epochs():
    decode_report(encode(Idle(deals=1)))
    with pytest.raises(BadReport, match="idle report, which only an --elastic job's workers"):
        decode_report(encode(Idle(deals=1)), elastic=False)
    assert decode_report(encode(MESSAGES[0]), elastic=False) == MESSAGES[0]
    with pytest.raises(BadReport, match="unknown epoch report kind: 'started'"):
        decode_epoch(encode(MESSAGES[0]))
    with pytest.raises(BadReport, match="unknown word from server 0: 'idle'"):
        decode_word(encode(Idle(deals=1)))


# -- membership changes ---------------------------------------------------------------------------
def _json(record: dict) -> str:
    return json.dumps(record)  # key order included: summary.json is written in it


def test_each_change_record_is_the_json_the_old_dict_literals_made(capsys):
    """Each factory's record, key for key and in order, against the dict literal each call
    site built before (a key renamed or moved fails here)."""
    left = membership_change(40, 2, {3: "killed", 1: "left"}, 2, 120, last=3)
    assert _json(left.record()) == _json(
        {"step": 40, "epoch": 3, "left": [1, 3], "why": {3: "killed", 1: "left"}, "workers": 2,
         "samples_dealt_again": 120})
    assert "workers 1, 3 left at step 40 (killed; left); 2 go on with the 120 samples left " \
           "of epochs 3 to 4" in capsys.readouterr().err
    joined = joined_change(50, 1, [4], 3, 0)  # the asynchronous dealer's admit
    assert _json(joined.record()) == _json(
        {"step": 50, "epoch": 2, "joined": [4], "why": {4: "joined"}, "workers": 3,
         "samples_dealt_again": 0})
    back = joined_change(60, 0, [1, 2], 3, 77, "back at --resume")
    assert _json(back.record()) == _json(
        {"step": 60, "epoch": 1, "joined": [1, 2], "why": {1: "back at --resume",
                                                          2: "back at --resume"},
         "workers": 3, "samples_dealt_again": 77})
    more = resumed_change(2, 4, 30, 1, 64, say=False)
    fewer = resumed_change(4, 2, 30, 1, 64, say=False)
    assert resumed_change(2, 2, 30, 1, 64, say=False) is None
    assert _json(more.record()) == _json(
        {"step": 30, "epoch": 2, "joined": [2, 3], "why": {2: "started at --resume",
                                                          3: "started at --resume"},
         "workers": 4, "samples_dealt_again": 64})
    assert _json(fewer.record()) == _json(
        {"step": 30, "epoch": 2, "left": [2, 3], "why": {2: "not started at --resume",
                                                        3: "not started at --resume"},
         "workers": 2, "samples_dealt_again": 64})


def test_a_changes_later_facts_follow_its_keys_in_the_order_they_were_added():
    from dataclasses import replace

    join = replace(joined_change(8, 0, [2], 3, 16), state_sha256="aa",
                   joiner_state_sha256={"2": "bb"}, stall_s=0.25)  # a sync join's handover
    assert list(join.record()) == ["step", "epoch", "joined", "why", "workers",
                                   "samples_dealt_again", "state_sha256",
                                   "joiner_state_sha256", "stall_s"]
    hogwild = replace(joined_change(8, 0, [2], 3, 16), state="the shared parameters, mapped")
    assert hogwild.record()["state"] == "the shared parameters, mapped"
    led = replace(membership_change(5, 0, {0: "killed"}, 3, 0, say=False), group_led_by=1)
    assert list(led.record())[-1] == "group_led_by" and led.record()["group_led_by"] == 1
    # a checkpoint's records (torch.load, weights_only) read back to the same changes
    buffer = io.BytesIO()
    torch.save({"membership_changes": records([join, hogwild, led])}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)["membership_changes"]
    assert of_records(saved) == [join, hogwild, led] and records(None) == []
    # summary.json's text of them (its keys strings): what the tests of runs read
    text = json.loads(json.dumps(records([led])))
    assert text == [{"step": 5, "epoch": 1, "left": [0], "why": {"0": "killed"}, "workers": 3,
                     "samples_dealt_again": 0, "group_led_by": 1}]


def test_the_dealer_builds_and_amends_its_changes_as_records_the_old_dicts():
    """A join at server 0 (its give dealt, the joiner's digest told) and a compute group's
    leader lost then replaced, read as summary.json's records."""
    import torch.distributed as dist

    from shoal.train.membership.server.dealer import Dealer

    cfg = type("Cfg", (), {"epochs": 2, "seed": 0, "record_samples": False,
                           "global_batch": lambda self, w: 20})()
    dealer = Dealer(cfg, dist.HashStore(), 100, 2, 1)
    dealer.admit(2, {0, 1}, 7, 0)
    for worker in (0, 1):
        dealer.take(worker, Give(deal=1, epoch=0, offset=10))
    dealer.given({0, 1, 2})
    dealer.digests(2, None, None)
    [join] = records(dealer.changes)
    assert list(join) == ["step", "epoch", "joined", "why", "workers", "samples_dealt_again",
                          "state"]
    assert join["joined"] == [2] and join["workers"] == 3 and join["samples_dealt_again"] > 0
    assert join["state"] == "the shared parameters, mapped"


def test_every_message_and_change_is_built_in_one_module():
    """No dict literal with a "kind" travels in shoal/train outside membership/messages.py,
    and no membership change is built outside membership/changes.py."""
    train = Path(__file__).resolve().parents[1] / "shoal" / "train"
    for path in sorted(train.rglob("*.py")):
        text = path.read_text()
        if path.name != "messages.py":
            assert not re.search(r"""\{\s*["']kind["']\s*:""", text) or path.name == "health.py", \
                path  # health.py's "kind": summary.json's verdict of a collapsed run
        if path.name != "changes.py":
            assert "MembershipChange(" not in text, path
            assert not re.search(r"""["']samples_dealt_again["']\s*:""", text), path
