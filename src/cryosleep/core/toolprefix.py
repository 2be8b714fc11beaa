"""Cryosleep's private tool prefix: CRIU, nftables and iproute2 from Debian, pinned by ``criu.lock.json``.

The lock next to this file pins every .deb of the prefix (criu; nftables for the ``nft`` that removes a CRIU
network-lock table left by a killed dump and runs the job network's gateway; iproute2 for ``ip`` and
``bridge``; and their library closure). This module reads the lock and says where its prefix is installed;
installing it is CRIU's provisioning (``capture/criu_install.py``, on the installer in ``core/debs.py``),
and running the network tools from it is ``net/tools.py``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryosleep import paths
from cryosleep.core.debs import LockedPackage, read_marker
from cryosleep.errors import CryosleepError

__all__ = ["LOCK_PATH", "Lock", "installed", "load_lock", "parse_lock", "try_load_lock"]

LOCK_PATH = Path(__file__).with_name("criu.lock.json")


@dataclass(frozen=True)
class Lock:
    """The parsed ``criu.lock.json``. ``digest`` identifies its content (not its formatting)."""

    suite: str
    criu_version: str
    architecture: str
    packages: tuple[LockedPackage, ...]
    raw: dict[str, Any]

    @property
    def digest(self) -> str:
        canonical = json.dumps(self.raw, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @property
    def upstream_version(self) -> str:
        """The CRIU release ("4.2.1") inside the Debian version ("4.2.1-1"): what ``criu --version`` says."""
        return _upstream_version(self.criu_version)

    def prefix_dir(self) -> Path:
        """Where this lock's private prefix lives: one directory per pinned Debian version."""
        return paths.criu_root() / self.criu_version.replace(":", "_").replace("/", "_")


def _upstream_version(debian_version: str) -> str:
    v = debian_version.split(":", 1)[-1]
    return v.rsplit("-", 1)[0] if "-" in v else v


def _lock_error(origin: str, why: str) -> CryosleepError:
    return CryosleepError(
        f"the CRIU lock {origin} is not valid",
        why,
        "restore it from the Cryosleep source tree, or regenerate it with "
        "`python -m cryosleep.capture.criu_install update-lock`",
    )


def parse_lock(data: object, origin: str) -> Lock:
    """Validate a decoded lock; anything malformed is an error naming ``origin``."""
    if not isinstance(data, dict):
        raise _lock_error(origin, "it is not a JSON object")
    try:
        suite = str(data["suite"])
        criu_version = str(data["criu_version"])
        architecture = str(data.get("architecture", "amd64"))
        items = data["packages"]
        if not isinstance(items, list) or not items:
            raise _lock_error(origin, "'packages' is not a non-empty list")
        packages = tuple(
            LockedPackage(
                name=str(p["name"]),
                version=str(p["version"]),
                filename=str(p["filename"]),
                sha256=str(p["sha256"]).lower(),
                size=int(p["size"]),
            )
            for p in items
        )
    except (KeyError, TypeError, ValueError) as e:
        raise _lock_error(origin, f"missing or malformed field: {e!r}") from e
    for p in packages:
        if not re.fullmatch(r"[0-9a-f]{64}", p.sha256):
            raise _lock_error(origin, f"package {p.name}: sha256 {p.sha256!r} is not 64 hex digits")
        if not p.basename.endswith(".deb") or p.basename in (".", ".."):
            raise _lock_error(origin, f"package {p.name}: filename {p.filename!r} is not a .deb")
    if not any(p.name == "criu" and p.version == criu_version for p in packages):
        raise _lock_error(origin, f"criu {criu_version} is not among its packages")
    return Lock(suite, criu_version, architecture, packages, dict(data))


def load_lock(path: Path | None = None) -> Lock:
    """Read the pinned lock (by default the one shipped with Cryosleep)."""
    path = path or LOCK_PATH
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise _lock_error(str(path), "the file does not exist") from e
    except (OSError, ValueError) as e:
        raise _lock_error(str(path), str(e)) from e
    return parse_lock(data, str(path))


def try_load_lock() -> tuple[Lock | None, str]:
    """The shipped lock, or (None, why it cannot be read)."""
    try:
        return load_lock(), ""
    except CryosleepError as e:
        return None, str(e).replace("\n", " ")


def installed() -> tuple[Lock | None, Path | None, str]:
    """The lock and its installed prefix, or the lock and None (with why) when the prefix is not installed
    (no marker: absent or incomplete)."""
    lock, problem = try_load_lock()
    if lock is None:
        return None, None, problem
    prefix = lock.prefix_dir()
    if read_marker(prefix) is None:
        return lock, None, f"no private CRIU prefix at {prefix}"
    return lock, prefix, ""
