"""The chaos suite's bounded run in CI (tests/jobs/chaos.py): a few rounds of a real job with a random victim
killed at a random moment of a snapshot, each judged against the contract. ``CRYOSLEEP_CHAOS_SEED`` picks the
seed (default: a fixed one, so that CI is repeatable); bench/chaos.py runs the long version."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import require_criu
from tests.jobs import chaos
from tests.jobs.harness import Harness

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("CRYOSLEEP_CHAOS_SEED") or 169)  # its 3 rounds: a rank, CRIU, the agent; both modes
ROUNDS = 3


@pytest.mark.parametrize("i", range(ROUNDS))
def test_chaos_round(cryo_home: Path, i: int) -> None:
    require_criu()
    res = chaos.run_round(Harness(cryo_home), chaos.Plan.of(SEED + i))
    assert res.ok, (f"seed {res.plan.seed}: {res.plan.mode} snapshot, {res.plan.victim} killed at "
                    f"{res.plan.anchor} + {res.plan.delay} s ({res.moment}) -> {res.outcome}:\n  "
                    + "\n  ".join(res.problems)
                    + f"\nreplay: {res.plan.replay()} (or CRYOSLEEP_CHAOS_SEED={res.plan.seed - i})")
