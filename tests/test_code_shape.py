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
    """A trainer's loader is made in one place (``Trainer._make_loader``), and a new plan reaches
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


#: What a component may not hold as an untyped back-reference: its caller (the trainer,
#: server 0's coordinator) reaches it through a small typed context instead
#: (:mod:`shoal.train.membership.context`).
BACK_REFERENCES = ("t", "c", "trainer", "owner", "coordinator", "parent")


def _annotated(tree: ast.AST) -> list[tuple[str, int, ast.expr]]:
    """Each parameter and field (``x: T``, ``self.x: T``) of ``tree``: name, line, annotation."""
    found: list[tuple[str, int, ast.expr]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            found += [(p.arg, p.lineno, p.annotation) for p in
                      (*a.posonlyargs, *a.args, *a.kwonlyargs) if p.annotation is not None]
        elif isinstance(node, ast.AnnAssign):
            target = node.target
            name = target.id if isinstance(target, ast.Name) else \
                target.attr if isinstance(target, ast.Attribute) else ""
            found.append((name, node.lineno, node.annotation))
    return found


def test_no_component_holds_an_untyped_back_reference():
    """No parameter or field of ``shoal/train/`` named as a back-reference (``t``,
    ``trainer``, ``coordinator``, ...) is typed ``Any``: a component names what it reads of
    its caller (a :class:`~typing.Protocol`), so that the trainer's fields are not a bag
    every module reaches into."""
    untyped = []
    for path in sorted((ROOT / "train").rglob("*.py")):
        for name, line, hint in _annotated(ast.parse(path.read_text())):
            if name in BACK_REFERENCES and "Any" in ast.unparse(hint):
                untyped.append(f"{path.relative_to(ROOT)}:{line} {name}")
    assert untyped == []


#: ``getattr(x, "name")`` allowed where ``x`` is no strategy, options or rule: (file, name).
#: train/optim.py reads torch's own wrapper of an optimizer's step (``functools.wraps``'s
#: ``__wrapped__``, a function's ``__code__``) to replace it where it is torch's.
GETATTR_ALLOWED = {("train/optim.py", "__wrapped__"), ("train/optim.py", "__code__")}


def test_strategies_capabilities_are_declared_not_probed():
    """No ``hasattr``/``setattr`` in ``shoal/strategies/``, ``shoal/train/``,
    ``shoal/plan/``, ``shoal/ps/``, and no ``getattr`` of a named attribute there but
    :data:`GETATTR_ALLOWED`: what a strategy, its options or its server rule can do is a
    declared :class:`~typing.Protocol` (:mod:`shoal.strategies.capabilities`,
    :mod:`shoal.ps.rule`) or a field with a default, asked with ``isinstance``."""
    probes = []
    for area in ("strategies", "train", "plan", "ps"):
        for path in sorted((ROOT / area).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                    continue
                name, args = node.func.id, node.args
                literal = len(args) > 1 and isinstance(args[1], ast.Constant) \
                    and isinstance(args[1].value, str)
                if name in ("hasattr", "setattr") or (
                        name == "getattr" and literal
                        and (where, args[1].value) not in GETATTR_ALLOWED):
                    probes.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    assert probes == []


def test_no_module_sets_a_trainers_plan_or_loader():
    """Outside the trainer, no module sets another object's ``plan`` or ``loader``: a new
    plan reaches the loader, evaluation, records and checkpoints through
    ``Trainer.install_plan`` alone (a tracker's context has its plan read-only)."""
    set_from_outside = []
    for path in sorted((ROOT / "train").rglob("*.py")):
        if path.name == "trainer.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and t.attr in ("plan", "loader") \
                            and not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                        set_from_outside.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert set_from_outside == []



#: The annotations that make a name a trainer: shoal's :class:`Trainer` (where the module
#: imports it from ``shoal.train.trainer``) and the typed contexts it meets.
TRAINER_CONTEXTS = {"LoopContext", "LiveContext"}

FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _is_trainer(hint: ast.expr | None, imported: bool) -> bool:
    names = {n.id for n in ast.walk(hint) if isinstance(n, ast.Name)} if hint else set()
    return bool(names & TRAINER_CONTEXTS) or (imported and "Trainer" in names)


def _trainer_names(tree: ast.Module, imported: bool) -> list[tuple[ast.AST, set[str]]]:
    """Each function of ``tree`` with the names it has for a trainer: its typed parameters,
    ``Trainer(...)``'s, aliases of either, and the module's trainer fields (``self.t``)."""
    fields = {f"self.{n.target.id}" for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)
              and isinstance(n.target, ast.Name) and _is_trainer(n.annotation, imported)}
    scopes = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, FUNCTIONS)):
        a = fn.args
        names = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)
                 if _is_trainer(p.annotation, imported)}
        pairs = [(t, n.value) for n in ast.walk(fn) if isinstance(n, ast.Assign) for t in n.targets]
        pairs += [pair for ts, vs in pairs if isinstance(ts, ast.Tuple) and isinstance(vs, ast.Tuple)
                  for pair in zip(ts.elts, vs.elts, strict=False)]  # ``t, st = self.t, ...``
        for _ in range(3):  # aliases of aliases (``t = self.t = trainer``)
            for target, value in pairs:
                made = imported and isinstance(value, ast.Call) and ast.unparse(value.func) == "Trainer"
                if made or ast.unparse(value) in names | fields:
                    names.add(ast.unparse(target))
        fields |= {n for n in names if n.startswith("self.")}
        scopes.append((fn, names))
    return [(fn, names | fields) for fn, names in scopes]


def _assigned(node: ast.AST) -> list[ast.Attribute]:
    """The attributes that the assignment ``node`` sets (a tuple's each); none where it is
    no assignment."""
    targets = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
    found: list[ast.Attribute] = []
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets += target.elts
        elif isinstance(target, ast.Starred):
            targets.append(target.value)
        elif isinstance(target, ast.Attribute):
            found.append(target)
    return found


def test_nobody_sets_a_trainers_fields():
    """No module of ``shoal/`` but the trainer's own sets a field of a trainer (``t.x =
    ...``, where ``t`` is a :class:`Trainer` or one of its typed contexts), and the trainer
    keeps every field private (``self._x``): its components read it through read-only
    properties and change it through its commands (``install_plan``, ``join_group``...),
    so that what of the loop each component touches is named in one place."""
    trainer_py = ROOT / "train" / "trainer.py"
    set_from_outside = set()
    for path in sources():
        text = path.read_text()
        if path == trainer_py:
            continue
        imported = "from shoal.train.trainer import" in text
        for fn, names in _trainer_names(ast.parse(text), imported):
            set_from_outside |= {f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(a)}"
                                 for node in ast.walk(fn) for a in _assigned(node)
                                 if ast.unparse(a.value) in names}
    assert sorted(set_from_outside) == []
    trainer = next(n for n in ast.parse(trainer_py.read_text()).body
                   if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    public = [f"train/trainer.py:{node.lineno} {ast.unparse(a)}"
              for node in ast.walk(trainer) for a in _assigned(node)
              if ast.unparse(a.value) == "self" and not a.attr.startswith("_")]
    assert public == []
