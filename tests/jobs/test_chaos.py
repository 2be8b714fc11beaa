"""The chaos suite's bounded run in CI (tests/jobs/chaos.py): rounds of a real job with a victim killed at a
random moment of a snapshot or a restore, each judged against the contract. Each round's seed is the first
from ``CRYOSLEEP_CHAOS_SEED`` (default: a fixed one, so that CI is repeatable) whose plan has the round's victim;
bench/chaos.py runs the long version. The default suite has three rounds (a DataLoader worker, the disk filling up,
the restore's CRIU: victims no fixed-moment test covers; the agent, CRIU and a rank in a snapshot have tests of
their own in test_criu_faults.py and test_reliability.py); the rest are in the extended tier, with three of the
two-node rounds (the agent, CRIU and the host daemon: about 5 minutes); the other two (the coordinator, a rank:
victims test_reliability.py's fixed-moment tests cover) are in the chaos tier, `make test-chaos` (all five)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import require_criu
from tests.jobs import chaos, chaos_multinode
from tests.jobs.harness import Harness

pytestmark = pytest.mark.slow

BASE = int(os.environ.get("CRYOSLEEP_CHAOS_SEED") or 300)
# (victim, what it dies in, the delay's anchor: CRIU's start, so that the fault lands in the dump or restore
# however loaded the machine is; None: any)
DEFAULT = [("worker", "snapshot", "criu"), ("disk", "snapshot", "criu"), ("criu", "restore", "criu")]
EXTENDED = [("rank", "snapshot", None), ("criu", "snapshot", "criu"), ("agent", "snapshot", "criu"),
            ("s3", "snapshot", None), ("agent", "restore", None), ("s3", "restore", None)]


def _round(cryo_home: Path, victim: str, phase: str, anchor: str | None) -> None:
    require_criu()
    if victim == "s3":
        from tests.store.conftest import require_radosgw

        require_radosgw()
    plan = chaos.Plan.of(chaos.seed_for(BASE, victim, phase, anchor))
    res = chaos.run_round(Harness(cryo_home), plan)
    assert res.ok, (f"seed {plan.seed}: {plan.describe()} ({res.moment}, "
                    f"{'killed' if res.killed else 'absent'}) -> {res.outcome}:\n  " + "\n  ".join(res.problems)
                    + f"\nreplay: {plan.replay()}")


@pytest.mark.parametrize(("victim", "phase", "anchor"), DEFAULT, ids=[f"{p}-{v}" for v, p, _ in DEFAULT])
def test_chaos_round(cryo_home: Path, victim: str, phase: str, anchor: str | None) -> None:
    _round(cryo_home, victim, phase, anchor)


@pytest.mark.extended
@pytest.mark.parametrize(("victim", "phase", "anchor"), EXTENDED, ids=[f"{p}-{v}" for v, p, _ in EXTENDED])
def test_chaos_round_extended(cryo_home: Path, victim: str, phase: str, anchor: str | None) -> None:
    _round(cryo_home, victim, phase, anchor)


TWO_NODES_CI = ("agent", "criu", "host-daemon")


@pytest.mark.chaos
@pytest.mark.parametrize("victim", [pytest.param(v, marks=[pytest.mark.extended] if v in TWO_NODES_CI else [])
                                    for v in chaos_multinode.VICTIMS])
def test_chaos_round_two_nodes(cryo_home: Path, tmp_path: Path, victim: str) -> None:
    require_criu()
    plan = chaos_multinode.MnPlan.of(chaos_multinode.seed_for(BASE, victim))
    res = chaos_multinode.run_round(cryo_home, plan, tmp_path)
    assert res.ok, (f"seed {plan.seed}: {plan.describe()} ({res.moment}, {'killed' if res.killed else 'absent'}) "
                    f"-> {res.outcome}:\n  " + "\n  ".join(res.problems) + f"\nreplay: {plan.replay()}")
