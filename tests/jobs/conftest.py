"""The job tests' shared fixture: a harness over the test's own Cryosleep home, CRIU required."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import require_criu
from tests.jobs.harness import Harness


@pytest.fixture
def h(cryo_home: Path) -> Harness:
    require_criu()
    return Harness(cryo_home)
