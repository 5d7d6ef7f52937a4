"""Optional: torchft's Streaming DiLoCo (``torchft.local_sgd.DiLoCo``) on the problem of
tests/test_streaming_reference.py, two replicas (threads, each its own torchft Manager and
Gloo process group, a lighthouse between them), against the same paper reference shoal is
checked against: where the definitions agree (fragment p lands after step p tau / F and
starts H steps earlier, Delta = theta - x averaged, an outer Nesterov SGD per fragment,
theta + alpha (local - theta) after the overlap), both equal it. Skipped without torchft
(``.venv/bin/pip install torchft``; not a dependency of shoal). torchft mixes also when
H = 0 (shoal takes the global fragment there, as the paper's no-overlap case), so the cases
with H = 0 use alpha = 0. torchft's fragments are the modules it is given: strided ones
(tests/test_streaming_strided.py) are the layers p, p + F, ... of each fragment, together."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
from test_strategy_reference import LR, STEPS, problem, rows
from test_streaming_reference import CASES, OUTER_LR, OUTER_MU, TAU, reference_streaming_diloco
from test_streaming_strided import ADDITIVE, Additive
from test_streaming_strided import CASES as STRIDED_CASES
from torch import nn

torchft = pytest.importorskip("torchft")
from torchft._torchft import LighthouseServer  # noqa: E402
from torchft.local_sgd import DiLoCo  # noqa: E402
from torchft.manager import Manager  # noqa: E402
from torchft.process_group import ProcessGroupGloo  # noqa: E402

pytestmark = pytest.mark.timeout(180)
TORCHFT_CASES = ["diloco-f2", "diloco-f2-h1", "diloco-f2-h1-alpha0", "diloco-strided-f2-h1"]


class Holder(nn.Module):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.value = nn.Parameter(value.clone())


class Linear(nn.Module):
    """x w + b with w and b in submodules of their own: torchft's fragments are modules."""

    def __init__(self, init: torch.Tensor) -> None:
        super().__init__()
        self.w, self.b = Holder(init[:-1]), Holder(init[-1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w.value + self.b.value


def model_and_fragments(name: str) -> tuple[nn.Module, list[nn.Module]]:
    """The case's model, and its fragments as torchft takes them: modules."""
    if name in STRIDED_CASES:
        model = Additive(ADDITIVE.init)
        count = STRIDED_CASES[name][1]["fragments"]
        return model, [nn.ModuleList(model.layers[p::count]) for p in range(count)]
    model = Linear(problem()[2])
    return model, [model.w, model.b]


def replica(rid: int, name: str, address: str) -> list[float]:
    _, opts, mu, _ = {**CASES, **STRIDED_CASES}[name]
    x, y, _ = problem()
    model, fragments = model_and_fragments(name)
    inner = torch.optim.SGD(model.parameters(), lr=LR, momentum=mu)
    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=2, use_async_quorum=False,
                      load_state_dict=lambda s: None, state_dict=lambda: {},
                      replica_id=f"shoal{rid}", store_addr="localhost", store_port=store.port,
                      rank=0, world_size=1, lighthouse_addr=address, port=0,
                      timeout=timedelta(seconds=30))
    try:
        outer = [torch.optim.SGD(f.parameters(), lr=OUTER_LR, momentum=OUTER_MU, nesterov=True)
                 for f in fragments]
        overlap = opts.get("overlap_steps", 0)
        with DiLoCo(manager, fragments, inner, outer, sync_every=TAU, fragment_sync_delay=overlap,
                    fragment_update_alpha=opts.get("mix_alpha", 0.5) if overlap else 0.0):
            for step in range(STEPS):
                batch = rows(step, rid, 2)
                inner.zero_grad()
                torch.nn.functional.mse_loss(model(x[batch]).reshape(-1), y[batch]).backward()
                inner.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    finally:
        manager.shutdown(wait=False)


@pytest.mark.parametrize("name", TORCHFT_CASES)
def test_torchft_streaming_diloco_matches_the_same_reference(name):
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            got = [f.result(timeout=150) for f in
                   [pool.submit(replica, r, name, lighthouse.address()) for r in range(2)]]
    finally:
        lighthouse.shutdown()
    strided = {"cases": STRIDED_CASES, "geometry": ADDITIVE} if name in STRIDED_CASES else {}
    models, _ = reference_streaming_diloco(name, 2, close=False, **strided)
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(got[rank], dtype=torch.float64), models[rank],
                                   atol=1e-10, rtol=0, msg=f"replica {rank}")
