"""The model zoo, by name; every factory takes ``(input_shape, num_classes)``.

``--model pkg.module:factory`` (or ``path/to/file.py:factory``) loads a user's own model:
``factory(input_shape, num_classes)`` returning an ``nn.Module`` that maps a batch of inputs
to class scores. Models know nothing of ranks or devices.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from shoal.errors import ShoalError
from shoal.models.resnet import resnet18, resnet20, resnet50, resnet56
from shoal.models.small import MLP, AlexNet, LeNet5
from shoal.models.vgg import VGG

Factory = Callable[[tuple[int, ...], int], nn.Module]

MODELS: dict[str, Factory] = {
    "mlp": MLP,
    "lenet5": LeNet5,
    "alexnet": AlexNet,
    "vgg11": VGG,
    "resnet20": resnet20,
    "resnet56": resnet56,
    "resnet18": resnet18,
    "resnet50": resnet50,
}


def register_model(name: str, factory: Factory) -> None:
    """Make ``--model name`` build ``factory(input_shape, num_classes)``."""
    MODELS[name] = factory


def load_object(spec: str, what: str) -> object:
    """Import ``pkg.module:attr`` or ``path/to/file.py:attr`` and return the attribute."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ShoalError(f"{what} {spec!r}: expected pkg.module:name or file.py:name")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ShoalError(f"{what} {spec!r}: file {path} does not exist")
            mod_spec = importlib.util.spec_from_file_location(path.stem, path)
            assert mod_spec is not None and mod_spec.loader is not None
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules.setdefault(path.stem, module)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ShoalError(f"{what} {spec!r}: cannot import {module_name} ({exc})") from None
    except ShoalError:
        raise
    except SystemExit as exc:
        raise ShoalError(f"{what} {spec!r}: importing {module_name} {_exited(exc)}") from exc
    except Exception as exc:
        raise ShoalError(f"{what} {spec!r}: importing {module_name} failed: "
                         f"{_first_line(exc)}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ShoalError(f"{what} {spec!r}: {module_name} has no attribute {attr!r}") from None


def _first_line(exc: BaseException) -> str:
    """``Type: first line of the message``: an exception as one line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _exited(exc: SystemExit) -> str:
    """What a user's code did that raised ``exc``: ``called sys.exit(3)``."""
    return f"called sys.exit({exc.code!r})" if exc.code is not None else "called sys.exit()"


def _factory(spec: str) -> Factory:
    if spec in MODELS:
        return MODELS[spec]
    if ":" in spec:
        factory = load_object(spec, "model")
        if not callable(factory):
            raise ShoalError(f"model {spec!r} is not callable")
        return factory  # type: ignore[return-value]
    raise ShoalError(f"unknown model {spec!r}; choose from {', '.join(sorted(MODELS))} "
                     "or give pkg.module:factory")


def build_model(spec: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build the model and check, with a two-sample forward pass, that it fits the data."""
    factory = _factory(spec)
    try:
        params = inspect.signature(factory).parameters
        if "input_shape" in params or len(params) >= 2:
            model = factory(tuple(input_shape), num_classes)
        else:
            model = factory()  # type: ignore[call-arg]
    except ShoalError:
        raise
    except SystemExit as exc:  # a factory that exits must not end shoal without a word
        raise ShoalError(f"model {spec!r} {_exited(exc)} while being built") from exc
    except Exception as exc:
        raise ShoalError(f"model {spec!r} could not be built: {_first_line(exc)}") from exc
    if not isinstance(model, nn.Module):
        raise ShoalError(f"model {spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    check_model(model, spec, input_shape, num_classes)
    return model


def check_model(model: nn.Module, spec: str, input_shape: tuple[int, ...], num_classes: int) -> None:
    """Raise a one-line error unless ``model`` maps (2, *input_shape) to (2, num_classes)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros(2, *input_shape))
    except SystemExit as exc:
        raise ShoalError(f"model {spec!r} {_exited(exc)} in its forward pass") from exc
    except Exception as exc:
        shape = "x".join(map(str, input_shape))
        raise ShoalError(f"model {spec!r} cannot take inputs of shape {shape}: "
                         f"{_first_line(exc)}") from exc
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ShoalError(f"model {spec!r} must output (batch, {num_classes}) class scores, "
                         f"got {got}")


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["MODELS", "build_model", "check_model", "count_parameters", "load_object",
           "register_model"]
