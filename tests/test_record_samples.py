"""--record-samples' lines (shoal.train.membership.samples): a line worker 0 writes for a lost worker and
the worker's own line for the same count are written once, whoever comes first; a half line
a kill left is cut off; a lock held elsewhere is waited for, or given up after ``wait``."""

from __future__ import annotations

import fcntl
import json
import os

import pytest
import torch

from shoal.errors import ShoalError
from shoal.train.membership.samples import record_samples, record_since


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_worker_0_writes_a_lost_workers_line_only_if_it_did_not(tmp_path):
    path = tmp_path / "worker2.jsonl"
    record_samples(path, {0: torch.tensor([1, 2])}, step=5)
    record_samples(path, {0: torch.tensor([3, 4])}, step=9)
    record_samples(path, {0: torch.tensor([3, 4])}, step=9, by=0)  # it wrote it itself
    assert _lines(path) == [{"epoch": 0, "samples": [1, 2], "step": 5},
                            {"epoch": 0, "samples": [3, 4], "step": 9}]
    record_samples(path, {1: torch.tensor([7])}, step=12, by=0)  # it died before it did
    record_samples(path, {1: torch.tensor([7])}, step=12)  # it comes back (SIGCONT) later
    assert _lines(path)[2:] == [{"epoch": 1, "samples": [7], "step": 12, "recorded_by": 0}]


def test_server_0_writes_an_async_workers_samples_since_its_last_line_once(tmp_path):
    path = tmp_path / "worker1.jsonl"
    walk = torch.tensor([10, 11, 12, 13, 14, 15])  # the worker's schedule, in order
    asked = []

    def since(last, upto=5):
        asked.append(last)
        return {0: walk[last:upto]}

    record_since(path, 2, lambda _: {0: walk[0:2]})  # the worker's own count
    assert record_since(path, 5, since, "server 0")  # lost after the push of 5
    assert asked == [2]
    record_since(path, 5, lambda _: {0: walk[2:5]})  # it comes back (SIGCONT): written already
    record_since(path, 6, lambda _: {0: walk[5:6]})
    assert record_since(path, 5, since, "server 0") and asked == [2]  # nothing again
    assert _lines(path) == [{"epoch": 0, "samples": [10, 11], "upto": 2},
                            {"epoch": 0, "samples": [12, 13, 14], "upto": 5,
                             "recorded_by": "server 0"},
                            {"epoch": 0, "samples": [15], "upto": 6}]


def test_a_half_line_left_by_a_kill_is_cut_off(tmp_path):
    path = tmp_path / "worker1.jsonl"
    record_samples(path, {0: torch.tensor([1])}, step=1)
    with path.open("a") as f:
        f.write('{"epoch": 0, "samp')  # killed mid-write (a line longer than a page)
    record_samples(path, {0: torch.tensor([2])}, step=2, by=0)
    assert [r["samples"] for r in _lines(path)] == [[1], [2]]


def test_a_lock_held_elsewhere_is_given_up_after_the_wait(tmp_path):
    path = tmp_path / "worker1.jsonl"
    record_samples(path, {0: torch.tensor([1])}, step=1)
    held = os.open(path, os.O_RDONLY)  # another process's open: a worker stopped in its write
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert not record_samples(path, {0: torch.tensor([2])}, step=2, by=0, wait=0.05)
    finally:
        os.close(held)
    assert record_samples(path, {0: torch.tensor([2])}, step=2, by=0, wait=0.05)
    assert [r["samples"] for r in _lines(path)] == [[1], [2]]


def test_a_planted_link_is_neither_followed_nor_cut(tmp_path):
    """The file is read back and a half line cut off: a link planted in its place (to a
    file shoal did not write) is refused in one line, and that file stays as it was."""
    victim = tmp_path / "notes.txt"
    victim.write_text('line one\nhalf a line')
    path = tmp_path / "worker1.jsonl"
    path.symlink_to(victim)
    with pytest.raises(ShoalError, match="symbolic link"):
        record_samples(path, {0: torch.tensor([1])}, step=1, by=0)
    assert victim.read_text() == 'line one\nhalf a line'
