"""shoal's strategies in a Hugging Face Accelerate loop (shoal.integrations.accelerate).

One ``accelerate launch`` of 2 CPU processes (Gloo) runs tests/accelerate_job.py: for each
case the README's example (examples/accelerate_diloco.py) learns the bundled digits, and its
parameters equal, bit for bit, shoal's own loop with the same strategy, seed and batches;
a coupling's checkpoint restores every rank's state exactly.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from shoal.core.env import free_port
from shoal.errors import ShoalError

from conftest import REPO, assert_same, needs, run, shoal_env

needs("accelerate")

EPOCHS = 2
CASES = {
    "sync": ["sync", {}],
    "local-sgd": ["local-sgd", {"tau": 4}],
    "easgd": ["easgd", {"tau": 4}],
    "diloco": ["diloco", {"tau": 8}],
    "streaming diloco, int4": ["diloco", {"tau": 8, "fragments": 2, "overlap_steps": 1,
                                          "outer_precision": "int4"}],
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("accelerate")
    launcher = Path(sys.executable).parent / "accelerate"
    env = {**shoal_env(), "OMP_NUM_THREADS": "1"}
    res = run([str(launcher), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
               "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               str(free_port()), str(REPO / "tests" / "accelerate_job.py"), str(out),
               json.dumps(CASES), str(EPOCHS)], timeout=240, env=env, cwd=REPO)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", CASES)
def test_the_example_equals_shoal_s_own_loop(ranks, case):
    for rank, results in enumerate(ranks):
        got = results[case]
        assert got["coupling"]["steps"] == got["own"]["steps"] == EPOCHS * 45  # 1437 rows, 32 a step
        assert_same(got["coupling"]["params"], got["own"]["params"], f"rank {rank}, {case}")
    # Every rank ends with the trained model (DiLoCo's global one, EASGD's center).
    assert_same(ranks[0][case]["coupling"]["params"], ranks[1][case]["coupling"]["params"],
                f"{case}: rank 0 against rank 1")


@pytest.mark.parametrize("case", CASES)
def test_the_example_learns(ranks, case):
    # 2 epochs of 45 steps (chance: 10 %): sync 82 %, diloco 78 %, local SGD 76 %, EASGD's
    # center 71 % (2026-12-06).
    accuracy = ranks[0][case]["coupling"]["accuracy"]
    assert accuracy > 0.6, f"{case}: test accuracy {accuracy:.3f}"


def test_a_checkpoint_restores_every_rank_s_state(ranks):
    for rank, results in enumerate(ranks):
        got = results["checkpoint"]
        assert got["steps"] == 20
        assert_same(got["again"], got["first"], f"rank {rank}: after the restored checkpoint")
    assert ranks[0]["checkpoint"]["first"] != ranks[1]["checkpoint"]["first"]  # replicas drift


def test_the_readme_shows_the_lines_a_user_adds():
    readme = (REPO / "README.md").read_text()
    code = (REPO / "examples" / "accelerate_diloco.py").read_text()
    for line in ("from shoal.integrations.accelerate import Coupling",
                 "with Coupling(accelerator, model, optimizer,", "coupling.step()"):
        assert line in code and line in readme, line
    assert re.search(r"pip install .shoal\[accelerate\]", readme)


@pytest.mark.parametrize("strategy, options, message", [
    ("async-sgd", {}, "strategy async-sgd needs shoal to lay out its processes"),
    ("eamsgd", {}, "eamsgd takes its local step itself"),
    ("diloco", {"tau": "auto"}, "tau='auto' adapts to every step's loss"),
    ("diloco", {"rho": 1}, "rho"),
])
def test_what_a_coupling_cannot_run_is_one_line(strategy, options, message):
    from accelerate import Accelerator

    from shoal.integrations.accelerate import Coupling

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ShoalError, match=re.escape(message)):
        Coupling(Accelerator(cpu=True), model, optimizer, strategy, **options)
