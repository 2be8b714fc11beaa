"""Where the network tools run from: iproute2's ``ip`` and ``bridge``, and ``nft``.

The system's when they are on PATH, else the private tool prefix's (``core/toolprefix.py``), run through
the prefix's own loader. iproute2 is in the prefix because some machines have none (the GPU machines:
Ubuntu without iproute2), and both the job network (``net/host.py``) and CRIU need it: CRIU execs
``$CR_IP_TOOL`` (default ``ip`` on PATH) to save and restore a network namespace's addresses and routes,
as one program path, so the prefix's install writes ``PREFIX/wrappers/ip`` (and ``bridge``,
:func:`write_wrappers`): a shell script that execs the prefix's loader with the binary and ``"$@"``.
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Sequence
from pathlib import Path

from cryosleep.core import toolprefix
from cryosleep.core.debs import BIN_DIRS, Arch, arch_for, prefix_argv, prefix_program, read_marker
from cryosleep.errors import CriuUnavailable, IprouteUnavailable

__all__ = ["IPROUTE_TOOLS", "WRAPPERS_DIR", "ip_tool", "iproute_argv", "nft_argv", "write_wrappers"]

# The iproute2 programs Cryosleep runs, and where the install puts a wrapper script for each in the prefix.
IPROUTE_TOOLS = ("ip", "bridge")
WRAPPERS_DIR = "wrappers"


def _wrapper_script(argv: Sequence[str]) -> str:
    return (
        "#!/bin/sh\n"
        "# Written by `cryosleep criu install`: runs this program of Cryosleep's private prefix through the\n"
        "# prefix's own loader, whose libc is newer than the system's. CRIU runs the ip one as $CR_IP_TOOL.\n"
        f"exec {' '.join(shlex.quote(a) for a in argv)} \"$@\"\n"
    )


def write_wrappers(tree: Path, final: Path, arch: Arch) -> dict[str, tuple[str, ...]]:
    """Write ``WRAPPERS_DIR/<tool>`` into the staging ``tree`` for each iproute2 program, pointing at the
    prefix's final place ``final``; returns how to run each one in ``tree`` (to try it before the swap)."""
    out: dict[str, tuple[str, ...]] = {}
    wrappers = tree / WRAPPERS_DIR
    wrappers.mkdir(exist_ok=True)
    for tool in IPROUTE_TOOLS:
        rel = prefix_program(tree, tool)
        if rel is None:
            raise CriuUnavailable(
                f"the pinned packages hold no {tool} program",
                f"none of {', '.join(f'{d}/{tool}' for d in BIN_DIRS)} exists after unpacking iproute2",
                "report this: the iproute2 package changed its layout; regenerate the lock and adapt BIN_DIRS",
            )
        script = wrappers / tool
        script.write_text(_wrapper_script(prefix_argv(tree, arch, rel, at=final)))
        script.chmod(0o755)
        out[tool] = prefix_argv(tree, arch, rel)
    return out


def _iproute_why_not(tool: str) -> tuple[tuple[str, ...] | None, str]:
    """How to run the pinned prefix's ``tool`` through its loader, or (None, why not)."""
    lock, problem = toolprefix.try_load_lock()
    if lock is None:
        return None, problem
    prefix = lock.prefix_dir()
    if read_marker(prefix) is None:
        return None, f"no private CRIU prefix at {prefix} (it carries iproute2)"
    rel = prefix_program(prefix, tool)
    if rel is None:
        return None, (
            f"the private CRIU prefix at {prefix} has no {tool}: it was installed from an older lock, "
            "without iproute2"
        )
    return prefix_argv(prefix, arch_for(lock.architecture), rel), ""


def iproute_argv(tool: str = "ip") -> tuple[str, ...]:
    """The argv prefix that runs iproute2's ``tool`` (``ip`` or ``bridge``) on this machine: the system's
    when it is on PATH, else the private prefix's, through the prefix's loader the way criu itself is run.

    Raises IprouteUnavailable, saying what is missing and how to get it, when there is neither."""
    if tool not in IPROUTE_TOOLS:
        raise ValueError(f"not an iproute2 program Cryosleep runs: {tool!r}")
    system = shutil.which(tool)
    if system is not None:
        return (system,)
    argv, why = _iproute_why_not(tool)
    if argv is not None:
        return argv
    raise IprouteUnavailable(
        f"iproute2's {tool} is not available on this machine",
        f"no {tool} on PATH ({os.environ.get('PATH', '')}); {why}",
        "install Cryosleep's private CRIU prefix, which carries iproute2: `cryosleep criu install` (as "
        "root), or on a machine without registry access `cryosleep criu install --bundle FILE` with a bundle "
        "made elsewhere by `cryosleep criu bundle FILE`; or install the system's iproute2 package",
    )


def ip_tool() -> str | None:
    """One executable path for CRIU's ``$CR_IP_TOOL`` (CRIU execs it as a single program, so the prefix's
    ``ip`` is given as its wrapper script): the system's ``ip`` on PATH, else ``PREFIX/wrappers/ip``;
    None when there is neither."""
    system = shutil.which("ip")
    if system is not None:
        return system
    lock, _ = toolprefix.try_load_lock()
    if lock is None or read_marker(lock.prefix_dir()) is None:
        return None
    wrapper = lock.prefix_dir() / WRAPPERS_DIR / "ip"
    return str(wrapper) if os.access(wrapper, os.X_OK) else None


def nft_argv() -> tuple[str, ...] | None:
    """How to run ``nft`` here: the system's on PATH, else the installed tool prefix's; None without either."""
    nft = shutil.which("nft")
    if nft is not None:
        return (nft,)
    lock, prefix, _ = toolprefix.installed()
    if lock is None or prefix is None or not (prefix / "usr/sbin/nft").exists():
        return None
    return prefix_argv(prefix, arch_for(lock.architecture), "usr/sbin/nft")
