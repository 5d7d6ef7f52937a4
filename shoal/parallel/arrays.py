"""Arrays placed once where every worker can read them: ``shoal.shared(array)``.

On CPU the array is copied once into a memory-mapped file in ``/dev/shm`` (the system's
temporary directory where there is none); every worker maps the same pages, so selecting a
shuffled batch by index on each worker copies only that batch, never the data set. In a
``cuda`` session each process copies the array once onto its own GPU when it first sees it.
The file is removed when the :class:`SharedArray` object is garbage-collected or the program exits;
a controller killed with SIGKILL can leave a ``shoal-shared-*`` file behind.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import weakref
from typing import Any

import numpy as np
import torch

from shoal.errors import ShoalError

_IDS = itertools.count(1)


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
        else tempfile.gettempdir()


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _map(path: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    numel = int(np.prod(shape))
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


class SharedArray:
    """An array held once in shared memory, read by every worker without copies.

    Pass it to a parallel function as a ``scatter`` argument (each worker takes its rows,
    selected by the call's ``batch=`` indices when given), as a ``broadcast`` argument (every
    worker gets all of it) or as a plain argument; the function sees a ``torch.Tensor``.
    """

    def __init__(self, array: Any) -> None:
        src = array if isinstance(array, torch.Tensor) else torch.as_tensor(np.asarray(array))
        src = src.detach().cpu().contiguous()
        if src.dim() == 0 or src.numel() == 0:
            raise ShoalError(f"shoal.shared needs a non-empty array with rows, got shape {tuple(src.shape)}")
        self.id = next(_IDS)
        self.shape = tuple(src.shape)
        self.dtype = src.dtype
        fd, self.path = tempfile.mkstemp(prefix="shoal-shared-", dir=_shm_dir())
        try:
            os.ftruncate(fd, src.numel() * src.element_size())
        finally:
            os.close(fd)
        self._finalizer = weakref.finalize(self, _unlink, self.path)
        self.tensor = _map(self.path, self.dtype, self.shape)
        self.tensor.copy_(src)
        self._device_copy: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"shoal.shared({self.dtype}, shape={list(self.shape)})"

    def local(self, device: torch.device | None = None) -> torch.Tensor:
        """This process's view: the shared tensor, or its copy on ``device`` (cuda)."""
        if device is None or device.type == "cpu":
            return self.tensor
        if self._device_copy is None or self._device_copy.device != device:
            self._device_copy = self.tensor.to(device)
        return self._device_copy

    def handle(self) -> tuple[str, torch.dtype, tuple[int, ...]]:
        """What a worker needs to map the same memory."""
        return self.path, self.dtype, self.shape

    @classmethod
    def attach(cls, handle: tuple[str, torch.dtype, tuple[int, ...]]) -> SharedArray:
        """A worker's view of the controller's data (shares its memory, owns no file)."""
        self = cls.__new__(cls)
        self.path, self.dtype, self.shape = handle
        self.id = -1
        self.tensor = _map(self.path, self.dtype, self.shape)
        self._device_copy = None
        return self


def shared(array: Any) -> SharedArray:
    """Place ``array`` once in shared memory, where every worker reads it without copies.

    Pass the result to a parallel function as a ``scatter`` argument (each worker takes its
    rows, selected by the call's ``batch=`` indices when given), as a ``broadcast`` argument
    or as a plain one: the function sees a ``torch.Tensor``.

    Args:
        array: A tensor, a NumPy array or a nested list, with at least one dimension.

    Returns:
        The shared copy (a `shoal.parallel.SharedArray`).

    Raises:
        ShoalError: ``array`` is empty or has no rows (0-dim).
    """
    return SharedArray(array)
