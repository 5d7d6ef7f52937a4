"""shoal.fork works whatever the main program is: a script without a ``__main__`` guard,
stdin (``python -``), ``python -c`` and an interactive session. Workers never run the main
program; functions reach them by value."""

from __future__ import annotations

import shlex
import sys
import uuid

import pytest

from conftest import run, shoal_env

pytestmark = pytest.mark.timeout(120)

# Valid as a script and typed line by line into a REPL (the blank line ends the def). No
# `if __name__ == "__main__":` guard: a worker that re-ran it would fork again.
PROGRAM = """\
import torch, shoal

def square_sum(x):
    return (x * x).sum()

session = shoal.fork(2, timeout=60)
f = shoal.function(square_sum, scatter=["x"], reduce="sum")
g = shoal.function(lambda x: x.max(), scatter=["x"], reduce="max")
print("result", f(torch.arange(10.0)).item(), g(torch.arange(10.0)).item(), flush=True)
shoal.close()
print("exits", [p.exitcode for p in session.procs], flush=True)
"""
SERIAL = f"result {float(sum(i * i for i in range(10)))} 9.0"


def command(form: str, path: str) -> list[str]:
    python = shlex.quote(sys.executable)
    if form == "script":
        return [sys.executable, path]
    if form == "stdin":
        return ["sh", "-c", f"exec {python} - < {shlex.quote(path)}"]
    if form == "-c":
        return [sys.executable, "-c", PROGRAM]
    return ["sh", "-c", f"exec {python} -i < {shlex.quote(path)}"]  # a REPL fed by a pipe


@pytest.mark.parametrize("form", ["script", "stdin", "-c", "repl"])
def test_fork_from_any_main_program(tmp_path, form):
    path = tmp_path / "program.py"
    path.write_text(PROGRAM)
    marker = uuid.uuid4().hex
    res = run(command(form, str(path)), timeout=90, env=shoal_env(marker), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert any(ln.endswith(SERIAL) for ln in lines), res.stdout + res.stderr
    assert any(ln.endswith("exits [0]") for ln in lines), res.stdout + res.stderr
    assert res.stray == [], "worker processes outlived the program"
    assert "Traceback" not in res.stderr, res.stderr
