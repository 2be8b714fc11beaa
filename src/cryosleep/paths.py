"""Where Cryosleep keeps its state on a machine.

Everything lives under one home directory, ``$CRYOSLEEP_HOME`` (default ``/var/lib/cryosleep``), so that a
test or a second installation can use its own by setting one variable:

    home/criu/<version>/   the private CRIU prefix (see capture.criu_install)
    home/jobs/<name>/      one directory per job this machine runs: state, control socket, per-rank logs
    home/store/            the default local snapshot store (``--store`` / ``$CRYOSLEEP_STORE`` override it)
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_HOME = Path("/var/lib/cryosleep")


def home() -> Path:
    return Path(os.environ.get("CRYOSLEEP_HOME") or DEFAULT_HOME)


def criu_root() -> Path:
    """Where private CRIU prefixes live (``$CRYOSLEEP_CRIU_ROOT`` lets several homes share one install)."""
    env = os.environ.get("CRYOSLEEP_CRIU_ROOT")
    return Path(env) if env else home() / "criu"


def jobs_dir() -> Path:
    return home() / "jobs"


def default_store() -> Path:
    env = os.environ.get("CRYOSLEEP_STORE")
    return Path(env) if env else home() / "store"


def native_dir() -> Path:
    """The directory holding the project's compiled helpers (cryosleep-init, the interceptor)."""
    env = os.environ.get("CRYOSLEEP_NATIVE_DIR")
    return Path(env) if env else Path(__file__).resolve().parent / "_native"
