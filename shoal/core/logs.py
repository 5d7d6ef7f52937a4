"""Where shoal's log lines go: the lines the ``shoal`` command shows, through :mod:`logging`.

shoal's modules log to ``shoal.<area>`` loggers (``shoal.train``, ``shoal.plan``,
``shoal.core``, ...): a notice a person reads (a worker lost or joined, a plan made) at INFO,
something wrong at WARNING or above. What the command prints as its results (the planner's
``trial 1: ...`` lines, a sweep's table, the progress lines) goes to ``shoal.out``.

:func:`install` puts two handlers in place, each writing the bare message: ``shoal``'s INFO
and above to standard error, ``shoal.out``'s to standard output. The ``shoal`` command
installs them in its own process, and every process shoal starts (its workers, servers,
keepers, planning trials: :func:`shoal.core.starting.run_as_launched`, and the modules run
as ``python -m``) installs them before it runs its target, so a line comes out where and
when a ``print`` of it did. Each handler finds ``sys.stdout`` or ``sys.stderr`` as it is
when a record comes (pytest's capture, a process's streams put in place after it started)
and flushes each line.

A library user (the own-loop API under its own launcher, :func:`shoal.launch` from a
notebook) who sets up no logging sees shoal's warnings and errors on standard error
(Python's last-resort handler) and none of its notices or results; ``logging.basicConfig``
or a handler on the ``shoal`` logger shows them too.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

#: The logger of what the command prints as its results, on standard output.
OUT = "shoal.out"

class StdStream(logging.StreamHandler):
    """A handler that writes to ``sys.stdout`` (``out``) or ``sys.stderr`` as it is when
    each record comes; a record's ``end`` (``extra={"end": ""}``) ends its line instead of
    a newline."""

    def __init__(self, out: bool) -> None:
        logging.Handler.__init__(self)  # not StreamHandler's: the stream is looked up
        self.out = out

    @property
    def stream(self) -> TextIO:  # type: ignore[override]
        return sys.stdout if self.out else sys.stderr

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.stream.write(self.format(record) + record.__dict__.get("end", "\n"))
            self.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def install(debug: bool = False) -> None:
    """Put shoal's two handlers in place in this process, once (see the module's text);
    ``debug`` (``--debug``) shows DEBUG records too. Called again, it only sets the level
    that ``debug`` asks for."""
    level = logging.DEBUG if debug else logging.INFO
    for name in ("shoal", OUT):
        logger = logging.getLogger(name)
        logger.setLevel(level)
        mine = [h for h in logger.handlers if isinstance(h, StdStream)]
        if not mine:
            mine = [StdStream(out=name == OUT)]
            mine[0].setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(mine[0])
    logging.getLogger(OUT).propagate = False  # not again on standard error
