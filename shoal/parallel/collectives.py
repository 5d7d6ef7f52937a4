"""Collectives on tensors, and on the parameters and buffers of modules.

Inside a parallel function they act like ``torch.distributed`` on every rank at once, on
whatever tensors the function holds. From the controller, outside any function, they act
on each worker's replica of a module that has reached the workers (a module passed to a
parallel function, or given to :func:`shoal.replicate`): ``shoal.all_reduce(model,
op="avg")`` averages the replicas, ``shoal.broadcast(model)`` copies rank 0's values into
all of them. Before moving data every rank checks that all ranks hold the same number of
tensors with the same dtypes and shapes (dimension 0 may differ for ``gather`` and
``all_gather``); if not, every rank raises :class:`~shoal.ShoalError` naming the ranks and
shapes, and no rank is left waiting (:mod:`shoal.parallel.agreement`). CPU tensors go
through the host's shared memory where the session has that path (sums in rank order,
copies of any dtype: :mod:`shoal.parallel.hostsums`), the rest through Gloo.

A module stands for its parameters and floating-point buffers. ``avg`` is the plain mean
over ranks. ``gather``, ``all_gather`` and ``scatter`` concatenate or split along dimension
0 in rank order (the same split as a function's scatter arguments).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shoal.core.flat import by_dtype, flatten, unflatten_into
from shoal.core.ops import reduce_op, split_sizes
from shoal.core.timeline import COMM
from shoal.errors import ShoalError
from shoal.parallel.agreement import agree, agree_in_host, rows_in_host
from shoal.parallel.arrays import SharedArray
from shoal.parallel.context import booked, in_function
from shoal.parallel.functions import Function
from shoal.parallel.hostsums import copier, host_path
from shoal.parallel.session import active

Target = torch.Tensor | nn.Module | Iterable[Any]


def _tensors(target: Any, name: str) -> tuple[list[torch.Tensor], bool]:
    if isinstance(target, torch.Tensor):
        return [target], True
    if isinstance(target, SharedArray):
        raise ShoalError(f"shoal.{name}: shoal.shared arrays are read-only inputs, not collective targets")
    if isinstance(target, nn.Module):
        return [*target.parameters(), *(b for b in target.buffers() if b.is_floating_point())], False
    try:
        items = list(target)
    except TypeError:
        raise ShoalError(f"shoal.{name} takes a tensor, a module or an iterable of them, "
                         f"got {type(target).__name__}") from None
    out: list[torch.Tensor] = []
    for item in items:
        out.extend(_tensors(item, name)[0] if isinstance(item, (torch.Tensor, nn.Module)) else
                   _bad(item, name))
    return out, False


def _bad(item: Any, name: str) -> list[torch.Tensor]:
    raise ShoalError(f"shoal.{name}: expected tensors or modules, got a {type(item).__name__}")


def _rank_and_size() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agree(name: str, tensors: list[torch.Tensor], world_size: int, extra: Any) -> None:
    """Every rank makes the same call on alike tensors (else one line on every rank): through
    the host's memory where the session has that path, else Gloo."""
    host = host_path()
    if host is not None:
        agree_in_host(host, name, tensors, world_size, extra)
    else:
        agree(name, tensors, world_size, False, extra)


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _in_place(tensors: list[torch.Tensor], op: Any) -> None:
    """Run ``op(flat)`` on one flat buffer per dtype and copy the result back."""
    for group in by_dtype(tensors):
        if len(group) == 1 and group[0].is_contiguous():
            with torch.no_grad():
                op(group[0])
            continue
        flat = flatten(group)
        op(flat)
        unflatten_into(flat, group)


def _op(op: str, name: str, tensors: list[torch.Tensor]) -> Any:
    red = reduce_op(op, f"shoal.{name}: ")
    if op == "avg" and any(not (t.is_floating_point() or t.is_complex()) for t in tensors):
        raise ShoalError(f"shoal.{name}: op 'avg' needs floating-point tensors")
    return red


def _controller(name: str, target: Any, **options: Any) -> Any:
    """Run collective ``name`` on every rank of the open session, on the replicas of ``target``."""
    session = active()
    assert session is not None
    if not isinstance(target, (torch.Tensor, nn.Module)):
        target = [t for t in target] if not isinstance(target, SharedArray) else target
    tensors, _ = _tensors(target, name)
    modules = [target] if isinstance(target, nn.Module) else \
        [t for t in (target if isinstance(target, list) else []) if isinstance(t, nn.Module)]
    for m in modules:
        session.registry.register(m)
    lost = [t for t in tensors if not session.registry.is_replicated_tensor(t)]
    if lost:
        raise ShoalError(
            f"shoal.{name} from the controller works on modules the workers hold (a module passed "
            f"to a parallel function, or shoal.replicate(module)); {len(lost)} of the tensors given "
            "are not parameters or buffers of such a module. Inside a parallel function any tensor works.")
    return _RUN(name, target, options)


def _run_collective(name: str, target: Any, options: dict[str, Any]) -> Any:
    return _SPMD[name](target, **options)


_RUN = Function(_run_collective, reduce=None, name="shoal collective")


def _dispatch(name: str, target: Any, **options: Any) -> Any:
    if not in_function():
        session = active()  # raises while a broken session is current
        if session is not None and session.world_size > 1:
            return _controller(name, target, **options)
    return _SPMD[name](target, **options)


# -- the collectives on one rank (inside a function, or in a job of one) ---------------------
# Each is booked as communication on the running function's meter, with the bytes this rank
# sends: at the source of a broadcast or scatter, at every rank but the destination of a
# reduce or gather, everywhere for an all-reduce or all-gather.
def _broadcast(target: Target, src: int = 0) -> Any:
    tensors, single = _tensors(target, "broadcast")
    rank, world_size = _rank_and_size()
    if world_size > 1:
        local = copier(tensors)
        with booked(COMM, "broadcast", _nbytes(tensors) if rank == src else 0):
            _agree("broadcast", tensors, world_size, src)
            _in_place(tensors, lambda flat: dist.broadcast(flat, src=src) if local is None
                      else local.broadcast(flat, src))
    return tensors[0] if single else target


def _all_reduce(target: Target, op: str = "sum") -> Any:
    tensors, single = _tensors(target, "all_reduce")
    red = _op(op, "all_reduce", tensors)
    rank, world_size = _rank_and_size()
    if world_size > 1:
        host = host_path()

        def run(flat: torch.Tensor) -> None:
            if host is not None and host.takes(flat, op):  # through the host's memory
                host.all_reduce(flat, op)
                return
            dist.all_reduce(flat, op=red)
            if op == "avg":
                flat.div_(world_size)
        with booked(COMM, "all_reduce", _nbytes(tensors)):
            _agree("all_reduce", tensors, world_size, op)
            _in_place(tensors, run)
    return tensors[0] if single else target


def _reduce(target: Target, op: str = "sum", dst: int = 0) -> Any:
    tensors, single = _tensors(target, "reduce")
    red = _op(op, "reduce", tensors)
    rank, world_size = _rank_and_size()
    if world_size > 1:
        host = host_path()
        with booked(COMM, "reduce", _nbytes(tensors) if rank != dst else 0):
            _agree("reduce", tensors, world_size, (op, dst))
            for group in by_dtype(tensors):
                flat = flatten(group)  # a copy: the other ranks keep their tensors
                if host is not None and host.takes(flat, op):  # summed on every rank
                    host.all_reduce(flat, op)
                else:
                    dist.reduce(flat, dst=dst, op=red)
                    if op == "avg":
                        flat.div_(world_size)
                if rank == dst:
                    unflatten_into(flat, group)
    return tensors[0] if single else target


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    t = t.detach().reshape(1) if t.dim() == 0 else t.detach()
    if t.shape[0] < rows:
        t = torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])
    return t.contiguous()


def _alone(tensors: list[torch.Tensor], single: bool) -> Any:
    """What a gather returns in a job of one: copies, 0-dim tensors as one row."""
    out = [t.detach().reshape(1) if t.dim() == 0 else t.detach().clone() for t in tensors]
    return out[0] if single else out


def _gather(target: Target, dst: int = 0) -> Any:
    return _gathered("gather", target, dst)


def _all_gather(target: Target) -> Any:
    return _gathered("all_gather", target, None)


def _gathered(name: str, target: Target, dst: int | None) -> Any:
    """Every rank's tensors concatenated along dim 0 in rank order: on rank ``dst`` (a
    gather; ``None`` on the others), or on every rank (``dst`` ``None``: an all-gather)."""
    tensors, single = _tensors(target, name)
    rank, world_size = _rank_and_size()
    if world_size == 1:
        return _alone(tensors, single)
    receives = dst is None or rank == dst
    local, host, out = copier(tensors), host_path(), []
    with booked(COMM, name, _nbytes(tensors) if dst is None or rank != dst else 0):
        extra = () if dst is None else (dst,)
        dims = agree(name, tensors, world_size, True, *extra) if local is None or host is None \
            else rows_in_host(host, local, name, tensors, world_size, *extra)
        assert dims is not None or not tensors
        for i, t in enumerate(tensors):
            rows = max(d[i] for d in dims)  # type: ignore[union-attr]
            mine = _padded(t, rows)
            bufs = [torch.empty_like(mine) for _ in range(world_size)] if receives else None
            if local is not None:
                local.all_gather(mine, bufs)
            elif dst is None:
                dist.all_gather(bufs, mine)
            else:
                dist.gather(mine, bufs, dst=dst)
            if bufs is not None:
                out.append(torch.cat([b[:d[i]] for b, d in zip(bufs, dims, strict=False)]))  # type: ignore[arg-type]
    if not receives:
        return None
    return out[0] if single else out


def _scatter(target: Target, src: int = 0) -> Any:
    tensors, single = _tensors(target, "scatter")
    if any(t.dim() == 0 for t in tensors):
        raise ShoalError("shoal.scatter: 0-dim tensors have no rows to split")
    rank, world_size = _rank_and_size()
    if world_size == 1:
        out = [t.detach().clone() for t in tensors]
        return out[0] if single else out
    out = []
    # The source sends every share but its own, each padded to the largest.
    sent = sum((world_size - 1) * max(split_sizes(t.shape[0], world_size)) * math.prod(t.shape[1:])
               * t.element_size() for t in tensors) if rank == src else 0
    local = copier(tensors)
    with booked(COMM, "scatter", sent):
        _agree("scatter", tensors, world_size, src)
        for t in tensors:
            counts = split_sizes(t.shape[0], world_size)
            rows = max(counts)
            chunks = None
            if rank == src:
                chunks = [_padded(c, rows) for c in torch.split(t.detach(), counts)]
            recv = torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
            if local is not None:
                local.scatter(chunks, recv, src)
            else:
                dist.scatter(recv, chunks, src=src)
            out.append(recv[:counts[rank]])
    return out[0] if single else out


_SPMD = {"broadcast": _broadcast, "all_reduce": _all_reduce, "reduce": _reduce, "gather": _gather,
         "all_gather": _all_gather, "scatter": _scatter}


# -- public ----------------------------------------------------------------------------------
def broadcast(target: Target, src: int = 0) -> Any:
    """Overwrite ``target`` on every rank with rank ``src``'s values, in place.

    Args:
        target: A tensor, a module (its parameters and floating-point buffers) or a list of them.
        src: The rank whose values every rank gets.

    Returns:
        ``target`` (the tensor itself, for a single tensor).

    Raises:
        ShoalError: Another kind of ``target``, ranks holding different tensors, or (from
            the controller) tensors of no module the workers hold.
    """
    return _dispatch("broadcast", target, src=src)


def all_reduce(target: Target, op: str = "sum") -> Any:
    """Reduce ``target`` across ranks, in place on every rank.

    From the controller, ``shoal.all_reduce(model, op="avg")`` averages the workers'
    replicas of ``model``.

    Args:
        target: A tensor, a module (its parameters and floating-point buffers) or a list of them.
        op: ``"avg"`` (the plain mean over ranks), ``"sum"``, ``"min"``, ``"max"`` or
            ``"prod"``.

    Returns:
        ``target`` (the tensor itself, for a single tensor).

    Raises:
        ShoalError: Another kind of ``target``, ranks holding different tensors, an unknown
            ``op``, or (from the controller) tensors of no module the workers hold.
    """
    return _dispatch("all_reduce", target, op=op)


def reduce(target: Target, op: str = "sum", dst: int = 0) -> Any:
    """Reduce ``target`` into rank ``dst``'s tensors, in place; other ranks keep theirs.

    Args:
        target: A tensor, a module (its parameters and floating-point buffers) or a list of them.
        op: ``"avg"``, ``"sum"``, ``"min"``, ``"max"`` or ``"prod"``.
        dst: The rank that receives the result.

    Returns:
        ``target`` (the tensor itself, for a single tensor).

    Raises:
        ShoalError: Another kind of ``target``, ranks holding different tensors, an unknown
            ``op``, or (from the controller) tensors of no module the workers hold.
    """
    return _dispatch("reduce", target, op=op, dst=dst)


def gather(target: Target, dst: int = 0) -> Any:
    """Concatenate every rank's tensors along dimension 0, in rank order, on rank ``dst``.

    Dimension 0 may differ between ranks; the other dimensions may not.

    Args:
        target: A tensor, a module (its parameters and floating-point buffers) or a list of them.
        dst: The rank that receives the result.

    Returns:
        On ``dst``, a new tensor (a list of them for several); ``None`` on other ranks.

    Raises:
        ShoalError: Another kind of ``target``, ranks holding different tensors, or (from
            the controller) tensors of no module the workers hold.
    """
    return _dispatch("gather", target, dst=dst)


def all_gather(target: Target) -> Any:
    """Concatenate every rank's tensors along dimension 0, in rank order, on every rank.

    Like `shoal.gather`, with the result everywhere.

    Args:
        target: A tensor, a module (its parameters and floating-point buffers) or a list of them.

    Returns:
        A new tensor (a list of them for several).

    Raises:
        ShoalError: Another kind of ``target``, ranks holding different tensors, or (from
            the controller) tensors of no module the workers hold.
    """
    return _dispatch("all_gather", target)


def scatter(target: Target, src: int = 0) -> Any:
    """Split rank ``src``'s tensors along dimension 0; every rank gets its share.

    Shares go in rank order, the first ``n % world_size`` one row larger. All ranks pass
    tensors of the same shape; only ``src``'s values are read.

    Args:
        target: A tensor, a module (its parameters and floating-point buffers) or a list of them.
        src: The rank whose tensors are split.

    Returns:
        This rank's share, as a new tensor (a list of them for several).

    Raises:
        ShoalError: Another kind of ``target``, ranks holding different tensors, a 0-dim
            tensor (no rows to split), or (from the controller) tensors of no module the
            workers hold.
    """
    return _dispatch("scatter", target, src=src)
