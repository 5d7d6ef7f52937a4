"""Strided fragments (``--fragment-pattern strided``) equal the paper's strided pattern.

Streaming DiLoCo (Douillard et al. 2025, Figure 2: "Streaming pattern: sequential (left) and
strided (right)") deals the model's layers out to the fragments: fragment p holds layers
p, p + F, p + 2F, ... A layer here is a module's own tensors (a Linear's weight and bias).
The model is additive, four Linear layers each reading its own columns of the least-squares
problem of tests/test_strategy_reference.py (float64), so that the references of
tests/test_streaming_reference.py simulate the workers with the analytic gradient, in the
paper's variables, the fragments written from the pattern's definition and no shoal code;
shoal runs on 1, 2 and 3 real Gloo workers, each case also restarted from saved state
mid-flight. Then: which tensor goes to which fragment, EAMSGD's optimizer groups when the
fragments interleave them, and a saved state of one pattern refused by the other.
"""

from __future__ import annotations

import pytest
import torch
from test_strategy_reference import LR, problem, results_by_world, rows
from test_streaming_reference import (
    TAU,
    Geometry,
    assert_as_reference,
    reference_streaming_diloco,
    reference_streaming_local,
    run_case,
)
from torch import nn

import shoal
from shoal.core.comm import Comm
from shoal.core.env import Environment
from shoal.errors import ShoalError

#: layer l reads the columns [lo, hi) of x; its weight and bias follow each other in the vector
COLUMNS = [(0, 2), (2, 3), (3, 4), (4, 5)]
LAYERS, _at = [], 0
for _lo, _hi in COLUMNS:
    LAYERS.append(list(range(_at, _at + _hi - _lo + 1)))
    _at += _hi - _lo + 1
SIZE = _at  # 9 values: w_0 (2), b_0, w_1, b_1, w_2, b_2, w_3, b_3


class Additive(nn.Module):
    """sum_l (x[:, lo_l:hi_l] w_l + b_l): four layers, each its own Linear."""

    def __init__(self, init: torch.Tensor) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hi - lo, 1).double() for lo, hi in COLUMNS)
        with torch.no_grad():
            for layer, idx in zip(self.layers, LAYERS, strict=True):
                layer.weight.copy_(init[idx[:-1]].view(1, -1))
                layer.bias.copy_(init[idx[-1:]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x[:, lo:hi]) for layer, (lo, hi) in zip(self.layers, COLUMNS, strict=True))


def design(x: torch.Tensor) -> torch.Tensor:
    """The rows [x[:, lo_0:hi_0], 1, x[:, lo_1:hi_1], 1, ...]: the prediction is design(x) p."""
    ones = torch.ones(len(x), 1, dtype=x.dtype)
    return torch.cat([torch.cat([x[:, lo:hi], ones], 1) for lo, hi in COLUMNS], 1)


def grad_additive(p: torch.Tensor, step: int, worker: int, world: int) -> torch.Tensor:
    """Gradient of worker ``worker``'s mean((A p - y)^2) at ``p``, A = design(x)."""
    x, y, _ = problem()
    a, yb = design(x[rows(step, worker, world)]), y[rows(step, worker, world)]
    return 2 * a.T @ (a @ p - yb) / len(yb)


def fragments(count: int, pattern: str) -> list[torch.Tensor]:
    """Strided (the paper's Figure 2): fragment p = layers p, p + count, ... Sequential
    (shoal's): runs of whole tensors of about equal numbers of values, for 2 the first
    four tensors (w_0, b_0, w_1, b_1: 5 values) and the other four."""
    if count == 1:
        return [torch.arange(SIZE)]
    if pattern == "strided":
        return [torch.tensor(sum(LAYERS[p::count], [])) for p in range(count)]
    assert count == 2
    return [torch.arange(0, 5), torch.arange(5, SIZE)]


ADDITIVE = Geometry(0.1 * torch.randn(SIZE, generator=torch.Generator().manual_seed(1),
                                      dtype=torch.float64), grad_additive, fragments, Additive)

STRIDED = {"fragment_pattern": "strided"}
# name: (strategy, options, inner momentum, restart after this many steps)
CASES = {
    "diloco-strided-f2": ("diloco", {"fragments": 2, **STRIDED}, 0.0, 3),
    "diloco-strided-f2-h1": ("diloco", {"fragments": 2, "overlap_steps": 1, **STRIDED}, 0.9, 3),
    "diloco-sequential-f2-h1": ("diloco", {"fragments": 2, "overlap_steps": 1}, 0.9, 3),
    "diloco-strided-f3-h1-int4": ("diloco", {"fragments": 3, "overlap_steps": 1,
                                             "outer_precision": "int4", **STRIDED}, 0.0, 5),
    "local-sgd-strided-f2-h1": ("local-sgd", {"fragments": 2, "overlap_steps": 1, **STRIDED},
                                0.0, 3),
    "easgd-strided-f2-h1": ("easgd", {"fragments": 2, "overlap_steps": 1, "alpha": 0.3,
                                      **STRIDED}, 0.0, 3),
}


def run_cases(comm: Comm) -> dict:
    def run(name: str, at: int | None = None) -> dict:
        return run_case(name, comm, at, cases=CASES, geometry=ADDITIVE)

    return {name: run(name) for name in CASES} | {
        f"{name}-restarted": run(name, CASES[name][3]) for name in CASES}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, list[dict]]:
    return results_by_world(tmp_path_factory, run_cases)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_strided_fragments_match_the_paper(results, name, world):
    kind = CASES[name][0]
    if kind == "diloco":
        models, evaluated = reference_streaming_diloco(name, world, cases=CASES, geometry=ADDITIVE)
    else:
        models, evaluated = reference_streaming_local(name, world, cases=CASES, geometry=ADDITIVE)
    assert_as_reference(results[world], name, models, evaluated)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_restart_mid_flight_changes_nothing(results, name, world):
    for rank in range(world):
        assert results[world][rank][f"{name}-restarted"] == results[world][rank][name]


def test_the_patterns_train_differently(results):
    """The same run but for the pattern: the fragments really moved."""
    strided, sequential = (results[2][0][f"diloco-{p}-f2-h1"]["x"] for p in ("strided", "sequential"))
    assert max(abs(a - b) for a, b in zip(strided, sequential, strict=True)) > 1e-6


# -- which tensor goes where -------------------------------------------------------------------
class Block(nn.Module):
    """A module with a tensor of its own beside a child's: two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.inner = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


def small_model() -> nn.Sequential:
    """Layers 0..4: Linear, LayerNorm, Block's scale, Block's Linear, Linear; the last Linear
    holds only layer 0's weight (tied), no layer of its own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3), Block(), nn.ReLU(), nn.Linear(3, 3),
                          nn.Linear(3, 3, bias=False))
    model[5].weight = model[0].weight
    return model


def fragment_names(model: nn.Module, strategy: shoal.Strategy) -> list[list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(t)] for t in f.flat.tensors] for f in strategy.exchanges.fragments]


def make(kind: str, model: nn.Module, tau: int = 6, **options) -> shoal.Strategy:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    comm = Comm(Environment(), torch.device("cpu"))
    return shoal.strategy(kind, model, optimizer, comm=comm, tau=tau, **options)


@pytest.mark.parametrize("kind", ["diloco", "local-sgd", "easgd", "eamsgd"])
def test_which_tensors_go_to_which_fragment(kind):
    """Layer l goes to fragment l mod F, whole (weight and bias together), in model order; a
    module's own tensor is a layer apart from its children's; a tied tensor belongs to its
    first module; each fragment is one slice of the flat vectors, in fragment order."""
    model = small_model()
    strategy = make(kind, model, fragments=3, fragment_pattern="strided")
    assert fragment_names(model, strategy) == [
        ["0.weight", "0.bias", "2.inner.weight", "2.inner.bias"],
        ["1.weight", "1.bias", "4.weight", "4.bias"],
        ["2.scale"]]
    lo = 0
    for p, fragment in enumerate(strategy.exchanges.fragments):
        assert (fragment.index, fragment.lo) == (p, lo)
        lo += sum(t.numel() for t in fragment.flat.tensors)
        assert fragment.hi == lo
    assert lo == strategy.flat.numel
    laid_out = [id(t) for f in strategy.exchanges.fragments for t in f.flat.tensors]
    assert laid_out == [id(t) for t in strategy.flat.tensors]
    model = small_model()
    sequential = make(kind, model, fragments=3)  # as before: runs in model order
    assert sum(fragment_names(model, sequential), []) == [n for n, _ in model.named_parameters()]


def test_more_fragments_than_layers_is_one_line():
    with pytest.raises(ShoalError, match=r"^--fragments must be between 1 and the model's 5 "
                                         r"layers \(--fragment-pattern strided\), got 6$"):
        make("diloco", small_model(), fragments=6, fragment_pattern="strided", tau=8)


def test_one_strided_fragment_is_the_whole_model_in_order():
    model = small_model()
    strategy = make("diloco", model, fragment_pattern="strided")
    assert fragment_names(model, strategy) == [[n for n, _ in model.named_parameters()]]


def test_eamsgd_keeps_each_groups_rate_when_fragments_interleave_them():
    """EAMSGD's local steps read each optimizer group's rate and momentum on the group's own
    tensors, wherever strided fragments lay them out: with alpha = 0 (no pull) the run equals
    the same run in one fragment, bit for bit."""
    x, y, _ = problem()

    def train(**options) -> list[float]:
        model = Additive(ADDITIVE.init)
        layers = list(model.layers)
        optimizer = torch.optim.SGD([
            {"params": [p for m in layers[:2] for p in m.parameters()], "lr": LR, "momentum": 0.9},
            {"params": [p for m in layers[2:] for p in m.parameters()], "lr": 3 * LR,
             "momentum": 0.5}])
        strategy = shoal.strategy("eamsgd", model, optimizer, alpha=0.0, tau=TAU,
                                  comm=Comm(Environment(), torch.device("cpu")), **options)
        for step in range(8):
            batch = rows(step, 0, 1)
            loss = nn.functional.mse_loss(strategy.module(x[batch]).squeeze(1), y[batch])
            strategy.backward(loss)
            strategy.step()
            strategy.zero_grad()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()

    assert train(fragments=2, fragment_pattern="strided") == train()


def test_a_saved_state_of_the_other_pattern_is_refused():
    saved = make("diloco", small_model(), fragments=2).state_dict()
    strided = make("diloco", small_model(), fragments=2, fragment_pattern="strided")
    with pytest.raises(ShoalError, match="the saved state's fragments are sequential, this "
                                         "strategy's strided: resume with --fragment-pattern "
                                         "sequential"):
        strided.load_state_dict(saved)
