"""The controller's side of a call (rank 0): check and sort the arguments, send the command,
run rank 0's share, collect every worker's status and let the reductions run only when all
agree. A worker's exception, or outputs whose shapes differ across workers, becomes an
exception in the caller, and nobody is left waiting."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch

from shoal.core.failures import first_line
from shoal.core.timeline import COMM
from shoal.errors import ShoalError, WorkerError
from shoal.parallel.arrays import SharedArray
from shoal.parallel.call import Call
from shoal.parallel.context import Meter, in_function, leave_function
from shoal.parallel.outputs import describe
from shoal.parallel.protocol import GO, OP_CALL, SKIP, RemoteTraceback
from shoal.parallel.session import ParallelSession, active
from shoal.parallel.spec import FunctionSpec
from shoal.parallel.watcher import Interrupted


def _to_tensor(value: Any, name: str, fname: str) -> torch.Tensor | SharedArray:
    if isinstance(value, (torch.Tensor, SharedArray)):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    raise ShoalError(f"{fname}: argument {name!r} must be a tensor, a NumPy array or shoal.shared, "
                     f"got {type(value).__name__}")


def _unreplicated(session: ParallelSession | None, value: Any) -> bool:
    if session is None or session.world_size == 1:
        return False
    return not (isinstance(value, torch.Tensor) and session.registry.knows(value))


def _batch_indices(f: FunctionSpec, batch: Any) -> torch.Tensor | None:
    if batch is None:
        return None
    if not f.scatter:
        raise ShoalError(f"{f.name}: batch= selects rows of scatter arguments, and it has none")
    idx = torch.as_tensor(np.asarray(batch) if not isinstance(batch, torch.Tensor) else batch)
    if idx.dtype == torch.bool or idx.is_floating_point():
        raise ShoalError(f"{f.name}: batch must hold integer row indices, got {idx.dtype}")
    return idx.reshape(-1).to(torch.int64).cpu()


def controller_call(f: FunctionSpec, args: tuple[Any, ...], kwargs: dict[str, Any], num_slices: int,
                    batch: Any) -> Any:
    """One call of ``f`` from the controller: on every rank of the open session, or serially."""
    if in_function():
        raise ShoalError(f"{f.name}: a parallel function cannot be called inside another one")
    session = active()  # raises while a broken session is current
    world_size = session.world_size if session is not None else 1
    device = session.device if session is not None else torch.device("cpu")
    try:
        bound = f.signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise ShoalError(f"{f.name}: {exc}") from None
    bound.apply_defaults()
    slices = int(num_slices)
    if slices < 1:
        raise ShoalError(f"{f.name}: num_slices must be at least 1, got {num_slices}")
    idx = _batch_indices(f, batch)
    roles, values, tensors, rows = _place_arguments(f, dict(bound.arguments), idx, session, device)
    if rows is None:
        if slices > 1:
            raise ShoalError(f"{f.name}: num_slices needs scatter arguments to slice")
        rows = world_size  # one share per rank, weighted equally
    elif rows < world_size * slices:
        raise ShoalError(f"{f.name}: {rows} rows cannot be split over {world_size} processes x {slices} "
                         "slices (each needs at least one row)")

    # A call without a session is booked nowhere (a meter of its own).
    meter = session.meter if session is not None else Meter()
    call = Call(f, roles, values, rows, slices, idx, 0, world_size, device, meter)
    if session is None or world_size == 1:
        result, exc = call.run(call.transfer_arguments(tensors))
        if exc is not None:
            raise exc
        result.signature()
        return result.value(None)
    return _parallel_call(session, f, call, tensors)


def _place_arguments(f: FunctionSpec, arguments: dict[str, Any], idx: torch.Tensor | None,
                     session: ParallelSession | None, device: torch.device
                     ) -> tuple[list[tuple[Any, ...]], dict[str, Any], dict[str, torch.Tensor], int | None]:
    """Each argument's role (scatter, broadcast, plain), the values sent in the command, the
    tensors moved by collectives, and the scatter arguments' common number of rows."""
    roles: list[tuple[Any, ...]] = []
    values: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    rows = None
    for name, value in arguments.items():
        if name in f.scatter:
            value = _to_tensor(value, name, f.name)
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                raise ShoalError(f"{f.name}: scatter argument {name!r} has no rows (0-dim tensor)")
            length = len(value)
            if idx is not None and len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= length):
                raise ShoalError(f"{f.name}: batch indices out of range for {name!r} with {length} rows")
            n = len(idx) if idx is not None else length
            if rows is not None and n != rows:
                raise ShoalError(f"{f.name}: scatter arguments have different numbers of rows "
                                 f"({rows} and {n} for {name!r})")
            rows = n
            if isinstance(value, SharedArray):
                roles.append((name, "scatter_data"))
                values[name] = value
            else:
                if idx is not None:
                    value = value.index_select(0, idx.to(value.device))
                value = value.to(device).contiguous()
                roles.append((name, "scatter", value.dtype, tuple(value.shape[1:])))
                tensors[name] = value
        elif isinstance(value, (torch.Tensor, np.ndarray)) and (
                name in f.broadcast or _unreplicated(session, value)):
            # Tensors not listed anywhere are broadcast too: dist.broadcast moves them, where
            # pickling would copy them into every command (parameters of replicated modules
            # stay references to each worker's replica).
            value = _to_tensor(value, name, f.name).to(device).contiguous()  # type: ignore[union-attr]
            roles.append((name, "broadcast", value.dtype, tuple(value.shape)))
            tensors[name] = value
        elif name in f.broadcast and isinstance(value, SharedArray):
            roles.append((name, "broadcast_data"))
            values[name] = value
        else:
            roles.append((name, "plain"))
            values[name] = value
    return roles, values, tensors, rows


def _parallel_call(session: ParallelSession, f: FunctionSpec, call: Call,
                   tensors: dict[str, torch.Tensor]) -> Any:
    message, fresh = _command(session, f, call)
    call.watch = session.watcher.check_alive
    session.begin_call()  # from here a worker's death interrupts rank 0's share at once
    try:
        with session.meter.leaf(COMM, "command"):
            session.send_all(message)
            if fresh:
                _check_loaded(session, f)
        result, exc = call.run(call.transfer_arguments(tensors))
        mine: tuple[Any, ...] = (exc is None, None, [], None)
        if exc is None:
            try:
                mine = (True, result.signature(), result.gather_dims(), None)
            except Exception as e:
                exc = e
                mine = (False, None, [], None)
        with session.meter.leaf(COMM, "status"):
            statuses = [mine] + [pickle.loads(m) for m in session.recv_all(session.timeout, "answer")]
            ok = all(s[0] for s in statuses) and all(s[1] == statuses[0][1] for s in statuses)
            if not ok:
                session.send_all(SKIP)
            else:
                dims = [s[2] for s in statuses]
                max_dims = [max(col) for col in zip(*dims, strict=False)]
                session.send_all(GO + pickle.dumps(max_dims))
        if ok:
            result.communicate(0, call.world_size, max_dims, session.meter)
    except BaseException as exc2:
        # A dead worker, Ctrl-C or a broken transfer: the workers cannot be trusted to be in
        # step any more. (An interruption may have come before run() restored the state.)
        leave_function()
        if isinstance(exc2, Interrupted):
            raise session.failure() from None
        if session.closed or isinstance(exc2, WorkerError):
            raise
        if isinstance(exc2, (KeyboardInterrupt, SystemExit)):
            # Leave the call first: the workers this abort stops are not deaths for the
            # watcher to act on, so no wake-up signal lands on this thread during teardown.
            session.watcher.end_call()
            session.abort((None, f"interrupted by {type(exc2).__name__}"))
            raise
        raise session.failure(f"{type(exc2).__name__}: {first_line(exc2)}") from exc2
    finally:
        session.watcher.end_call()
    if exc is not None:
        raise exc
    for rank, s in enumerate(statuses):
        if not s[0] and s[3] is not None:
            etype, emsg, tb, user = s[3]
            raise WorkerError(rank, f"{etype}: {emsg} (in parallel function {f.name})",
                              tb, user) from RemoteTraceback(tb)
    if not ok:
        lines = "; ".join(f"rank {r}: {describe(s[1])}" for r, s in enumerate(statuses))
        raise ShoalError(f"{f.name}: outputs differ in shape or type across workers "
                         f"(nothing was reduced): {lines}")
    return result.value(dims)


def _check_loaded(session: ParallelSession, f: FunctionSpec) -> None:
    """Every worker's word that the new function, arguments and objects loaded."""
    failed = [(r, pickle.loads(m)) for r, m in enumerate(session.recv_all(session.timeout, "load"), 1)]
    failed = [(r, e) for r, e in failed if e is not None]
    session.send_all(SKIP if failed else GO)
    if failed:
        session.defined.discard(f.id)
        session.last_payload.pop(f.id, None)
        rank, (etype, emsg, tb, user) = failed[0]
        hint = (" (a function must be importable on the workers by its module name, or live in "
                "__main__ or a closure to be sent by value)" if etype == "ModuleNotFoundError" else "")
        raise WorkerError(rank, f"could not load {f.name} or its arguments: {etype}: {emsg}{hint}",
                          tb, user) from RemoteTraceback(tb)


def _command(session: ParallelSession, f: FunctionSpec, call: Call) -> tuple[bytes, bool]:
    """The pickled command for one call (plain arguments only when they changed)."""
    session.check_open()
    registry = session.registry
    try:
        fn_bytes = None if f.id in session.defined else registry.dumps(f)
        payload = registry.dumps((call.roles, call.values))
    except Exception as exc:
        raise ShoalError(f"{f.name}: cannot send the function or its arguments to the workers "
                         f"({type(exc).__name__}: {exc})") from exc
    payload_out = None if session.last_payload.get(f.id) == payload else payload
    defs = registry.take_pending()
    batch = call.batch.numpy().tobytes() if call.batch is not None else None
    msg = pickle.dumps((OP_CALL, f.id, call.rows, call.slices, batch, defs, fn_bytes, payload_out),
                       protocol=pickle.HIGHEST_PROTOCOL)
    session.defined.add(f.id)
    session.last_payload[f.id] = payload
    return msg, bool(defs) or fn_bytes is not None or payload_out is not None
