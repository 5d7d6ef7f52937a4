"""Everything that crosses between processes: process groups, timed collectives, flat buffers.

Strategies talk to other ranks only through a :class:`Comm`, which times and counts every
collective so that each run can say how much it communicated and how long it waited.
"""

from shoal.comm.collectives import Comm, Handle, init_comm
from shoal.comm.flat import FlatParams

__all__ = ["Comm", "Handle", "init_comm", "FlatParams"]
