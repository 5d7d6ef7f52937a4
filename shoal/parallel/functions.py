"""Parallel functions: ``shoal.function(fn, scatter=..., broadcast=..., reduce=...)``.

One call runs in three steps, the same on the controller (rank 0) and on every worker:

1. *Arguments.* The controller sends one small command per worker (function id, row count,
   slices, the ``batch`` indices, and the pickled plain arguments only when they changed
   since the last call). Scatter tensors go out with one ``dist.scatter`` each, broadcast
   tensors with one ``dist.broadcast``; :class:`~shoal.parallel.arrays.SharedArray` arguments are
   already on every worker and cost nothing.
2. *Compute.* Each rank runs ``fn`` on its share, in ``num_slices`` pieces, and accumulates
   the outputs (``avg`` weighted by rows, so uneven shares and slices give the serial answer).
3. *Combine.* Every worker reports ok/error and the shapes of its outputs; only when all
   agree does the controller let the reductions run (one ``dist.reduce`` per mode and dtype,
   one ``dist.gather`` per gathered output). A worker's exception, or outputs whose shapes
   differ across workers, becomes an exception in the caller, and nobody is left waiting.
"""

from __future__ import annotations

import inspect
import itertools
import pickle
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from shoal.core.processes import first_line
from shoal.errors import ShoalError, WorkerError
from shoal.parallel import session as _session
from shoal.parallel.arrays import SharedArray
from shoal.parallel.session import GO, OP_CALL, SKIP, Interrupted, RemoteTraceback, active, in_function

MODES = ("avg", "sum", "prod", "min", "max", "gather", None)
_REDUCE_OPS = {"avg": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
               "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
_IDS = itertools.count(1)


def split_sizes(n: int, parts: int) -> list[int]:
    """``n`` rows in ``parts`` shares, the first ``n % parts`` one row larger (rank order)."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def _check_mode(mode: Any) -> Any:
    if mode not in MODES:
        raise ShoalError(f"unknown reduce mode {mode!r}; choose from avg, sum, prod, min, max, "
                         "gather or None")
    return mode


class Function:
    """A function whose calls run on every worker; see :func:`function`."""

    def __init__(self, fn: Callable[..., Any], scatter: Sequence[str] = (),
                 broadcast: Sequence[str] = (),
                 reduce: str | None | Sequence[str | None] | Mapping[Any, str | None] = "avg",
                 name: str | None = None) -> None:
        if not callable(fn):
            raise ShoalError(f"shoal.function needs a callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", None) or repr(fn)
        self.id = next(_IDS)
        self.signature = inspect.signature(fn)
        self.scatter = (scatter,) if isinstance(scatter, str) else tuple(scatter)
        self.broadcast = (broadcast,) if isinstance(broadcast, str) else tuple(broadcast)
        params = self.signature.parameters
        for arg in (*self.scatter, *self.broadcast):
            p = params.get(arg)
            if p is None or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ShoalError(f"shoal.function({self.name}): {arg!r} is not a named parameter "
                                 f"of {self.name}{self.signature}")
        both = set(self.scatter) & set(self.broadcast)
        if both:
            raise ShoalError(f"shoal.function({self.name}): {sorted(both)} both scattered and broadcast")
        for option in ("batch", "num_slices"):
            if option in params:
                raise ShoalError(f"shoal.function({self.name}): a parameter named {option!r} clashes "
                                 "with the call option of that name; rename it")
        self.default_mode: Any = "avg"
        self.modes: dict[Any, Any] = {}
        if reduce is None or isinstance(reduce, str):
            self.default_mode = _check_mode(reduce)
        elif isinstance(reduce, Mapping):
            self.modes = {k: _check_mode(m) for k, m in reduce.items()}
        else:
            self.modes = {i: _check_mode(m) for i, m in enumerate(reduce)}

    def mode(self, key: Any) -> Any:
        return self.modes.get(key, self.default_mode)

    def __call__(self, *args: Any, num_slices: int = 1, batch: Any = None, **kwargs: Any) -> Any:
        return _controller_call(self, args, kwargs, num_slices, batch)

    def __repr__(self) -> str:
        return (f"shoal.function({self.name}, scatter={list(self.scatter)}, "
                f"broadcast={list(self.broadcast)})")


def function(fn: Callable[..., Any] | None = None, *, scatter: Sequence[str] = (),
             broadcast: Sequence[str] = (),
             reduce: str | None | Sequence[str | None] | Mapping[Any, str | None] = "avg",
             name: str | None = None) -> Any:
    """Make ``fn`` a parallel function (also usable as ``@shoal.function(scatter=[...])``).

    Calling it splits the ``scatter`` arguments along dimension 0 across the session's
    processes (tensors, NumPy arrays or :func:`shoal.shared` arrays), sends ``broadcast``
    tensors whole, passes other arguments as they are (modules and optimizers by reference
    to each worker's replica), runs ``fn`` everywhere and combines its outputs. ``reduce`` is
    one mode for every output, a sequence (one per element of a returned tuple) or a dict
    (by tuple index or dict key; the rest ``avg``). Modes: ``avg`` (weighted by rows),
    ``sum``, ``prod``, ``min``, ``max``, ``gather`` (concatenated in rank order along
    dimension 0) and ``None`` (rank 0's value). Outputs may be tensors, numbers, or lists,
    tuples and dicts of them. Call options: ``num_slices=k`` runs each share in ``k`` pieces
    and accumulates before the one reduction; ``batch=indices`` first selects those rows of
    every scatter argument. Without a session (no :func:`shoal.fork`) the call runs serially.
    """
    if fn is None:
        return lambda f: Function(f, scatter, broadcast, reduce, name)
    return Function(fn, scatter, broadcast, reduce, name)


# -- outputs ---------------------------------------------------------------------------------
def _as_tensor(leaf: Any, where: str) -> tuple[torch.Tensor, bool]:
    if isinstance(leaf, torch.Tensor):
        return leaf.detach(), False
    if isinstance(leaf, (bool, int, float, np.number, np.bool_)):
        value = leaf.item() if isinstance(leaf, (np.number, np.bool_)) else leaf
        dtype = torch.float64 if isinstance(value, float) else torch.int64
        return torch.tensor(value, dtype=dtype), True
    if isinstance(leaf, np.ndarray):
        return torch.from_numpy(leaf), False
    raise ShoalError(f"{where} is a {type(leaf).__name__}; reducible outputs are tensors, numbers "
                     "or lists/tuples/dicts of them (use reduce None to return anything)")


class _Output:
    """One top-level output of one rank, accumulated over its slices."""

    def __init__(self, key: Any, mode: Any) -> None:
        self.key, self.mode = key, mode
        self.value: Any = None  # mode None: the last slice's value
        self.spec: Any = None
        self.leaves: list[Any] = []
        self.numbers: list[bool] = []

    def add(self, value: Any, weight: float, fname: str) -> None:
        if self.mode is None:
            self.value = value
            return
        leaves, spec = tree_flatten(value)
        where = f"output {self.key!r} of {fname}"
        pairs = [_as_tensor(leaf, where) for leaf in leaves]
        if self.spec is None:
            self.spec, self.numbers = spec, [n for _, n in pairs]
            self.leaves = [self._first(t, weight) for t, _ in pairs]
            return
        if spec != self.spec or len(pairs) != len(self.leaves):
            raise ShoalError(f"{where} changes structure between slices")
        for i, (t, _) in enumerate(pairs):
            self.leaves[i] = self._combine(i, t, weight, where)

    def _first(self, t: torch.Tensor, weight: float) -> Any:
        if self.mode == "avg":
            return (t if t.is_floating_point() or t.is_complex() else t.double()) * weight
        if self.mode == "gather":
            return [t.reshape(1) if t.dim() == 0 else t]
        return t.clone()

    def _combine(self, i: int, t: torch.Tensor, weight: float, where: str) -> Any:
        acc = self.leaves[i]
        if self.mode == "gather":
            t = t.reshape(1) if t.dim() == 0 else t
            if t.shape[1:] != acc[0].shape[1:] or t.dtype != acc[0].dtype:
                raise ShoalError(f"{where}: slices return {_fmt(acc[0])} and {_fmt(t)}")
            acc.append(t)
            return acc
        if t.shape != acc.shape:
            raise ShoalError(f"{where}: slices return shapes {list(acc.shape)} and {list(t.shape)}")
        # The accumulator is ours (made by _first): update it in place.
        if self.mode == "avg":
            return acc.add_(t, alpha=weight)
        if self.mode == "sum":
            return acc.add_(t)
        if self.mode == "prod":
            return acc.mul_(t)
        return torch.minimum(acc, t, out=acc) if self.mode == "min" else torch.maximum(acc, t, out=acc)

    def finish_local(self) -> None:
        if self.mode == "gather" and self.spec is not None:
            self.leaves = [torch.cat(parts) if len(parts) > 1 else parts[0] for parts in self.leaves]

    def signature(self) -> tuple[Any, ...]:
        shapes = tuple((str(t.dtype), tuple(t.shape[1:]) if self.mode == "gather" else tuple(t.shape))
                       for t in self.leaves)
        return (self.key, self.mode, str(self.spec), shapes)


def _fmt(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def _describe(sig: Any) -> str:
    if sig is None:
        return "(failed)"
    _, outputs = sig
    parts = []
    for key, mode, _, shapes in outputs:
        dims = ", ".join(f"{d.replace('torch.', '')}[{'*, ' if mode == 'gather' else ''}"
                         f"{', '.join(map(str, s))}]".replace(", ]", "]") for d, s in shapes)
        parts.append(f"output {key!r} ({mode}): {dims}")
    return "; ".join(parts) or "no outputs"


class _Result:
    """One rank's outputs of one call."""

    def __init__(self, f: Function) -> None:
        self.f = f
        self.kind: Any = None
        self.outputs: list[_Output] = []

    def add(self, out: Any, weight: float) -> None:
        if isinstance(out, tuple):
            kind: Any = type(out)
            items = list(enumerate(out))
        elif isinstance(out, dict):
            kind, items = dict, list(out.items())
        else:
            kind, items = "single", [(0, out)]
        if self.kind is None:
            self.kind = kind
            self.outputs = [_Output(k, self.f.mode(k)) for k, _ in items]
        elif kind != self.kind or [k for k, _ in items] != [o.key for o in self.outputs]:
            raise ShoalError(f"{self.f.name} returns different structures in different slices")
        for o, (_, value) in zip(self.outputs, items, strict=False):
            o.add(value, weight, self.f.name)

    def reduced(self) -> list[_Output]:
        return [o for o in self.outputs if o.mode is not None]

    def signature(self) -> Any:
        for o in self.outputs:
            o.finish_local()
        return (str(self.kind), tuple(o.signature() for o in self.reduced()))

    def gather_dims(self) -> list[int]:
        return [t.shape[0] for o in self.reduced() if o.mode == "gather" for t in o.leaves]

    def communicate(self, rank: int, world: int, max_dims: list[int]) -> None:
        """Reduce every output to rank 0 (one collective per mode and dtype, or per gather)."""
        groups: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
        gathered = []
        for o in self.reduced():
            if o.mode == "gather":
                gathered.extend(o.leaves)
            else:
                for t in o.leaves:
                    groups.setdefault((o.mode, t.dtype), []).append(t)
        for (mode, _), ts in groups.items():
            if len(ts) == 1 and ts[0].is_contiguous():
                dist.reduce(ts[0], dst=0, op=_REDUCE_OPS[mode])  # the accumulator is ours: in place
                continue
            flat = torch.cat([t.reshape(-1) for t in ts])
            dist.reduce(flat, dst=0, op=_REDUCE_OPS[mode])
            if rank == 0:
                offset = 0
                for t in ts:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
        self._parts: list[list[torch.Tensor]] = []
        for t, rows in zip(gathered, max_dims, strict=False):
            if t.shape[0] < rows:
                t = torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])
            t = t.contiguous()
            bufs = [torch.empty_like(t) for _ in range(world)] if rank == 0 else None
            dist.gather(t, bufs, dst=0)
            if bufs is not None:
                self._parts.append(bufs)

    def value(self, dims: list[list[int]] | None) -> Any:
        """The combined result on rank 0 (after :meth:`communicate`, or alone)."""
        g = 0
        values = []
        for o in self.outputs:
            if o.mode is None:
                values.append(o.value)
                continue
            leaves = []
            for i, t in enumerate(o.leaves):
                if o.mode == "gather":
                    if dims is not None:
                        t = torch.cat([part[:d[g]] for part, d in zip(self._parts[g], dims, strict=False)])
                    g += 1
                if o.numbers[i] and o.mode != "gather" and t.numel() == 1:
                    leaves.append(t.item())
                else:
                    leaves.append(t)
            values.append(tree_unflatten(leaves, o.spec))
        if self.kind == "single":
            return values[0]
        if self.kind is dict:
            return {o.key: v for o, v in zip(self.outputs, values, strict=False)}
        return self.kind(*values) if hasattr(self.kind, "_fields") else self.kind(values)


# -- one call, on any rank -------------------------------------------------------------------
class _Call:
    """What a rank needs to run its share: arguments, rows, slices."""

    def __init__(self, f: Function, roles: list[tuple[Any, ...]], values: dict[str, Any], rows: int,
                 slices: int, batch: torch.Tensor | None, rank: int, world: int,
                 device: torch.device) -> None:
        self.f, self.roles, self.values = f, roles, values
        self.rows, self.slices, self.batch = rows, slices, batch
        self.rank, self.world, self.device = rank, world, device
        self.counts = split_sizes(rows, world)
        self.start = sum(self.counts[:rank])
        self.watch: Callable[[], None] | None = None  # rank 0: raises once a worker died

    def exchange(self, tensors: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        """Receive (or, on rank 0, send) the tensor arguments; in the order of ``roles``."""
        local: dict[str, Any] = {}
        n = self.counts[self.rank]
        for role in self.roles:
            name, kind = role[0], role[1]
            if kind == "scatter":
                if self.world == 1:
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
                if self.world > 1:
                    dist.broadcast(t, src=0)
                local[name] = t
            elif kind == "scatter_data" or kind == "broadcast_data":
                local[name] = self.values[name].local(self.device)
            else:
                value = self.values[name]
                local[name] = value.local(self.device) if isinstance(value, SharedArray) else value
        return local

    def run(self, local: dict[str, Any]) -> tuple[_Result, BaseException | None]:
        """Run ``fn`` on this rank's share, slice by slice; catch what it raises."""
        result = _Result(self.f)
        n = self.counts[self.rank]
        kinds = {role[0]: role[1] for role in self.roles}
        batch = self.batch
        if batch is not None and batch.device != self.device:
            batch = batch.to(self.device)
        previous = getattr(_session._state, "in_function", False)
        _session._state.in_function = True
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
            _session._state.in_function = previous


def error_info(exc: BaseException) -> tuple[str, str, str, bool]:
    return (type(exc).__name__, str(exc), "".join(traceback.format_exception(exc)),
            isinstance(exc, ShoalError))


def worker_call(f: Function, call: _Call, conn: Any) -> None:
    """A worker's part of one call: arguments, compute, status, reductions."""
    local = call.exchange(None)
    result, exc = call.run(local)
    status: tuple[Any, ...]
    if exc is None:
        try:
            status = (True, result.signature(), result.gather_dims(), None)
        except Exception as e:  # e.g. an output that is not a tensor
            exc = e
    if exc is not None:
        status = (False, None, [], error_info(exc))
    conn.send_bytes(pickle.dumps(status))
    verdict = conn.recv_bytes()
    if verdict[:1] == GO:
        result.communicate(call.rank, call.world, pickle.loads(verdict[1:]))


# -- the controller --------------------------------------------------------------------------
def _to_tensor(value: Any, name: str, fname: str) -> torch.Tensor | SharedArray:
    if isinstance(value, (torch.Tensor, SharedArray)):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    raise ShoalError(f"{fname}: argument {name!r} must be a tensor, a NumPy array or shoal.shared, "
                     f"got {type(value).__name__}")


def _unreplicated(session: Any, value: Any) -> bool:
    if session is None or session.world == 1:
        return False
    return not (isinstance(value, torch.Tensor) and session.registry.knows(value))


def _controller_call(f: Function, args: tuple[Any, ...], kwargs: dict[str, Any], num_slices: int,
                     batch: Any) -> Any:
    if in_function():
        raise ShoalError(f"{f.name}: a parallel function cannot be called inside another one")
    session = active()  # raises while a broken session is current
    world = session.world if session is not None else 1
    device = session.device if session is not None else torch.device("cpu")
    try:
        bound = f.signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise ShoalError(f"{f.name}: {exc}") from None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    slices = int(num_slices)
    if slices < 1:
        raise ShoalError(f"{f.name}: num_slices must be at least 1, got {num_slices}")

    idx = None
    if batch is not None:
        if not f.scatter:
            raise ShoalError(f"{f.name}: batch= selects rows of scatter arguments, and it has none")
        idx = torch.as_tensor(np.asarray(batch) if not isinstance(batch, torch.Tensor) else batch)
        if idx.dtype == torch.bool or idx.is_floating_point():
            raise ShoalError(f"{f.name}: batch must hold integer row indices, got {idx.dtype}")
        idx = idx.reshape(-1).to(torch.int64).cpu()

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
    if rows is None:
        if slices > 1:
            raise ShoalError(f"{f.name}: num_slices needs scatter arguments to slice")
        rows = world  # one share per rank, weighted equally
    elif rows < world * slices:
        raise ShoalError(f"{f.name}: {rows} rows cannot be split over {world} processes x {slices} "
                         "slices (each needs at least one row)")

    call = _Call(f, roles, values, rows, slices, idx, 0, world, device)
    if session is None or world == 1:
        result, exc = call.run(call.exchange(tensors))
        if exc is not None:
            raise exc
        result.signature()
        return result.value(None)

    message, fresh = _command(session, f, call)
    call.watch = session.check_alive
    session.begin_call()  # from here a worker's death interrupts rank 0's share at once
    try:
        session.send_all(message)
        if fresh:
            _check_loaded(session, f)
        result, exc = call.run(call.exchange(tensors))
        mine: tuple[Any, ...] = (exc is None, None, [], None)
        if exc is None:
            try:
                mine = (True, result.signature(), result.gather_dims(), None)
            except Exception as e:
                exc = e
                mine = (False, None, [], None)
        statuses = [mine] + [pickle.loads(m) for m in session.recv_all(session.timeout, "answer")]
        ok = all(s[0] for s in statuses) and all(s[1] == statuses[0][1] for s in statuses)
        if not ok:
            session.send_all(SKIP)
        else:
            dims = [s[2] for s in statuses]
            max_dims = [max(col) for col in zip(*dims, strict=False)]
            session.send_all(GO + pickle.dumps(max_dims))
            result.communicate(0, world, max_dims)
    except BaseException as exc2:
        # A dead worker, Ctrl-C or a broken exchange: the workers cannot be trusted to be in
        # step any more. (An interruption may have come before run() reset the flag.)
        _session._state.in_function = False
        if isinstance(exc2, Interrupted):
            raise session.failure() from None
        if session.closed or isinstance(exc2, WorkerError):
            raise
        if isinstance(exc2, (KeyboardInterrupt, SystemExit)):
            # Leave the call first: the workers this abort stops are not deaths for the
            # watcher to act on, so no wake-up signal lands on this thread during teardown.
            session.end_call()
            session.abort((None, f"interrupted by {type(exc2).__name__}"))
            raise
        raise session.failure(f"{type(exc2).__name__}: {first_line(exc2)}") from exc2
    finally:
        session.end_call()
    if exc is not None:
        raise exc
    for rank, s in enumerate(statuses):
        if not s[0] and s[3] is not None:
            etype, emsg, tb, user = s[3]
            message_ = f"{etype}: {emsg} (in parallel function {f.name})"
            raise WorkerError(rank, message_, tb, user) from RemoteTraceback(tb)
    if not ok:
        lines = "; ".join(f"rank {r}: {_describe(s[1])}" for r, s in enumerate(statuses))
        raise ShoalError(f"{f.name}: outputs differ in shape or type across workers "
                         f"(nothing was reduced): {lines}")
    return result.value(dims)


def _check_loaded(session: Any, f: Function) -> None:
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


def _command(session: Any, f: Function, call: _Call) -> tuple[bytes, bool]:
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
