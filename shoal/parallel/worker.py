"""A worker process: join the process group, then run commands until told to stop."""

from __future__ import annotations

import io
import os
import pickle
import signal
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shoal.core.processes import die_with_parent, loopback_gloo_interface
from shoal.parallel import session as _session
from shoal.parallel.arrays import SharedArray
from shoal.parallel.functions import Function, _Call, error_info, worker_call
from shoal.parallel.session import GO, OP_CALL, OP_CLOSE, module_tensors


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, worker: Worker) -> None:
        super().__init__(io.BytesIO(data))
        self._worker = worker

    def persistent_load(self, pid: Any) -> Any:
        return self._worker.resolve(pid)


class Worker:
    """The objects, functions and last arguments this worker holds for the controller."""

    def __init__(self, rank: int, world: int, device: torch.device, conn: Any) -> None:
        self.rank, self.world, self.device, self.conn = rank, world, device, conn
        self.objects: dict[int, Any] = {}
        self.functions: dict[int, Function] = {}
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
                return
            if command[0] == OP_CALL:
                self.call(*command[1:])

    def call(self, fid: int, rows: int, slices: int, batch: bytes | None,
             defs: list[tuple[int, str, bytes]], fn_bytes: bytes | None, payload: bytes | None) -> None:
        if defs or fn_bytes is not None or payload is not None:
            # Something new arrived: say whether it loaded before any tensor moves, so that a
            # function this worker cannot import is an error in the caller, not a hang.
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
                return
            self.conn.send_bytes(pickle.dumps(None))
            if self.conn.recv_bytes()[:1] != GO:
                return  # another worker could not load it
        f = self.functions[fid]
        roles, values = self.payloads[fid]
        idx = torch.frombuffer(bytearray(batch), dtype=torch.int64) if batch is not None else None
        call = _Call(f, roles, values, rows, slices, idx, self.rank, self.world, self.device)
        worker_call(f, call, self.conn)


def worker_main(rank: int, world: int, port: int, device: str, conn: Any, timeout: float,
                threads: int) -> None:
    """Entry point of a spawned worker (rank >= 1)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the controller's to handle
    die_with_parent()
    torch.set_num_threads(threads)
    dev = torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    _session._state.in_function = True  # collectives called here are the SPMD kind
    conn.send_bytes(b"ready")
    td = timedelta(seconds=timeout)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=max(timeout, 60.0)))
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    # This process is ours: Gloo listens on loopback only, whatever the controller's user set.
    gloo = loopback_gloo_interface()
    if gloo is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = gloo
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=td)
    conn.send_bytes(b"joined")
    try:
        Worker(rank, world, dev, conn).serve()
    finally:
        dist.destroy_process_group()
        sys.stdout.flush()
