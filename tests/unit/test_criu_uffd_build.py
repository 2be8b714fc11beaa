"""criu-uffd's build rules without building (tests/native/test_criu_uffd.py runs the built one): the source pin is
read strictly, must name the version the lock pins, and a build from another source or patch is not taken."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cryosleep.capture import criu_uffd
from cryosleep.core.toolprefix import load_lock
from cryosleep.errors import CriuUnavailable


def test_the_shipped_pin_names_the_locked_version_and_a_debian_orig_tarball() -> None:
    src = criu_uffd.load_source()
    assert src.criu_version == load_lock().criu_version
    assert src.filename.startswith("pool/main/c/criu/") and src.basename.endswith(".orig.tar.xz")
    assert len(src.sha256) == 64 and src.size > 0
    assert criu_uffd.PATCH.read_text().count("PAGE_IS_WRITTEN") >= 2


@pytest.mark.parametrize("text", ["", "{}", '{"criu_version": "4.2.1-1", "orig": {"filename": "x"}}', "[1]"])
def test_a_broken_pin_is_refused_with_the_file_named(tmp_path: Path, text: str) -> None:
    pin = tmp_path / "pin.json"
    pin.write_text(text)
    with pytest.raises(CriuUnavailable) as e:
        criu_uffd.load_source(pin)
    assert str(pin) in e.value.what


def test_a_pin_of_another_version_than_the_lock_is_refused() -> None:
    src = criu_uffd.load_source()
    other = criu_uffd.Source("9.9-1", src.filename, src.sha256, src.size)
    assert criu_uffd.built(other) is None
    with pytest.raises(CriuUnavailable) as e:
        criu_uffd._prefix(other)
    assert "9.9-1" in e.value.what and "lock" in e.value.what


def test_a_build_from_another_patch_is_not_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if criu_uffd.built() is None:
        pytest.skip("criu-uffd is not built here (make criu-uffd)")
    patch = tmp_path / "other.patch"
    patch.write_text(criu_uffd.PATCH.read_text() + "\n")
    monkeypatch.setattr(criu_uffd, "PATCH", patch)
    assert criu_uffd.built() is None
    assert json.loads((load_lock().prefix_dir() / criu_uffd.STAMP).read_text())["patch_sha256"] != \
        criu_uffd._stamp(criu_uffd.load_source())["patch_sha256"]
