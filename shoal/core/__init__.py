"""shoal's core: what every front end (training, parallel functions, the parameter server)
stands on, and the only place each of these exists.

- :mod:`~shoal.core.env`: where this process sits (local spawn, torchrun, Slurm, MPI), its
  device and its threads;
- :mod:`~shoal.core.launchers`: each outside launcher's variables (torchrun, Accelerate, Ray
  Train, Lightning, Slurm, MPI), completed the way it means them or refused, into this
  process's place in the job (:mod:`~shoal.core.place`);
- :mod:`~shoal.core.processes`: starting and supervising local processes, SIGTERM as
  "stop at the next safe point";
- :mod:`~shoal.core.pool`: a controller's commands to a set of started workers and their
  answers (pipes to local workers, sealed sockets to workers started elsewhere);
- :mod:`~shoal.core.guard`: no process outlives the process that started it;
- :mod:`~shoal.core.limits`: how many processes and threads this machine can hold;
- :mod:`~shoal.core.failures`: each rank's failure report and the root cause among them;
- :mod:`~shoal.core.group`: the job's store and process group, with timeouts;
- :mod:`~shoal.core.watchdog`: a failing or hung rank ends the job within seconds;
- :mod:`~shoal.core.waits`: whom a waiting rank waits for; a rank that left or never comes;
- :mod:`~shoal.core.comm`: timed, byte-counted collectives (:class:`Comm`);
- :mod:`~shoal.core.connect`: a process connects to its job (:func:`init_comm`);
- :mod:`~shoal.core.ops`: the reduce-op table and even splits;
- :mod:`~shoal.core.flat`: flat packing of many tensors into one message;
- :mod:`~shoal.core.timeline`: the time categories and the spans booked into them;
- :mod:`~shoal.core.pairs`: the parameter server's transport: two-rank pairs and their
  failures (the servers themselves are :mod:`shoal.ps`); :mod:`~shoal.core.header`:
  their messages.
"""

#: Each name this package offers, and the module it lives in: imported on first use, so
#: that importing one light module of the core (``shoal.core.starting``, which the ``shoal``
#: command uses before anything imports torch) does not import torch.
_HOMES = {"Comm": "comm", "Environment": "env", "default_threads": "env",
          "detect_environment": "env", "pick_device": "env", "FlatParams": "flat",
          "Handle": "handle", "init_comm": "join", "ChannelError": "pairs", "Client": "pairs",
          "Header": "header", "Kind": "header", "PairChannel": "pairs", "Timeline": "timeline"}


def __getattr__(name: str) -> object:
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"shoal.core.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'shoal.core' has no attribute {name!r}")


__all__ = ["ChannelError", "Client", "Comm", "Environment", "FlatParams", "Handle", "Header",
           "Kind", "PairChannel", "Timeline", "default_threads", "detect_environment", "init_comm",
           "pick_device"]
