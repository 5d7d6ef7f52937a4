"""The code's shape rules, checked: no module of ``shoal/`` over 400 lines and no function over
60 (docstring included), so that each file can be read whole and each function at a glance
(docs/design.md). A module that must be longer says why in its first lines and is listed here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import shoal

ROOT = Path(shoal.__file__).parent
MODULE_LINES = 400
FUNCTION_LINES = 60


def sources() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in sources()
            if (n := p.read_text().count("\n")) > MODULE_LINES}
    assert long == {}


def test_no_function_is_over_60_lines():
    long = {}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = lines
    assert long == {}


def _calls(name: str) -> dict[str, int]:
    """Where ``shoal/`` calls ``name(...)`` (a plain or attribute name): file -> count."""
    found: dict[str, int] = {}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and name in (getattr(node.func, "id", None),
                                                       getattr(node.func, "attr", None)):
                key = str(path.relative_to(ROOT))
                found[key] = found.get(key, 0) + 1
    return found


def test_a_trainers_plan_is_installed_in_one_place():
    """A trainer's loader is made in one place (``Trainer._loader``), and a new plan reaches
    the loader, evaluation, records and checkpoints through ``Trainer.install_plan`` alone:
    two hand-made copies of it had drifted (only the synchronous one moved the evaluation
    and the checkpoints to the new plan). The coordinator's own loader reads the test set
    only."""
    assert _calls("ShardLoader") == {"train/trainer.py": 1, "train/coordinator.py": 1}
    assert set(_calls("install_plan")) <= {"train/membership/tracker/process_group.py",
                                           "train/membership/tracker/detached.py"}


def test_library_code_logs_instead_of_printing():
    """Outside the command's own output (``shoal/cli/``), shoal says things through
    :mod:`logging` (``shoal.<area>`` loggers, ``shoal.out`` for results), whose handlers
    :mod:`shoal.core.logs` installs in every process the command starts: one ``print`` to
    the wrong stream had sent a lost worker's line to stdout, its elastic twin's to stderr."""
    printed = {file: n for file, n in _calls("print").items() if not file.startswith("cli/")}
    assert printed == {}
