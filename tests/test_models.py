import pytest
import torch

from shoal.errors import ShoalError
from shoal.models import MODELS, build_model


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 8, 8)])
def test_zoo_models_fit_cifar_and_digits_shapes(name, shape):
    model = build_model(name, shape, 10)
    model.train()
    out = model(torch.randn(4, *shape))
    assert out.shape == (4, 10)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_resnet_depths_match_the_papers():
    def convs_and_fcs(m):
        return sum(isinstance(x, (torch.nn.Conv2d, torch.nn.Linear)) for x in m.modules())

    assert convs_and_fcs(build_model("resnet20", (3, 32, 32), 10)) == 20
    assert convs_and_fcs(build_model("resnet56", (3, 32, 32), 10)) == 56
    # ImageNet ResNets count projection shortcuts too: 18 + 3 and 50 + 4
    assert convs_and_fcs(build_model("resnet18", (3, 64, 64), 10)) == 21
    assert convs_and_fcs(build_model("resnet50", (3, 64, 64), 10)) == 54
    assert sum(p.numel() for p in build_model("resnet20", (3, 32, 32), 10).parameters()) \
        == pytest.approx(0.27e6, rel=0.02)


def test_user_model_by_module_path():
    model = build_model("tests.fixtures_models:tiny", (1, 8, 8), 10)
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


@pytest.mark.parametrize("spec, shape, message", [
    ("lenet5", (64,), "needs image input"),
    ("lenet5", (1, 2, 2), "at least 4x4"),
    ("nope", (1, 8, 8), "unknown model 'nope'"),
    ("tests.fixtures_models:missing", (1, 8, 8), "has no attribute 'missing'"),
    ("no_such_pkg.mod:f", (1, 8, 8), "cannot import no_such_pkg.mod"),
    ("tests.fixtures_models:wrong_output", (1, 8, 8), r"must output \(batch, 10\)"),
])
def test_models_that_cannot_work_are_named(spec, shape, message):
    with pytest.raises(ShoalError, match=message):
        build_model(spec, shape, 10)
