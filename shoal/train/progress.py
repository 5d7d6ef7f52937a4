"""What a person watching a run sees: a progress bar on a terminal, short lines otherwise."""

from __future__ import annotations

import logging
import sys
from typing import Any

out_log = logging.getLogger("shoal.out")


class Progress:
    """Rank 0's view of the run. ``mode``: ``bar``, ``plain``, ``none`` or ``auto``."""

    def __init__(self, mode: str, enabled: bool) -> None:
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "plain"
        self.mode = mode if enabled else "none"
        self._bar: Any = None

    def start_epoch(self, epoch: int, epochs: int, steps: int, done: int = 0) -> None:
        if self.mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=steps, initial=done, desc=f"epoch {epoch}/{epochs}",
                             leave=False, dynamic_ncols=True, file=sys.stderr)

    def step(self, loss: float | None = None) -> None:
        if self._bar is not None:
            self._bar.update(1)
            if loss is not None:
                self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def end_epoch(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def line(self, text: str) -> None:
        if self.mode == "none":
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            out_log.info(text)
