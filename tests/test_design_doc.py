"""docs/design.md's "where to change" table: a row names at most three files, and every
file it names exists, so that the map a newcomer follows stays short and true."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
#: A file a row names: a code span that is a module or a path (``shoal/train/job.py``,
#: ``tests/x.py``); a file a run writes (``summary.json``) is not one.
_SPAN = re.compile(r"`([\w./-]+\.[a-z]+)`")
MOST = 3


def _rows() -> list[str]:
    """The table's rows under the "Where to make a change" heading (header and rule left out)."""
    text = DESIGN.read_text()
    section = text.split("## Where to make a change", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return rows[2:]


def _files(row: str) -> set[str]:
    return {f for f in _SPAN.findall(row) if f.endswith(".py") or "/" in f}


def test_the_table_is_there():
    rows = _rows()
    assert len(rows) >= 10
    wanted = ("a worker dies in an asynchronous elastic job", "add a field to a membership change",
              "a joiner's state hand-over")
    firsts = [row.split("|")[1].strip() for row in rows]
    for want in wanted:
        assert any(want in first for first in firsts), want


def test_each_row_names_at_most_three_files():
    over = {row.split("|")[1].strip(): sorted(_files(row)) for row in _rows()
            if len(_files(row)) > MOST}
    assert not over, over


def test_each_file_a_row_names_exists():
    missing = sorted(f for row in _rows() for f in _files(row) if not (ROOT / f).is_file())
    assert not missing, missing
