"""benchmarks/accelerate_wan.py without a cluster: its argument check and its table.

The benchmark itself needs root and minutes (network namespaces, 100 Mbit/s links): it is run
by hand (docs/performance.md), never timed here.
"""

import importlib.util
import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "benchmarks" / "accelerate_wan.py"


def _module():
    spec = importlib.util.spec_from_file_location("accelerate_wan", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_unknown_coupling_is_refused_before_any_namespace():
    res = subprocess.run([sys.executable, str(SCRIPT), "--couplings", "ddp,bogus"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "unknown 'bogus'" in res.stderr
    assert "localsgd" in res.stderr  # the choices are named


def test_the_table_gives_ratios_to_localsgd():
    m = {"loop_sent": 50e6, "run_sent": 60e6, "samples_per_s": 1000.0, "test_accuracy": 0.9,
         "test_loss": 0.3, "seconds": 10.0, "load": 1.0}
    found = {"localsgd": m, "diloco-int4": {**m, "loop_sent": 5e6, "samples_per_s": 1500.0}}
    rows = _module().table(found).splitlines()
    assert rows[2].startswith("| Accelerate LocalSGD | 50.00 | 1.00x |")
    assert rows[3].startswith("| shoal DiLoCo streaming int4 | 5.00 | 0.10x | 60.00 | 1,500 | 1.50x |")
