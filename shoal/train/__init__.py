"""Running a training job: start (or join) the workers and run the :class:`Trainer` in each.

The job itself is :mod:`shoal.train.job`; a rank's work :mod:`shoal.train.launch`; one
worker's loop :class:`~shoal.train.trainer.Trainer`. The names below are imported on first
use: a process that needs only a light module of the package (the command's own clean-up
of :mod:`~shoal.train.membership.jobfile`) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shoal.train.job import default_workers, job_device, resolve_auto_resume, train
    from shoal.train.trainer import Trainer
    from shoal.train.workload import preflight

#: Each name's module, which imports it on first use.
_MODULE = {"default_workers": "job", "job_device": "job", "resolve_auto_resume": "job",
           "train": "job", "Trainer": "trainer", "preflight": "workload"}


def __getattr__(name: str) -> Any:
    if name not in _MODULE:
        raise AttributeError(f"module 'shoal.train' has no attribute {name!r}")
    return getattr(importlib.import_module(f"shoal.train.{_MODULE[name]}"), name)


__all__ = ["Trainer", "default_workers", "job_device", "preflight", "resolve_auto_resume",
           "train"]
