"""examples/parallel_digits.py: the parallel gradient function reaches the serial accuracy."""

import importlib.util

import pytest

from conftest import REPO


@pytest.mark.timeout(120)
def test_parallel_digits_matches_serial(capsys):
    spec = importlib.util.spec_from_file_location("parallel_digits", REPO / "examples" / "parallel_digits.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--workers", "2", "--epochs", "3"])
    serial, parallel = result["serial"]["accuracy"], result["parallel"]["accuracy"]
    assert serial >= 0.9 and parallel >= 0.9, result
    assert abs(parallel - serial) <= 1 / 360, result  # at most one of the 360 test images apart
    assert "parallel, 2 procs" in capsys.readouterr().out
