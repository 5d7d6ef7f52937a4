"""The objects that live on every worker (modules, optimizers, shared arrays), by id, and
the pickler that sends them once and refers to them afterwards."""

from __future__ import annotations

import io
import pickle
from typing import Any

import cloudpickle
import torch
from torch import nn

from shoal.errors import ShoalError
from shoal.parallel.arrays import SharedArray


def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers of ``module`` by qualified name."""
    out: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    out.update(module.named_buffers(remove_duplicate=False))
    return out


class _RefPickler(cloudpickle.Pickler):  # by value: lambdas, closures, __main__ functions
    """Pickles registered objects (and their parameters and buffers) as references."""

    def __init__(self, file: io.BytesIO, registry: Registry, exempt: Any = None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._registry = registry
        self._exempt = exempt

    def persistent_id(self, obj: Any) -> Any:
        if obj is self._exempt:
            return None
        return self._registry.ref(obj)


class Registry:
    """Objects that exist on every worker, by id. Auto-registers nn.Modules, optimizers and
    :class:`SharedArray` the first time they are pickled for a worker; sends each one once."""

    def __init__(self) -> None:
        self._ids: dict[int, int] = {}  # id(obj) -> oid
        self._objs: dict[int, Any] = {}  # oid -> obj (strong: keeps id(obj) unique)
        self._tensors: dict[int, tuple[int, str]] = {}  # id(tensor) -> (oid of module, name)
        self._next = 1
        self.pending: list[tuple[int, str, bytes]] = []  # definitions not yet sent

    def dumps(self, obj: Any, exempt: Any = None) -> bytes:
        buf = io.BytesIO()
        _RefPickler(buf, self, exempt).dump(obj)
        return buf.getvalue()

    def register(self, obj: Any) -> int:
        if id(obj) in self._ids:
            return self._ids[id(obj)]
        if isinstance(obj, torch.optim.Optimizer):
            self._check_optimizer(obj)
        oid = self._next
        self._next += 1
        if isinstance(obj, SharedArray):
            kind, payload = "data", pickle.dumps(obj.handle())
        else:
            kind, payload = "object", self.dumps(obj, exempt=obj)
        self._ids[id(obj)] = oid
        self._objs[oid] = obj
        self.pending.append((oid, kind, payload))
        if isinstance(obj, nn.Module):
            for name, t in module_tensors(obj).items():
                self._tensors.setdefault(id(t), (oid, name))
        return oid

    def _check_optimizer(self, opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                if self._tensor_ref(p) is None:
                    raise ShoalError(
                        "an optimizer reached the workers before its model: pass the model to the "
                        "parallel function (or call shoal.replicate(model)) before the optimizer"
                    )

    def _tensor_ref(self, t: torch.Tensor) -> tuple[int, str] | None:
        ref = self._tensors.get(id(t))
        if ref is None:
            # A module's buffer may have been replaced by a new tensor since registration.
            for oid, obj in self._objs.items():
                if isinstance(obj, nn.Module):
                    for name, u in module_tensors(obj).items():
                        self._tensors.setdefault(id(u), (oid, name))
            ref = self._tensors.get(id(t))
        return ref

    def ref(self, obj: Any) -> Any:
        """The persistent id of ``obj``, or None to pickle it by value."""
        oid = self._ids.get(id(obj))
        if oid is not None:
            return ("obj", oid)
        if isinstance(obj, (nn.Module, torch.optim.Optimizer, SharedArray)):
            return ("obj", self.register(obj))
        if isinstance(obj, torch.Tensor):
            ref = self._tensors.get(id(obj))
            if ref is not None:
                return ("tensor", *ref)
        return None

    def knows(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is (as of registration) a parameter or buffer of a replicated module."""
        return id(t) in self._tensors

    def is_replicated_tensor(self, t: torch.Tensor) -> bool:
        return self._tensor_ref(t) is not None

    def take_pending(self) -> list[tuple[int, str, bytes]]:
        out, self.pending = self.pending, []
        return out
