"""shoal's strategies in a Hugging Face Trainer (shoal.integrations.hf_trainer).

One ``torchrun`` (``python -m torch.distributed.run``) of 2 CPU processes (Gloo) runs
tests/hf_trainer_job.py: for each case the example (examples/hf_trainer_diloco.py) learns
the bundled digits, and its parameters equal, bit for bit, shoal's own loop with the same
strategy, seed and batches (the Trainer's own loader); a checkpoint holds every rank's
strategy state and resuming from it continues exactly; what a ShoalTrainer cannot run is refused in one line.
"""

from __future__ import annotations

import json
import sys

import pytest

from shoal.core.env import free_port

from conftest import REPO, assert_same, needs, run, shoal_env

needs("transformers")

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
    out = tmp_path_factory.mktemp("hf_trainer")
    # torchrun (as python -m, which the suite forks warm) sets OMP_NUM_THREADS=1 for each rank.
    env = {**shoal_env(), "TOKENIZERS_PARALLELISM": "false"}
    res = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), str(REPO / "tests" / "hf_trainer_job.py"),
               str(out), json.dumps(CASES), str(EPOCHS)], timeout=300, env=env, cwd=REPO)
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
    # 2 epochs of 45 steps (chance: 10 %): sync 76 %, local SGD 74 %, EASGD's center 72 %,
    # diloco 79 %, streamed in int4 80 % (2026-12-06).
    accuracy = ranks[0][case]["coupling"]["accuracy"]
    assert accuracy > 0.6, f"{case}: test accuracy {accuracy:.3f}"


def test_a_checkpoint_holds_every_rank_and_resumes_exactly(ranks):
    for rank, results in enumerate(ranks):
        got = results["checkpoint"]
        assert (got["saved_ranks"], got["saved_steps"]) == (2, 10)
        assert got["replicas_differ"], f"rank {rank}: the checkpoint holds one replica twice"
        assert_same(got["again"], got["first"], f"rank {rank}: resumed from step 10")


@pytest.mark.parametrize("case, message", [
    ("async-sgd", "strategy async-sgd needs shoal to lay out its processes"),
    ("eamsgd", "eamsgd takes its local step itself"),
    ("accumulation", "leave the Trainer's gradient_accumulation_steps at 1"),
    ("best model", "load_best_model_at_end would load rank 0's replica"),
    ("plain Trainer", "ShoalCallback needs ShoalTrainer in place of Trainer"),
    ("no callback", "ShoalTrainer takes one ShoalCallback in its callbacks"),
    ("no saved state", "has no shoal_coupling.pt (not saved by a ShoalTrainer)"),
])
def test_what_a_shoal_trainer_cannot_run_is_one_line(ranks, case, message):
    for results in ranks:
        got = results["refusals"][case]
        assert message in got and "\n" not in got, got
