"""The model zoo, by name; every factory takes ``(input_shape, num_classes)``.

``--model pkg.module:factory`` (or ``path/to/file.py:factory``) loads a user's own model:
``factory(input_shape, num_classes)`` returning an ``nn.Module`` that maps a batch of inputs
to class scores. Models know nothing of ranks or devices.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from shoal.errors import ShoalError
from shoal.loading import exited, load_object, one_line
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
        raise ShoalError(f"model {spec!r} {exited(exc)} while being built") from exc
    except Exception as exc:
        raise ShoalError(f"model {spec!r} could not be built: {one_line(exc)}") from exc
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
        raise ShoalError(f"model {spec!r} {exited(exc)} in its forward pass") from exc
    except Exception as exc:
        shape = "x".join(map(str, input_shape))
        raise ShoalError(f"model {spec!r} cannot take inputs of shape {shape}: "
                         f"{one_line(exc)}") from exc
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ShoalError(f"model {spec!r} must output (batch, {num_classes}) class scores, "
                         f"got {got}")


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["MODELS", "build_model", "check_model", "count_parameters", "register_model"]
