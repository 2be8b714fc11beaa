"""The frameworks people train with, each run unchanged under ``cryosleep run`` (tests/jobs/workloads/frameworks/:
one small script each, knowing nothing of Cryosleep), through one cycle: a keep-running snapshot, a stop snapshot,
a restore; every step's loss and parameter digest on every rank equal, bit for bit, to the same script's under
plain torchrun. Nothing is downloaded: the models are built from configs, the data made in code, and the Hugging
Face hub is off (docs/frameworks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import require_criu
from tests.jobs.harness import Harness, keep_stop_restore, workload

# minutes each on a busy 2-core machine (a framework job twice, with its imports and compiles): the default 600 s
# is a hang guard too tight for them there
pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(1800)]

STEPS = ["--steps", "20", "--step-sleep", "0.1"]  # held after step 10 until the stop snapshot is done


@pytest.fixture
def h(cryo_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Harness:
    require_criu()
    # no hub, no telemetry, caches the test owns (the reference run under torchrun sees the same environment)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return Harness(cryo_home)


def test_hugging_face_trainer_ddp_with_dataloader_workers(h: Harness, tmp_path: Path) -> None:
    keep_stop_restore(h, "hf", workload("frameworks/hf_trainer"), [*STEPS, "--workdir", str(tmp_path / "hf-out")],
                      tmp_path / "go")


def test_fsdp2_fully_shard_on_gloo(h: Harness, tmp_path: Path) -> None:
    keep_stop_restore(h, "fsdp2", workload("frameworks/fsdp2"), STEPS, tmp_path / "go")


def test_ddp_under_torch_compile(h: Harness, tmp_path: Path) -> None:
    keep_stop_restore(h, "compiled", workload("frameworks/compile_ddp"), STEPS, tmp_path / "go")
    assert list((tmp_path / "inductor").rglob("*.so")), "inductor built no kernels: nothing compiled was restored"


def test_lightning_trainer_ddp_strategy(h: Harness, tmp_path: Path) -> None:
    keep_stop_restore(h, "lightning", workload("frameworks/lightning_ddp"),
                      [*STEPS, "--workdir", str(tmp_path / "pl-out")], tmp_path / "go")
    for r in (0, 1):  # Lightning took the launcher's two processes, it started none of its own
        assert f"lightning rank {r} of 2" in h.job("lightning").rank_log(r).read_text()


def test_stateful_dataloader_workers(h: Harness, tmp_path: Path) -> None:
    keep_stop_restore(h, "stateful", workload("frameworks/stateful_loader"), STEPS, tmp_path / "go")
