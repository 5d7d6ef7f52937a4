"""One call of a parallel function on one rank, the same on the controller (rank 0) and on
every worker: receive (or send) the tensor arguments, run the function on this rank's share
slice by slice, and take part in the reductions. Each phase is booked on the rank's
:class:`~shoal.parallel.context.Meter`: the arguments as data, the body as compute, the
status round and the reductions as communication."""

from __future__ import annotations

import inspect
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shoal.core.ops import split_sizes
from shoal.core.timeline import COMM, COMPUTE, DATA
from shoal.parallel.arrays import SharedArray
from shoal.parallel.context import Meter, enter_function, restore
from shoal.parallel.outputs import Result
from shoal.parallel.protocol import GO, error_info
from shoal.parallel.spec import FunctionSpec


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Call:
    """What a rank needs to run its share: arguments, rows, slices, and its books."""

    def __init__(self, f: FunctionSpec, roles: list[tuple[Any, ...]], values: dict[str, Any], rows: int,
                 slices: int, batch: torch.Tensor | None, rank: int, world_size: int,
                 device: torch.device, meter: Meter) -> None:
        self.f, self.roles, self.values = f, roles, values
        self.rows, self.slices, self.batch = rows, slices, batch
        self.rank, self.world_size, self.device = rank, world_size, device
        self.meter = meter
        self.counts = split_sizes(rows, world_size)
        self.start = sum(self.counts[:rank])
        self.watch: Callable[[], None] | None = None  # rank 0: raises once a worker died

    def transfer_arguments(self, tensors: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        """Receive (or, on rank 0, send) the tensor arguments; in the order of ``roles``."""
        with self.meter.leaf(DATA, "arguments"):
            return self._transfer(tensors)

    def _transfer(self, tensors: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        local: dict[str, Any] = {}
        n = self.counts[self.rank]
        for role in self.roles:
            name, kind = role[0], role[1]
            if kind == "scatter":
                if self.world_size == 1:
                    local[name] = tensors[name]  # type: ignore[index]
                    continue
                rows = max(self.counts)
                if self.rank == 0:
                    full = tensors[name]  # type: ignore[index]
                    chunks, offset = [], 0
                    for c in self.counts:
                        chunk = full[offset:offset + c]
                        offset += c
                        if c < rows:
                            chunk = torch.cat([chunk, chunk.new_zeros((rows - c, *chunk.shape[1:]))])
                        chunks.append(chunk.contiguous())
                    recv = torch.empty_like(chunks[0])
                    self.meter.count(sum(_nbytes(c) for c in chunks[1:]))
                    dist.scatter(recv, chunks, src=0)
                else:
                    dtype, trail = role[2], role[3]
                    recv = torch.empty((rows, *trail), dtype=dtype, device=self.device)
                    dist.scatter(recv, None, src=0)
                local[name] = recv[:n]
            elif kind == "broadcast":
                if self.rank == 0:
                    t = tensors[name]  # type: ignore[index]
                else:
                    t = torch.empty(role[3], dtype=role[2], device=self.device)
                if self.world_size > 1:
                    if self.rank == 0:
                        self.meter.count(_nbytes(t))
                    dist.broadcast(t, src=0)
                local[name] = t
            elif kind == "scatter_data" or kind == "broadcast_data":
                local[name] = self.values[name].local(self.device)
            else:
                value = self.values[name]
                local[name] = value.local(self.device) if isinstance(value, SharedArray) else value
        return local

    def run(self, local: dict[str, Any]) -> tuple[Result, BaseException | None]:
        """Run ``fn`` on this rank's share, slice by slice; catch what it raises."""
        result = Result(self.f)
        n = self.counts[self.rank]
        kinds = {role[0]: role[1] for role in self.roles}
        batch = self.batch
        if batch is not None and batch.device != self.device:
            batch = batch.to(self.device)
        with self.meter.span(COMPUTE, self.f.name):
            previous = enter_function(self.meter)
            try:
                offset = 0
                for size in split_sizes(n, self.slices):
                    if self.watch is not None:
                        self.watch()
                    args = dict(local)
                    for name, kind in kinds.items():
                        if kind == "scatter":
                            args[name] = local[name][offset:offset + size]
                        elif kind == "scatter_data":
                            lo = self.start + offset
                            if batch is not None:
                                args[name] = local[name].index_select(0, batch[lo:lo + size])
                            else:
                                args[name] = local[name][lo:lo + size]
                    bound = inspect.BoundArguments(self.f.signature, args)  # type: ignore[arg-type]
                    out = self.f.fn(*bound.args, **bound.kwargs)
                    result.add(out, size / self.rows)  # avg: this slice's share of all rows
                    offset += size
                return result, None
            except Exception as exc:
                return result, exc
            finally:
                restore(previous)


def worker_call(call: Call, conn: Any) -> None:
    """A worker's part of one call: arguments, compute, status, reductions."""
    local = call.transfer_arguments(None)
    result, exc = call.run(local)
    status: tuple[Any, ...]
    if exc is None:
        try:
            status = (True, result.signature(), result.gather_dims(), None)
        except Exception as e:  # e.g. an output that is not a tensor
            exc = e
    if exc is not None:
        status = (False, None, [], error_info(exc))
    with call.meter.leaf(COMM, "status"):
        conn.send_bytes(pickle.dumps(status))
        verdict = conn.recv_bytes()
    if verdict[:1] == GO:
        result.communicate(call.rank, call.world_size, pickle.loads(verdict[1:]), call.meter)
