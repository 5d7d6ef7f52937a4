"""A worker process: join the process group, then run commands until told to stop."""

from __future__ import annotations

import io
import pickle
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shoal.core.env import Environment
from shoal.core.group import job_store, join_group, loopback_gloo
from shoal.core.timeline import DATA
from shoal.parallel import hostsums
from shoal.parallel.arrays import SharedArray
from shoal.parallel.call import Call, worker_call
from shoal.parallel.context import Meter, enter_function
from shoal.parallel.protocol import GO, OP_CALL, OP_CLOSE, error_info
from shoal.parallel.registry import module_tensors
from shoal.parallel.spec import FunctionSpec


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, worker: Worker) -> None:
        super().__init__(io.BytesIO(data))
        self._worker = worker

    def persistent_load(self, pid: Any) -> Any:
        return self._worker.resolve(pid)


class Worker:
    """The objects, functions and last arguments this worker holds for the controller, and
    its books."""

    def __init__(self, rank: int, world_size: int, device: torch.device, conn: Any, meter: Meter) -> None:
        self.rank, self.world_size, self.device, self.conn = rank, world_size, device, conn
        self.meter = meter
        self.objects: dict[int, Any] = {}
        self.functions: dict[int, FunctionSpec] = {}
        self.payloads: dict[int, tuple[list[Any], dict[str, Any]]] = {}

    def loads(self, data: bytes) -> Any:
        return _Unpickler(data, self).load()

    def resolve(self, pid: Any) -> Any:
        if pid[0] == "obj":
            return self.objects[pid[1]]
        _, oid, name = pid
        return module_tensors(self.objects[oid])[name]

    def define(self, oid: int, kind: str, payload: bytes) -> None:
        if kind == "data":
            self.objects[oid] = SharedArray.attach(pickle.loads(payload))
            return
        obj = self.loads(payload)
        if isinstance(obj, nn.Module) and self.device.type != "cpu":
            obj.to(self.device)
        self.objects[oid] = obj

    def serve(self) -> None:
        while True:
            try:
                message = self.conn.recv_bytes()
            except (EOFError, OSError):
                return  # the controller is gone
            command = pickle.loads(message)
            if command[0] == OP_CLOSE:
                if self.meter.timeline.keep_events:  # the controller writes the trace
                    self.conn.send_bytes(pickle.dumps(
                        (self.meter.timeline.chrome_events(self.rank), self.meter.bytes_sent)))
                return
            if command[0] == OP_CALL:
                self.call(*command[1:])

    def call(self, fid: int, rows: int, slices: int, batch: bytes | None,
             defs: list[tuple[int, str, bytes]], fn_bytes: bytes | None, payload: bytes | None) -> None:
        fresh = bool(defs) or fn_bytes is not None or payload is not None
        if fresh and not self._load(fid, defs, fn_bytes, payload):
            return
        f = self.functions[fid]
        roles, values = self.payloads[fid]
        idx = torch.frombuffer(bytearray(batch), dtype=torch.int64) if batch is not None else None
        worker_call(Call(f, roles, values, rows, slices, idx, self.rank, self.world_size, self.device,
                         self.meter), self.conn)

    def _load(self, fid: int, defs: list[tuple[int, str, bytes]], fn_bytes: bytes | None,
              payload: bytes | None) -> bool:
        """Load what is new and say whether it loaded before any tensor moves, so that a
        function this worker cannot import is an error in the caller, not a hang. False:
        this call does not run (here or on another worker, something failed to load)."""
        with self.meter.leaf(DATA, "load"):
            try:
                for oid, kind, data in defs:
                    self.define(oid, kind, data)
                if fn_bytes is not None:
                    self.functions[fid] = self.loads(fn_bytes)
                if payload is not None:
                    self.payloads[fid] = self.loads(payload)
            except Exception as exc:
                self.conn.send_bytes(pickle.dumps(error_info(exc)))
                self.conn.recv_bytes()  # the controller's SKIP
                return False
            self.conn.send_bytes(pickle.dumps(None))
            return self.conn.recv_bytes()[:1] == GO


def worker_main(conn: Any, rank: int, world_size: int, port: int, device: str, timeout: float,
                threads: int, trace: bool, secret: str) -> None:
    """Entry point of a spawned worker (rank >= 1; ``conn``: its pipe in the session's pool);
    with ``trace`` it keeps its spans and sends them to the controller when told to close;
    ``secret``: the session's, which seals its store."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the controller's to handle
    torch.set_num_threads(threads)
    dev = torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    meter = Meter(keep_events=trace)
    enter_function(meter)  # for good: collectives called here are the SPMD kind
    conn.send_bytes(b"ready")
    # A client of the store the controller serves on loopback.
    store = job_store(Environment(rank=rank, world_size=world_size, master_addr="127.0.0.1",
                                  master_port=port, secret=secret), max(timeout, 60.0))
    # This process is ours: Gloo listens on loopback only, whatever the controller's user set.
    with loopback_gloo():
        join_group(store, rank, world_size, device, timeout, where="the parallel session")
        hostsums.join(device, timeout)  # with the controller and every worker: a collective
        conn.send_bytes(b"joined")
        try:
            Worker(rank, world_size, dev, conn, meter).serve()
        finally:
            hostsums.leave()
            dist.destroy_process_group()
            sys.stdout.flush()
