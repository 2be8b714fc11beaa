"""`cryosleep demo`, the main job, end to end: it must report identical losses and exit 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import require_criu
from tests.jobs.harness import Harness

pytestmark = pytest.mark.slow


def test_demo_reports_identical_losses(cryo_home: Path, tmp_path: Path) -> None:
    require_criu()
    h = Harness(cryo_home)
    res = h.cli("demo", "--json", "--steps", "40", "--out", str(tmp_path / "demo"), timeout=600)
    out = json.loads(res.stdout)
    assert out["identical"] is True and out["different_steps"] == [] and out["steps"] == 40
    assert [s["mode"] for s in out["snapshots"]] == ["keep-running", "stop"]
    assert (tmp_path / "demo" / "cryosleep-rank0.log").exists()
    assert h.ls() == []  # the demo removes its snapshots unless --keep
