"""A collective in flight: :class:`Handle`, what :meth:`Comm.all_reduce_async
<shoal.core.comm.Comm.all_reduce_async>` returns."""

from __future__ import annotations

from typing import Any

import torch

from shoal.core.timeline import COMM


class Handle:
    """A collective in flight (number ``seq`` in its Comm's log, ``comm``). :meth:`wait` blocks and books
    the waiting as communication."""

    def __init__(self, comm: Any, work: Any, tensor: torch.Tensor, op: str, name: str,
                 seq: int = 0, nbytes: int = 0) -> None:
        self._comm, self._work, self._tensor, self._op, self._name = comm, work, tensor, op, name
        self._seq, self._nbytes = seq, nbytes  # ``nbytes``: in flight until the wait

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            log = self._comm.log
            try:
                with self._comm.timeline.span(COMM, self._name), log.blocked(self._seq):
                    self._work.wait()
            finally:
                log.finish(self._seq)
                self._comm.in_flight -= self._nbytes
            self._work = None
            if self._op == "avg":
                self._tensor.div_(self._comm.world_size)
        return self._tensor
