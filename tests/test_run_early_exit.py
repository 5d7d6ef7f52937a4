"""``shoal run`` is never worse than torchrun when a rank ends early, fails, or exits while
another rank waits in a plain ``torch.distributed`` collective: the job ends with a non-zero
status and one line naming the rank and what it did (issue 55). Real processes, Gloo on CPU;
the timeouts only guard against a hang, nothing here is timed."""

from __future__ import annotations

import sys
import uuid

import pytest

from conftest import one_error_line, run, shoal_env

pytestmark = pytest.mark.timeout(240)

#: Rank 1 ends as ``{end}`` says while rank 0 waits in its own all_reduce, which shoal does
#: not count: only rank 1's end can make it fail before Gloo's own timeout (30 minutes).
ENDS_EARLY = """\
import os, sys, time
import torch, torch.distributed as dist
{join}
if dist.get_rank() == 1:
    {end}
else:
    dist.all_reduce(torch.ones(3))
"""

FORKS = """\
if os.fork() == 0:  # the child keeps the rank's sockets open
        time.sleep(60)
        os._exit(0)"""

SHOAL_INIT = "import shoal; shoal.init(timeout=600)"
OWN_GROUP = "dist.init_process_group('gloo')"


def shoal_run(tmp_path, program: str, timeout: float = 90):
    (tmp_path / "job.py").write_text(program)
    return run([sys.executable, "-m", "shoal", "run", "--workers", "2", "job.py"],
               env=shoal_env(uuid.uuid4().hex), cwd=tmp_path, timeout=timeout)


@pytest.mark.parametrize("join, end, line", [
    (SHOAL_INIT, "pass", "rank 1: exited with status 0 while the others were still running"),
    (SHOAL_INIT, "raise ValueError('boom')", "rank 1: ValueError: boom"),
    (SHOAL_INIT, "os._exit(3)", "rank 1: worker process exited with code 3"),
    (SHOAL_INIT, FORKS, "rank 1: exited with status 0 while the others were still running"),
    (OWN_GROUP, "pass", "rank 1: exited with status 0 while the others were still running"),
], ids=["returns", "raises", "os._exit(3)", "forks", "returns-own-group"])
def test_a_rank_that_ends_while_another_is_in_a_plain_collective(tmp_path, join, end, line):
    """Before, a rank that returned waited at the end of the job with its connections open,
    and the job hung (the forked child, holding them too, hangs it under torchrun still)."""
    res = shoal_run(tmp_path, ENDS_EARLY.format(join=join, end=end))
    assert res.returncode == 1, res.stderr
    assert one_error_line(res.stderr).startswith(f"shoal: error: {line}"), res.stderr
    assert "has waited" not in res.stderr, res.stderr
