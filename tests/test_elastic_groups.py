"""Compute groups (``groups``) under --elastic: a group walks one schedule, its members in
lockstep, each its part of every group batch. A member lost (kill -9, or silent past the
heartbeat timeout) fails the group's meeting; the members alive re-form the group and go on,
the group batch split over them. The leader lost: the next member takes its place at the
servers; lost in its exchange, its group leaves, and server 0 deals the group's rest, from
the leader's last exchange, over the other groups.
Real processes, Gloo on CPU; joining: test_elastic_join.py."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from shoal.strategies.groups import GroupOptions
from shoal.strategies.registry import get_strategy
from shoal.train.membership.messages import Adopt
from shoal.train.membership.schedule import Schedule, Slots, length
from shoal.train.membership.server.dealer import Dealer

from conftest import (
    EPOCHS,
    TRAIN_ROWS,
    assert_each_sample_once,
    one_error_line,
    train_here,
    train_losing,
)

pytestmark = pytest.mark.timeout(300)


def test_a_group_that_loses_a_member_goes_on_without_it(tmp_path):
    """Worker 1 (rank 2: server 0 first), a member of group 0, kills itself at its 20th
    training forward, mid-epoch 1. Its group re-forms from the members alive and goes on:
    nothing is dealt, and the survivors split each group batch among them (3 workers in one
    group: workers 0 and 2 read halves of 48 rows, where they read thirds). The job's count
    of samples, the sum of what each worker says it read plus the rows the leader tells of
    the member lost, is then exact, and so is the leader's record of the group's samples."""
    out, workers = tmp_path / "run", 3
    res = train_losing(out, 2, "train:20", "--schedule", "constant", "--strategy", "groups",
                       "--groups", "1", workers=workers, timeout=240)
    assert res.returncode == 0, res.stderr
    assert res.stray == []
    assert "its compute group goes on without it, led by worker 0" in res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and summary["workers"] == workers - 1
    [change] = summary["membership_changes"]
    assert change["left"] == [1] and change["why"] == {"1": "worker 1 killed by signal 9"}
    assert change["step"] == 19 and change["epoch"] == 1
    assert change["samples_dealt_again"] == 0
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)  # and summary["samples"] exact
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["worker0.jsonl"]


@pytest.mark.parametrize("in_exchange", [False, True])
def test_a_group_that_loses_its_leader_goes_on_led_by_the_next_member(tmp_path, in_exchange):
    """4 workers in 2 groups (0-1, 2-3), 16 rows each a step: a group step is 32 rows, 23
    steps an epoch. Worker 2, group 1's leader (it pushes for the group), is killed at its
    20th forward: worker 3 takes its place at the servers (server 0's count of worker 2 is
    the group's) and records the group's samples from there. Killed as its exchange starts
    instead (after its group's all-reduce: the step counts for its group, not at the
    server), the group cannot go on from the server's count: worker 3 leaves, and the
    group's rest, from worker 2's last exchange, goes to the other group."""
    out = tmp_path / "run"
    res = train_losing(out, 3, "train:20", "--schedule", "constant", "--strategy",
                       "groups", "--groups", "2", workers=4, timeout=240,
                       more_env={"SHOAL_TEST_KILL_IN_EXCHANGE": "1"} if in_exchange else None)
    assert res.returncode == 0, res.stderr
    assert res.stray == []
    summary = json.loads((out / "summary.json").read_text())
    changes = {c["left"][0]: c for c in summary["membership_changes"]}
    assert changes[2]["why"] == {"2": "worker 2 killed by signal 9"}
    assert {c["step"] for c in changes.values()} == {19}
    assert {c["epoch"] for c in changes.values()} == {1}
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)
    files = sorted(p.name for p in (out / "samples").iterdir())
    if not in_exchange:
        assert "worker 3 leads its compute group in worker 2's place" in res.stderr
        assert summary["completed"] and summary["workers"] == 3
        assert sorted(changes) == [2] and changes[2]["group_led_by"] == 3
        assert changes[2]["samples_dealt_again"] == 0
        # worker 2's file holds the group's samples to its last count, worker 3's the rest
        assert files == ["worker0.jsonl", "worker2.jsonl", "worker3.jsonl"]
        return
    assert summary["completed"] and summary["workers"] == 2
    assert sorted(changes) == [2, 3] and "group_led_by" not in changes[2]
    assert changes[3]["why"] == {"3": "worker 3 left: its compute group (workers 2-3) lost "
                                      "its leader (worker 2) in its exchange"}
    # dealt at its last member's loss: its two shards an epoch (359 + 359 rows), less the
    # 19 steps that counted at the server
    assert changes[2]["samples_dealt_again"] == 0
    assert changes[3]["samples_dealt_again"] == EPOCHS * 718 - 32 * 19
    assert files == ["worker0.jsonl", "worker2.jsonl"]


@pytest.mark.parametrize("stopped", [3, 2])
def test_a_silent_member_or_leader_is_left_out_within_the_heartbeat_timeout(tmp_path, stopped):
    """Worker 3 (a member) or 2 (its leader) stops (SIGSTOP) in its group's step: the
    other's collective gives up after --heartbeat-timeout (not --timeout, 300 s), server 0
    says the stopped one is gone, and the other goes on alone in its group (in the
    leader's place: worker 3); the launcher ends the stopped process at the end."""
    out = tmp_path / "run"
    res = train_losing(out, stopped + 1, "train:20", "--strategy", "groups", "--groups", "2",
                       "--heartbeat-timeout", "4", signal=19, workers=4, timeout=240)
    assert res.returncode == 0, res.stderr
    assert res.stray == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and summary["workers"] == 3
    [change] = summary["membership_changes"]
    assert change["left"] == [stopped]
    assert change["why"][str(stopped)].startswith(f"worker {stopped} stopped answering")
    assert change["samples_dealt_again"] == 0
    assert change.get("group_led_by") == (3 if stopped == 2 else None)
    assert_each_sample_once(out, EPOCHS, TRAIN_ROWS)


def test_a_groups_schedule_is_its_members_shards_and_only_groups_are_dealt_to():
    slots = Slots(100, 20, 4, seed=0)  # 4 workers of 5 rows a step
    group = Schedule(slots, 2, 2, members=2)
    assert group.blocks[1] == [(1, 2, 0, slots.sizes[2]), (1, 3, 0, slots.sizes[3])]
    assert group.epoch_at(0) == 0 and group.epoch_at(slots.sizes[2] + slots.sizes[3]) == 1
    cfg = type("Cfg", (), {"epochs": 2, "seed": 0, "record_samples": False,
                           "global_batch": lambda self, w: 20})()
    dealer = Dealer(cfg, dist.HashStore(), 100, 4, 1, groups=((0, 2), (2, 4)))
    assert dealer.units({0, 1, 2, 3, 5}) == [0, 2, 5]  # 5: a joiner, a group of its own
    assert dealer.unit_of(1) == 0 and dealer.unit_of(3) == 2 and dealer.unit_of(5) == 5
    # a member lost deals nothing; its leader lost deals the group's rest to group 0's first
    assert dealer.lost(3, {"counted": 0, "step": 4, "group_at": 40}, {0, 1, 2},
                       lambda: "killed") == 0
    assert dealer.changes[-1].epoch == 1  # its group's epoch (from 1), not the last
    dealt = dealer.lost(2, {"counted": 40, "step": 4}, {0, 1}, lambda: "left")
    assert dealt == 2 * (slots.sizes[2] + slots.sizes[3]) - 40
    assert list(dealer.deals[-1]) == [0]
    # a joiner's part comes from the groups alone (a member gives nothing)
    dealer.admit(5, {0, 1}, 4, 0)
    assert dealer.giving[len(dealer.deals)]["waiting"] == {0}


def test_a_joiner_computes_alone_past_the_groups_layout():
    topology = get_strategy("groups").topology(GroupOptions(groups=2), 4)
    assert topology.group(3) == (2, 4) and topology.group(4) == (4, 5)


def test_a_member_in_a_lost_leaders_place_takes_its_groups_schedule_and_deals():
    """Server 0's side of a takeover: the leader lost with a member alive deals nothing;
    the member's word (``lead``) makes the group's schedule its, with the share the lost
    leader took but never told (in the member's list of the group's acts); what was lost
    while no group had a leader is dealt to it then; a group's rest is dealt once its last
    member is lost."""
    slots = Slots(100, 20, 4, seed=0)
    cfg = type("Cfg", (), {"epochs": 2, "seed": 0, "record_samples": False,
                           "global_batch": lambda self, w: 20})()
    dealer = Dealer(cfg, dist.HashStore(), 100, 4, 1, groups=((0, 2), (2, 4)))
    size = [slots.sizes[0] + slots.sizes[1], slots.sizes[2] + slots.sizes[3]]  # an epoch's
    piece = (1, 0, 0, 5)  # a share dealt to group 0, which worker 0 took without telling
    dealer._publish({0: [piece]}, {0, 1, 2, 3})
    dealer.lost(0, {"counted": 10, "step": 2}, {1, 2, 3}, lambda: "killed")
    assert not any(dealer.deals[-1].values()) and dealer.changes[-1].samples_dealt_again == 0
    assert dealer.heirs(0, {1, 2, 3}) == [1] and dealer.orphans == {0}
    # worker 2 lost (group 2 goes on, led by 3), then 3, while group 0 has no leader
    dealer.lost(2, {"counted": 8, "step": 2}, {1, 3}, lambda: "killed")
    dealer.lost(3, {"counted": 0, "step": 2}, {1}, lambda: "left")
    assert dealer.units({1}) == [] and dealer.changes[-1].samples_dealt_again == 2 * size[1] - 8
    dealer.lead(1, 0, [Adopt(deal=1, epoch=0, offset=10)], {1})
    assert dealer.units({1}) == [1] and dealer.unit_of(1) == 1 and not dealer.orphans
    assert dealer.changes[0].group_led_by == 1
    assert dealer.schedules[1] is dealer.schedules[0] and 1 in dealer.adopted[1]
    assert length(dealer.schedules[1].rest(10)) == 2 * size[0] - 10 + 5
    # group 2's rest, lost while group 0 had no leader, is dealt to it now
    assert list(dealer.deals[-1]) == [1] and length(dealer.deals[-1][1]) == 2 * size[1] - 8
    dealer.take(1, Adopt(deal=len(dealer.deals), epoch=0, offset=20))
    assert length(dealer.schedules[1].rest(20)) == 2 * size[0] - 20 + 5 + 2 * size[1] - 8


def test_an_elastic_groups_run_resumes_unless_its_groups_changed(tmp_path, monkeypatch):
    """Stopped at step 30 (a checkpoint) and resumed with one epoch more: each group goes on
    from its leader's position (a member from its group's, its own schedule empty) and
    walks its members' shards of the new epoch: every sample of every epoch once. A run
    whose groups lost a worker before its checkpoint is refused at --resume, in one line.
    The runs that must only succeed run in this process (``train_losing``'s flags); the
    refusal's line is the command's."""
    out = tmp_path / "run"
    flags = ["--strategy", "groups", "--groups", "2", "--schedule", "constant"]
    here = ["--model", "tests.fixtures_models:killed_at", "--dataset", "digits", "--workers",
            "4", "--epochs", str(EPOCHS), *flags, "--elastic", "--record-samples"]
    train_here(out, *here, "--stop-at-step", "30")
    train_here(out, *here, "--resume", "--epochs", str(EPOCHS + 1))
    assert json.loads((out / "summary.json").read_text())["epochs"] == EPOCHS + 1
    assert_each_sample_once(out, EPOCHS + 1, TRAIN_ROWS)
    changed = tmp_path / "changed"
    with monkeypatch.context() as patch:  # rank 2 (worker 1) kills itself at its 20th forward
        patch.setenv("SHOAL_TEST_KILL_RANK", "2")
        patch.setenv("SHOAL_TEST_KILL_AT", "train:20")
        train_here(changed, *here, "--stop-at-step", "30")
    res = train_losing(changed, 2, "train:20", *flags, "--resume", workers=4)
    assert res.returncode == 2
    assert one_error_line(res.stderr) == (
        "shoal: error: the checkpoint is of an --elastic run of compute groups that lost or "
        "gained workers, which does not resume yet (one that did not does); start from it "
        "with --init-from instead")
