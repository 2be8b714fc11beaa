"""The restoring agent SIGKILLed while CRIU restores (chaos seeds 309, 1025 and 1027 found it): the restore's CRIU,
the helpers it forked, the half-restored tasks or, once CRIU is done, the whole restored tree outlived the agent,
unsupervised, holding the job's addresses, and the next restore of the snapshot failed. Now the agent's watchdog
ends them (capture/orphans.py), and the job is left as it was: suspended in its snapshot, which restores and trains
on bit-identically.

Each moment is held while the agent is killed, so that the kill lands there however loaded the machine is: CRIU
just started, and CRIU with the sandbox's init forked (both with CRIU stopped: SIGKILL still ends it); CRIU done,
the restored tree whole (the agent stopped as CRIU writes the init's PID, before it reads it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cryosleep.core import proctree
from tests.jobs.chaos import of_job, ppid, restoring_agents
from tests.jobs.coordinated import wait_for
from tests.jobs.harness import Harness, criu_restores, reference, workload

pytestmark = pytest.mark.slow

SCRIPT = workload("ddp_basic")
ARGS = ["--steps", "200", "--step-sleep", "0.05"]


def _criu(store: Path) -> int:
    """The restore's CRIU itself (not what it forked)."""
    found = criu_restores(store)
    return next((p for p in found if ppid(p) not in found), 0)


# moment -> (reached, what to hold still there: "criu" or "agent")
MOMENTS: dict[str, tuple[Callable[[Path, Path], bool], str]] = {
    "criu-started": (lambda store, work: bool(_criu(store)), "criu"),
    "init-forked": (lambda store, work: (work / "restore.root").exists(), "criu"),
    "tree-restored": (lambda store, work: (work / "restore.pid").exists(), "agent"),
}


# the whole tree left running is the default suite's case; the two moments inside CRIU, the extended tier's
@pytest.mark.parametrize("moment", [pytest.param(m, marks=[] if m == "tree-restored" else [pytest.mark.extended])
                                    for m in MOMENTS])
def test_restoring_agent_killed_leaves_nothing_and_the_snapshot_restores(h: Harness, moment: str) -> None:
    store = Path(os.environ["CRYOSLEEP_STORE"])
    name = f"rkill-{moment}"
    h.run(name, SCRIPT, ARGS)
    h.wait_step(name, 5, timeout=300)
    sid = h.snapshot(name, "--stop")["snapshot"]
    assert h.wait_end(name) == 75
    work = h.job(name).path / "restore"
    reached, hold = MOMENTS[moment]
    proc = subprocess.Popen([sys.executable, "-m", "cryosleep.cli.main", "restore", "--json", "--detach", sid],
                            env=h.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    end = time.monotonic() + 300
    agent = 0
    while time.monotonic() < end and not reached(store, work):
        if not agent or not proctree.alive(agent):  # (the first found may be the detaching CLI's fork, gone since)
            agent = next(iter(restoring_agents(sid, proc.pid)), 0)
        time.sleep(0.002)
    held = _criu(store) if hold == "criu" else agent
    if hold == "criu" and held:
        agent = ppid(held)  # the agent runs CRIU
    assert agent > 1 and held, f"the restore never reached {moment} (agent {agent}, CRIU {_criu(store)})"
    os.kill(held, signal.SIGSTOP)
    os.kill(agent, signal.SIGKILL)
    proc.communicate(timeout=120)
    if moment == "tree-restored":
        assert (work / "restore.pid").exists()  # the tree was whole when its agent died
    # the watchdog ends CRIU, what it forked and what it restored: nothing of the job is left running
    wait_for(lambda: not criu_restores(store) and not of_job(name), 60, "the end of the dead agent's restore")
    # the watchdog says so once it has looked (CRIU, dying with its agent, may be gone before the watchdog runs)
    wait_for(lambda: "nothing of the restore is left running" in h.job(name).agent_log.read_text(), 60,
             "the dead agent's watchdog's verdict")
    assert h.state(name) != "running", "the job is recorded running with nothing of it left"
    h.restore(sid)  # the same snapshot, as if the first restore had never been
    assert h.wait_end(name, timeout=600) == 0, h.job(name).read()[1].detail
    ref = reference(SCRIPT, ARGS)
    for r in (0, 1):
        assert h.losses(name, r) == ref[r], f"rank {r} differs from the uninterrupted run"
