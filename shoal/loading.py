"""Loading a user's own code named in a setting (``--model pkg.module:factory``,
``--strategy path/to/file.py:Class``), and what it did wrong, in one line.

It stands below every part of shoal that takes such a name (models, strategies), so that
none of them borrows it from another.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from shoal.errors import ShoalError


def load_object(spec: str, what: str) -> object:
    """Import ``pkg.module:attr`` or ``path/to/file.py:attr`` and return the attribute."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ShoalError(f"{what} {spec!r}: expected pkg.module:name or file.py:name")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ShoalError(f"{what} {spec!r}: file {path} does not exist")
            mod_spec = importlib.util.spec_from_file_location(path.stem, path)
            assert mod_spec is not None and mod_spec.loader is not None
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules.setdefault(path.stem, module)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ShoalError(f"{what} {spec!r}: cannot import {module_name} ({exc})") from None
    except ShoalError:
        raise
    except SystemExit as exc:
        raise ShoalError(f"{what} {spec!r}: importing {module_name} {exited(exc)}") from exc
    except Exception as exc:
        raise ShoalError(f"{what} {spec!r}: importing {module_name} failed: "
                         f"{one_line(exc)}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ShoalError(f"{what} {spec!r}: {module_name} has no attribute {attr!r}") from None


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message``: an exception as one line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def exited(exc: SystemExit) -> str:
    """What a user's code did that raised ``exc``: ``called sys.exit(3)``."""
    return f"called sys.exit({exc.code!r})" if exc.code is not None else "called sys.exit()"
