"""Running a training job: start (or join) the workers and run the :class:`Trainer` in each.

The job itself is :mod:`shoal.train.job`; a rank's work :mod:`shoal.train.launch`; one
worker's loop :class:`~shoal.train.trainer.Trainer`.
"""

from shoal.train.job import default_workers, job_device, resolve_auto_resume, train
from shoal.train.trainer import Trainer
from shoal.train.workload import preflight

__all__ = ["Trainer", "default_workers", "job_device", "preflight", "resolve_auto_resume",
           "train"]
