"""Find a usable CRIU, or install a pinned private copy of one.

Why this exists: Cryosleep needs CRIU >= 4.2. Older releases either fail ``criu check`` on recent kernels
(3.17: "Unexpected rt vDSO area bounds") or cannot dump any process holding an inet socket on kernels
>= 6.16 (4.1.1), and every PyTorch job holds one. Distributions that ship 4.2 are too new to install on
the machines we run on (it needs glibc >= 2.38), so we run Debian unstable's build from a *private prefix*:
its .debs and their library closure are unpacked under ``$CRYOSLEEP_HOME/criu/<version>/`` and started
through the prefix's own dynamic loader (``ld-linux ... --library-path PREFIX/usr/lib/... criu``). Nothing
of the system (its apt state, its libraries) is touched.

What gets installed is pinned by ``criu.lock.json`` next to this file: the name, version, pool filename,
SHA-256 and size of every .deb (criu, nftables for the ``nft`` binary that removes a CRIU network-lock
table left by a killed dump, iproute2 for ``ip`` and ``bridge``, and their dependencies). Every file is
checked against the lock before anything is unpacked, so the lock, not the network, is the root of trust.
``update-lock`` regenerates it from the archive when the pinned versions are superseded, or when
``ROOT_PACKAGES`` changes.

iproute2 is in the prefix because some machines have none (the GPU machines: Ubuntu without iproute2)
and both the job network (``net/host.py``) and CRIU need it: CRIU execs ``$CR_IP_TOOL`` (default ``ip``
on PATH) to save and restore a network namespace's addresses and routes (criu/net.c, ``run_ip_tool``).
:func:`iproute_argv` is how Cryosleep runs ``ip``/``bridge`` (the system's, else the prefix's through its
loader), and every CRIU run gets ``CR_IP_TOOL`` from :func:`ip_tool`. CRIU execs that variable as one
program path, so the install writes ``PREFIX/wrappers/ip`` (and ``bridge``): a shell script that execs the
prefix's loader with the binary and ``"$@"``.

Machines without registry access (the GPU machines) install from an offline *bundle*: a tar of the pinned
.debs plus the lock, made with :func:`make_bundle` on a machine that has access.

The archive's address is never hard-coded: it is read from this machine's own apt sources (an entry for a
Debian suite signed by the Debian archive keyring), or from ``$CRYOSLEEP_DEBIAN_MIRROR``.

Module CLI (the main ``cryosleep criu ...`` commands call the same functions)::

    python -m cryosleep.capture.criu_install [--json] install [--bundle FILE] [--force]
    python -m cryosleep.capture.criu_install [--json] bundle OUT
    python -m cryosleep.capture.criu_install [--json] status
    python -m cryosleep.capture.criu_install [--json] update-lock [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import io
import json
import os
import platform
import pwd
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from cryosleep import paths
from cryosleep.errors import CriuUnavailable, CryosleepError, IprouteUnavailable

__all__ = [
    "IPROUTE_TOOLS",
    "LOCK_PATH",
    "Criu",
    "Lock",
    "LockedPackage",
    "Mirror",
    "Progress",
    "ProgressFn",
    "debian_mirror",
    "install",
    "ip_tool",
    "iproute_argv",
    "load_lock",
    "locate",
    "main",
    "make_bundle",
    "reset_cache",
    "status",
    "update_lock",
]

Progress = Callable[[str], None]
ProgressFn = Progress  # the name the CLI uses

LOCK_PATH = Path(__file__).with_name("criu.lock.json")
LOCK_MEMBER = "criu.lock.json"  # the lock's name inside a bundle
MARKER_NAME = ".cryosleep-installed.json"

# What the prefix must provide: criu itself, nft to clean up a network-lock table after a killed dump, and
# iproute2 (ip, bridge) for the job network and for CRIU's own ``ip addr/route save|restore`` on machines
# that have no iproute2.
ROOT_PACKAGES = ("criu", "nftables", "iproute2")
# Packages never taken nor followed while resolving (none today; the closure is what apt would install).
EXCLUDED_PACKAGES: frozenset[str] = frozenset()
# The iproute2 programs Cryosleep runs, and where the install puts a wrapper script for each in the prefix.
IPROUTE_TOOLS = ("ip", "bridge")
WRAPPERS_DIR = "wrappers"
# Where a .deb may put a program, searched in this order.
_BIN_DIRS = ("usr/sbin", "usr/bin", "sbin", "bin")
DEFAULT_SUITE = "unstable"
# The oldest CRIU that dumps inet sockets on the kernels we target; a system criu older than this is skipped.
MIN_VERSION = (4, 2)

DEFAULT_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
# Suite names of the Debian archive proper (not -updates/-security/-backports, which are other archives
# or partial suites); an apt entry for one of these points at a full Debian mirror.
DEBIAN_SUITES = frozenset(
    {
        "unstable", "sid", "testing", "stable", "oldstable", "oldoldstable", "experimental",
        "stretch", "buster", "bullseye", "bookworm", "trixie", "forky", "duke",
    }
)  # fmt: skip

INSTALL_HINT = (
    "run `cryosleep criu install` (as root, on a machine that can reach a Debian mirror); on a machine "
    "without registry access, make a bundle elsewhere with `cryosleep criu bundle OUT`, copy it over and run "
    "`cryosleep criu install --bundle OUT`; or point $CRYOSLEEP_CRIU at a working criu >= 4.2 binary"
)
UPDATE_HINT = (
    "run `python -m cryosleep.capture.criu_install update-lock` to pin the versions the archive serves now "
    "(then install again), or install from an offline bundle made while the pinned versions were served "
    "(`cryosleep criu install --bundle FILE`)"
)

_APT_TIMEOUT_S = 900
_CHECK_TIMEOUT_S = 120


def _quiet(_msg: str) -> None:
    """The default progress sink: installs are silent unless a caller wants to show progress."""


# --------------------------------------------------------------------------------------------- the handle


@dataclass(frozen=True)
class Criu:
    """How to run the CRIU (and nft) that Cryosleep should use on this machine.

    ``argv`` is the prefix of every criu command line: the binary alone for a system criu, or the private
    prefix's loader, ``--library-path`` and binary, because the prefix's glibc is newer than the system's
    and so must be loaded explicitly. ``nft_argv`` is the same for ``nft`` (None when there is none).
    """

    argv: tuple[str, ...]
    nft_argv: tuple[str, ...] | None
    version: str
    source: Literal["system", "prefix"]
    prefix: Path | None

    def command(self, *args: str) -> list[str]:
        """The full command line for ``criu ARGS``."""
        return [*self.argv, *args]

    def nft_command(self, *args: str) -> list[str]:
        """The full command line for ``nft ARGS``; raises CriuUnavailable when no nft was found."""
        if self.nft_argv is None:
            raise CriuUnavailable(
                "no nft binary to go with this CRIU",
                "nft is not on PATH and no private CRIU prefix (which carries one) is installed",
                INSTALL_HINT,
            )
        return [*self.nft_argv, *args]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment every CRIU run gets: ``base`` (default: this process's) with ``CR_IP_TOOL`` set to
        an ``ip`` that runs here (:func:`ip_tool`), because CRIU execs that variable (default: ``ip`` on PATH)
        to dump and restore a network namespace and the machine may have no iproute2. A ``CR_IP_TOOL``
        already in ``base`` is kept: the user chose it. Without any ``ip`` the variable is left unset, and
        only a CRIU run that needs one fails (the job network fails first, with :func:`iproute_argv`'s
        error)."""
        return _criu_env(base)

    def run(self, args: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        """Run ``criu ARGS``; by default captures text output and does not raise on a non-zero exit."""
        kw["env"] = self.env(kw.get("env"))
        kw.setdefault("text", True)
        if "stdout" not in kw and "stderr" not in kw:
            kw.setdefault("capture_output", True)
        kw.setdefault("check", False)
        result: subprocess.CompletedProcess[str] = subprocess.run(self.command(*args), **kw)
        return result

    def check(self) -> tuple[bool, str]:
        """Run ``criu check``: (passed, its combined output). Never raises."""
        return _criu_check(self.argv, self.env())

    def to_json(self) -> dict[str, object]:
        return {
            "argv": list(self.argv),
            "nft_argv": list(self.nft_argv) if self.nft_argv is not None else None,
            "version": self.version,
            "source": self.source,
            "prefix": str(self.prefix) if self.prefix is not None else None,
        }


# ---------------------------------------------------------------------------------------------- the lock


@dataclass(frozen=True)
class LockedPackage:
    """One pinned .deb: ``filename`` is its path in the archive's pool, relative to the mirror URI."""

    name: str
    version: str
    filename: str
    sha256: str
    size: int

    @property
    def basename(self) -> str:
        return self.filename.rsplit("/", 1)[-1]


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


def _lock_bytes(raw: dict[str, Any]) -> bytes:
    return (json.dumps(raw, indent=2) + "\n").encode()


# ------------------------------------------------------------------------------------------ architectures


@dataclass(frozen=True)
class _Arch:
    debian: str
    multiarch: str
    loader: str


_ARCHES = {
    "x86_64": _Arch("amd64", "x86_64-linux-gnu", "ld-linux-x86-64.so.2"),
    "aarch64": _Arch("arm64", "aarch64-linux-gnu", "ld-linux-aarch64.so.1"),
}


def _host_arch() -> _Arch:
    machine = platform.machine()
    arch = _ARCHES.get(machine)
    if arch is None:
        raise CriuUnavailable(
            f"no private CRIU for this machine's architecture ({machine})",
            f"Cryosleep knows how to run a private CRIU prefix only on {', '.join(sorted(_ARCHES))}",
            "install criu >= 4.2 by other means and point $CRYOSLEEP_CRIU at it",
        )
    return arch


def _arch_for(debian: str) -> _Arch:
    for a in _ARCHES.values():
        if a.debian == debian:
            return a
    raise CriuUnavailable(f"unknown Debian architecture {debian!r} in the CRIU lock", "", UPDATE_HINT)


# ----------------------------------------------------------------------------------------- apt sources


@dataclass(frozen=True)
class Mirror:
    """A Debian archive to download from, and the keyring that authenticates it."""

    uri: str
    keyring: Path | None
    origin: str  # where the URI came from: an apt sources file, or the environment


@dataclass(frozen=True)
class _AptEntry:
    types: tuple[str, ...]
    uris: tuple[str, ...]
    suites: tuple[str, ...]
    signed_by: tuple[str, ...]
    origin: str


def _parse_one_line_sources(text: str, origin: str) -> list[_AptEntry]:
    """Parse the classic ``deb [opts] URI SUITE COMPONENT...`` format of sources.list and *.list."""
    entries: list[_AptEntry] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        opts: dict[str, str] = {}
        m = re.match(r"^(\S+)\s+(?:\[([^\]]*)\]\s+)?(\S+)\s+(\S+)", line)
        if m is None:
            continue
        for opt in (m.group(2) or "").split():
            key, _, value = opt.partition("=")
            opts[key.strip().lower().rstrip("+-")] = value.strip()
        signed = tuple(s for s in re.split(r"[,\s]+", opts.get("signed-by", "")) if s)
        entries.append(_AptEntry((m.group(1),), (m.group(3),), (m.group(4),), signed, origin))
    return entries


def _parse_deb822_sources(text: str, origin: str) -> list[_AptEntry]:
    """Parse the deb822 format of *.sources (paragraphs of ``Field: value`` with continuation lines)."""
    entries: list[_AptEntry] = []
    paragraphs: list[dict[str, str]] = [{}]
    key: str | None = None
    for raw in text.splitlines():
        if raw.startswith("#"):
            continue
        if not raw.strip():
            if paragraphs[-1]:
                paragraphs.append({})
            key = None
            continue
        if raw[0] in " \t" and key is not None:
            paragraphs[-1][key] += "\n" + raw.strip()
            continue
        name, sep, value = raw.partition(":")
        if not sep:
            continue
        key = name.strip().lower()
        paragraphs[-1][key] = value.strip()
    for p in paragraphs:
        if not p or p.get("enabled", "yes").strip().lower() == "no":
            continue
        signed_by = p.get("signed-by", "").strip()
        # An inline key block (a multi-line value) is not a keyring path; keep it as one opaque value.
        signed = (signed_by,) if "\n" in signed_by else tuple(s for s in signed_by.split() if s)
        entries.append(
            _AptEntry(
                tuple(p.get("types", "").split()),
                tuple(p.get("uris", "").split()),
                tuple(p.get("suites", "").split()),
                signed,
                origin,
            )
        )
    return entries


def _is_debian_keyring(value: str) -> bool:
    name = value.rsplit("/", 1)[-1]
    return "\n" not in value and name.startswith("debian-archive-") and name.endswith((".gpg", ".asc"))


def _apt_entries(apt_etc: Path) -> list[_AptEntry]:
    entries: list[_AptEntry] = []
    main = apt_etc / "sources.list"
    files: list[Path] = [main] if main.is_file() else []
    parts = apt_etc / "sources.list.d"
    if parts.is_dir():
        files += sorted(p for p in parts.iterdir() if p.suffix in (".list", ".sources") and p.is_file())
    for f in files:
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        parse = _parse_deb822_sources if f.suffix == ".sources" else _parse_one_line_sources
        entries += parse(text, str(f))
    return entries


def debian_mirror(apt_etc: Path = Path("/etc/apt")) -> Mirror:
    """The Debian mirror this machine already uses, or ``$CRYOSLEEP_DEBIAN_MIRROR``.

    An entry qualifies when it is a binary (``deb``) entry for a Debian archive suite (bookworm, trixie,
    sid, unstable, ...). Entries signed by the Debian archive keyring win; an entry with no Signed-By at
    all (older sources.list files, trusted through apt's global keys) is the fallback; entries signed by
    any other key are third-party repositories and never qualify. The keyring used for the download is
    the full Debian archive keyring when present, because the unstable suite is signed by keys newer than
    a single release's keyring holds.
    """
    keyring = DEFAULT_KEYRING if DEFAULT_KEYRING.is_file() else None
    env = os.environ.get("CRYOSLEEP_DEBIAN_MIRROR", "").strip()
    if env:
        return Mirror(env.rstrip("/"), keyring, "$CRYOSLEEP_DEBIAN_MIRROR")
    best: tuple[int, _AptEntry] | None = None
    for e in _apt_entries(apt_etc):
        if "deb" not in e.types or not e.uris or not any(s in DEBIAN_SUITES for s in e.suites):
            continue
        if not e.uris[0].startswith(("http://", "https://", "ftp://", "file:")):
            continue
        if e.signed_by:
            if not any(_is_debian_keyring(s) for s in e.signed_by):
                continue
            rank = 0
        else:
            rank = 1
        if best is None or rank < best[0]:
            best = (rank, e)
    if best is None:
        raise CriuUnavailable(
            "cannot find a Debian mirror to download CRIU from",
            f"no entry in {apt_etc}/sources.list or {apt_etc}/sources.list.d/ is a Debian archive suite "
            "signed by the Debian archive keyring",
            "set $CRYOSLEEP_DEBIAN_MIRROR to a Debian mirror's URI, or install from an offline bundle "
            "(`cryosleep criu install --bundle FILE`)",
        )
    e = best[1]
    if keyring is None:
        keyring = next((Path(s) for s in e.signed_by if _is_debian_keyring(s) and Path(s).is_file()), None)
    return Mirror(e.uris[0].rstrip("/"), keyring, e.origin)


# ---------------------------------------------------------------------------------------- private apt


def _run(cmd: Sequence[str], *, cwd: Path | None = None, timeout: float,
         env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ if env is None else env, LC_ALL="C", LANG="C", LANGUAGE="C")
    return subprocess.run(
        list(cmd), cwd=cwd, env=env, text=True, capture_output=True, timeout=timeout, check=False
    )


def _output(r: subprocess.CompletedProcess[str]) -> str:
    return "\n".join(s.strip() for s in (r.stdout, r.stderr) if s and s.strip())


def _give_to_apt_user(*dirs: Path) -> None:
    """Let apt's sandbox user write where we ask it to download (as root it otherwise warns and then
    downloads unsandboxed). Best effort: without an ``_apt`` user there is no sandbox to satisfy."""
    if os.geteuid() != 0:
        return
    try:
        uid = pwd.getpwnam("_apt").pw_uid
    except KeyError:
        return
    for d in dirs:
        with contextlib.suppress(OSError):
            os.chown(d, uid, -1)


class _PrivateApt:
    """apt-get/apt-cache run against one suite of one mirror, with every piece of state in ``work``.

    The system's sources, package status, preferences (pins) and caches are all replaced, so nothing here
    can change what the system's apt sees, and the system's pins cannot change what we resolve.
    """

    def __init__(self, mirror: Mirror, suite: str, arch: str, work: Path) -> None:
        for tool in ("apt-get", "apt-cache"):
            if shutil.which(tool) is None:
                raise CriuUnavailable(
                    "cannot download CRIU packages: apt-get is not available on this machine",
                    f"{tool} is not on PATH",
                    "install from an offline bundle made on a Debian or Ubuntu machine "
                    "(`cryosleep criu bundle OUT` there, then `cryosleep criu install --bundle OUT` here)",
                )
        self.mirror = mirror
        self.suite = suite
        self.work = work
        work.chmod(0o755)  # apt's sandbox user must be able to reach its partial/ directories
        for d in ("lists/partial", "cache/archives/partial", "etc/preferences.d", "etc/sources.list.d"):
            (work / d).mkdir(parents=True, exist_ok=True)
        signed = f"[signed-by={mirror.keyring}] " if mirror.keyring is not None else ""
        (work / "etc/sources.list").write_text(f"deb {signed}{mirror.uri} {suite} main\n")
        self.opts = [
            f"-oDir::Etc::SourceList={work}/etc/sources.list",
            f"-oDir::Etc::SourceParts={work}/etc/sources.list.d",
            f"-oDir::Etc::Preferences={work}/etc/preferences",
            f"-oDir::Etc::PreferencesParts={work}/etc/preferences.d",
            f"-oDir::State::Lists={work}/lists",
            "-oDir::State::status=/dev/null",
            f"-oDir::Cache={work}/cache",
            f"-oAPT::Architecture={arch}",
            "-oAcquire::Languages=none",
            "-oAPT::Default-Release=",
        ]

    def _fail(self, what: str, r: subprocess.CompletedProcess[str], hint: str) -> CriuUnavailable:
        return CriuUnavailable(
            what, f"{self.mirror.uri} (from {self.mirror.origin}): {_output(r)[-3000:]}", hint
        )

    def update(self) -> None:
        r = _run(["apt-get", "-q", *self.opts, "update"], timeout=_APT_TIMEOUT_S)
        fetched = any("_Packages" in p.name for p in (self.work / "lists").iterdir())
        if r.returncode != 0 or not fetched or "Failed to fetch" in r.stdout + r.stderr:
            raise self._fail(
                f"could not fetch the package index of Debian {self.suite}",
                r,
                "check this machine's network access and proxy settings (apt's own configuration is "
                "used), set $CRYOSLEEP_DEBIAN_MIRROR to a reachable Debian mirror, or install from an "
                "offline bundle (`cryosleep criu install --bundle FILE`)",
            )

    def _cache(self, *args: str) -> str:
        r = _run(["apt-cache", *self.opts, *args], timeout=_APT_TIMEOUT_S)
        if r.returncode != 0:
            raise self._fail(f"apt-cache {args[0]} failed in Debian {self.suite}", r, UPDATE_HINT)
        return r.stdout

    def closure(self, roots: Iterable[str], exclude: frozenset[str]) -> list[str]:
        """The packages ``roots`` need (Depends and Pre-Depends, recursively, no Recommends), the way apt
        would pick them: the first alternative of an ``a | b`` group, the first provider of a virtual
        package. Packages in ``exclude`` are neither taken nor followed."""
        flags = ["--no-recommends", "--no-suggests", "--no-conflicts", "--no-breaks", "--no-replaces"]
        flags.append("--no-enhances")
        seen: set[str] = set()
        frontier = [r for r in roots if r not in exclude]
        while frontier:
            seen.update(frontier)
            wanted: set[str] = set()
            for deps in self._depends(self._cache("depends", *flags, *frontier)).values():
                for group in deps:
                    if any(name in seen or name in wanted for name in group):
                        continue  # already satisfied by an alternative we take anyway
                    chosen = next((name for name in group if name not in exclude), None)
                    if chosen is not None and chosen not in seen:
                        wanted.add(chosen)
            frontier = sorted(wanted)
        return sorted(seen)

    @staticmethod
    def _depends(text: str) -> dict[str, list[list[str]]]:
        """Parse ``apt-cache depends`` output into package -> [alternatives group -> candidate names],
        with virtual packages replaced by their providers."""
        out: dict[str, list[list[str]]] = {}
        deps: list[list[str]] | None = None
        open_group = False  # the previous line ended with "|": the next one joins its group
        for line in text.splitlines():
            if not line.startswith(" "):
                name = line.strip()
                deps = None if name.startswith("<") else out.setdefault(name, [])
                open_group = False
                continue
            if deps is None:
                continue
            m = re.match(r"^ ([ |])(Depends|PreDepends|Pre-Depends): (\S+)", line)
            if m is not None:
                target = m.group(3)
                names = [] if target.startswith("<") else [target]
                if open_group and deps:
                    deps[-1].extend(names)
                else:
                    deps.append(names)
                open_group = m.group(1) == "|"
                continue
            provider = line.strip()
            if line.startswith("    ") and deps and provider and not provider.startswith("<"):
                deps[-1].append(provider)  # a provider of the virtual package just listed
        return out

    def records(self, names: Sequence[str]) -> list[dict[str, str]]:
        """The candidate version's index record of each package (what apt-get download would fetch)."""
        text = self._cache("show", "--no-all-versions", *names)
        recs: list[dict[str, str]] = []
        cur: dict[str, str] = {}
        for line in [*text.splitlines(), ""]:
            if not line.strip():
                if cur:
                    recs.append(cur)
                cur = {}
            elif not line[0].isspace() and ":" in line:
                k, _, v = line.partition(":")
                cur[k.strip()] = v.strip()
        return recs

    def download(self, pkgs: Sequence[LockedPackage], dest: Path) -> dict[str, Path]:
        """``apt-get download`` the exact pinned versions into ``dest``, named by their pool basenames."""
        tmp = self.work / "download"
        tmp.mkdir(exist_ok=True)
        _give_to_apt_user(tmp)
        r = _run(
            ["apt-get", "-q", *self.opts, "download", *(f"{p.name}={p.version}" for p in pkgs)],
            cwd=tmp,
            timeout=_APT_TIMEOUT_S,
        )
        if r.returncode != 0:
            text = r.stdout + r.stderr
            missing = re.findall(r"Version '([^']+)' for '([^']+)' was not found", text)
            missing += [("", n) for n in re.findall(r"Unable to locate package (\S+)", text)]
            if missing or "404" in text:
                gone = ", ".join(f"{n}={v}" if v else n for v, n in missing) or "some pinned packages"
                raise self._fail(
                    f"the pinned CRIU packages are no longer served by Debian {self.suite}: {gone}",
                    r,
                    UPDATE_HINT,
                )
            raise self._fail("downloading the pinned CRIU packages failed", r, INSTALL_HINT)
        out: dict[str, Path] = {}
        for p in pkgs:
            exact = tmp / p.basename
            found = exact if exact.is_file() else next(iter(sorted(tmp.glob(f"{p.name}_*.deb"))), None)
            if found is None:
                raise self._fail(f"apt-get download did not produce {p.basename}", r, INSTALL_HINT)
            target = dest / p.basename
            shutil.move(str(found), target)
            out[p.name] = target
        return out


# ------------------------------------------------------------------------------------ files and checks


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _mismatch(pkg: LockedPackage, path: Path) -> str | None:
    """Why ``path`` is not the pinned ``pkg``, or None when its size and SHA-256 match the lock."""
    if not path.is_file():
        return f"{pkg.basename} is missing"
    size = path.stat().st_size
    digest = _sha256(path)
    if size != pkg.size or digest != pkg.sha256:
        return (
            f"{pkg.basename}: expected sha256 {pkg.sha256} ({pkg.size} bytes), "
            f"got sha256 {digest} ({size} bytes)"
        )
    return None


def _verify_all(lock: Lock, debs: dict[str, Path], source: str) -> None:
    """Refuse the whole set if any .deb differs from the lock: nothing is unpacked before this passes."""
    problems = [m for p in lock.packages if (m := _mismatch(p, debs.get(p.name, Path("/nonexistent"))))]
    if problems:
        raise CriuUnavailable(
            f"CRIU package verification failed for {source}: {problems[0].split(':')[0]}"
            + (f" and {len(problems) - 1} more" if len(problems) > 1 else ""),
            "; ".join(problems),
            "the file was corrupted or tampered with, or was made for another lock: do not use it; make a "
            "fresh bundle (`cryosleep criu bundle OUT`) on a machine with "
            "registry access, or install with download (`cryosleep criu install`)",
            files=problems,
        )


def _ar_members(data: bytes) -> Iterator[tuple[str, bytes]]:
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive")
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        pos += 60
        yield name, data[pos : pos + size]
        pos += size + (size & 1)


def _extract_deb(deb: Path, dest: Path, *, use_dpkg: bool | None = None) -> None:
    """Unpack a .deb's files (not its maintainer scripts) into ``dest``, like ``dpkg -x``.

    dpkg-deb is used when present, as on any Debian or Ubuntu machine; elsewhere the .deb is read directly
    (an ar archive holding data.tar.{xz,gz,bz2}), so a bundle also installs on a host without dpkg.
    """
    if use_dpkg is None:
        use_dpkg = shutil.which("dpkg-deb") is not None
    if use_dpkg:
        r = _run(["dpkg-deb", "--extract", str(deb), str(dest)], timeout=300)
        if r.returncode != 0:
            raise CriuUnavailable(f"unpacking {deb.name} failed", _output(r), INSTALL_HINT)
        return
    try:
        payload = next((b, n) for n, b in _ar_members(deb.read_bytes()) if n.startswith("data.tar"))
    except (StopIteration, ValueError) as e:
        raise CriuUnavailable(f"unpacking {deb.name} failed", f"not a valid .deb: {e!r}", INSTALL_HINT) from e
    data, member = payload
    if member.endswith(".zst"):
        raise CriuUnavailable(
            f"unpacking {deb.name} failed",
            "its data is zstd-compressed and dpkg-deb is not installed",
            "install dpkg (dpkg-deb), or use a bundle of Debian packages (xz-compressed)",
        )
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        tar.extractall(dest, filter="tar")


def _version_of(argv: Sequence[str]) -> str | None:
    """What ``criu --version`` reports ("4.2.1"), or None when it does not run or says nothing usable."""
    try:
        r = _run([*argv, "--version"], timeout=30, env=_criu_env())
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"Version:\s*(\S+)", r.stdout + r.stderr)
    return m.group(1) if r.returncode == 0 and m else None


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def _ip_version(argv: Sequence[str]) -> str:
    """What ``ip -V`` of the unpacked prefix says; raises CriuUnavailable when it does not run."""
    try:
        r = _run([*argv, "-V"], timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        r = subprocess.CompletedProcess(list(argv), 127, "", str(e))
    if r.returncode != 0 or "iproute2" not in r.stdout + r.stderr:
        raise CriuUnavailable(
            "the unpacked iproute2 does not run",
            f"{' '.join(argv)} -V: {_output(r) or f'exit code {r.returncode}'}",
            "report this; meanwhile install the system's iproute2 package, which Cryosleep prefers",
        )
    return _output(r).splitlines()[0].strip()


def _criu_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with CRIU's ``CR_IP_TOOL``: see :meth:`Criu.env`."""
    env = dict(os.environ if base is None else base)
    if not env.get("CR_IP_TOOL"):
        tool = ip_tool()
        if tool is not None:
            env["CR_IP_TOOL"] = tool
    return env


def _criu_check(argv: Sequence[str], env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    try:
        r = _run([*argv, "check"], timeout=_CHECK_TIMEOUT_S, env=_criu_env() if env is None else env)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"could not run {' '.join(argv)} check: {e}"
    return r.returncode == 0, _output(r)


def _verdict(output: str) -> str:
    """The line of ``criu check`` output worth showing ("Looks good."), else its last line."""
    lines = [ln for ln in output.splitlines() if ln.strip()]
    good = [ln for ln in lines if "Looks good" in ln]
    return (good or lines or ["(no output)"])[-1].strip()


# ------------------------------------------------------------------------------------- the private prefix


def _prefix_argv(prefix: Path, arch: _Arch, binary: str, *, at: Path | None = None) -> tuple[str, ...]:
    """Run ``binary`` of the prefix through the prefix's own loader: its libc is newer than the system's.

    ``at``: where the prefix will be when the command runs, when it is still being built elsewhere (the
    install's staging tree); the layout is read from ``prefix``, the paths point into ``at``."""
    at = prefix if at is None else at
    rels = [Path("usr/lib") / arch.multiarch, Path("lib") / arch.multiarch]
    libdirs = [r for r in rels if (prefix / r).is_dir()]
    loader = next((d / arch.loader for d in libdirs if (prefix / d / arch.loader).exists()), None)
    if loader is None:
        loader = rels[0] / arch.loader
    return (str(at / loader), "--library-path", ":".join(str(at / d) for d in libdirs), str(at / binary))


def _read_marker(prefix: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((prefix / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _prefix_criu(prefix: Path, lock: Lock, marker: dict[str, Any] | None = None) -> Criu:
    arch = _arch_for(lock.architecture)
    version = str((marker or {}).get("version") or lock.upstream_version)
    nft = prefix / "usr/sbin/nft"
    return Criu(
        argv=_prefix_argv(prefix, arch, "usr/sbin/criu"),
        nft_argv=_prefix_argv(prefix, arch, "usr/sbin/nft") if nft.exists() else None,
        version=version,
        source="prefix",
        prefix=prefix,
    )


def _installed_prefix(lock: Lock) -> tuple[Criu | None, str]:
    """The installed private prefix for ``lock``, or (None, why not)."""
    prefix = lock.prefix_dir()
    marker = _read_marker(prefix)
    if marker is None:
        why = "not installed" if not prefix.exists() else f"no install marker {MARKER_NAME} (incomplete)"
        return None, f"no private CRIU {lock.criu_version} at {prefix} ({why})"
    criu = _prefix_criu(prefix, lock, marker)
    missing = [p for p in (criu.argv[0], criu.argv[-1]) if not Path(p).exists()]
    if missing:
        return None, f"the private CRIU at {prefix} is damaged ({', '.join(missing)} missing)"
    return criu, ""


# --------------------------------------------------------------------------------------------- iproute2


def _prefix_program(prefix: Path, tool: str) -> str | None:
    """Where the prefix's .debs put ``tool``, relative to the prefix (None: not there)."""
    return next((f"{d}/{tool}" for d in _BIN_DIRS if (prefix / d / tool).is_file()), None)


def _wrapper_script(argv: Sequence[str]) -> str:
    return (
        "#!/bin/sh\n"
        "# Written by `cryosleep criu install`: runs this program of Cryosleep's private prefix through the\n"
        "# prefix's own loader, whose libc is newer than the system's. CRIU runs the ip one as $CR_IP_TOOL.\n"
        f"exec {' '.join(shlex.quote(a) for a in argv)} \"$@\"\n"
    )


def _write_wrappers(tree: Path, final: Path, arch: _Arch) -> dict[str, tuple[str, ...]]:
    """Write ``WRAPPERS_DIR/<tool>`` into the staging ``tree`` for each iproute2 program, pointing at the
    prefix's final place ``final``; returns how to run each one in ``tree`` (to try it before the swap)."""
    out: dict[str, tuple[str, ...]] = {}
    wrappers = tree / WRAPPERS_DIR
    wrappers.mkdir(exist_ok=True)
    for tool in IPROUTE_TOOLS:
        rel = _prefix_program(tree, tool)
        if rel is None:
            raise CriuUnavailable(
                f"the pinned packages hold no {tool} program",
                f"none of {', '.join(f'{d}/{tool}' for d in _BIN_DIRS)} exists after unpacking iproute2",
                "report this: the iproute2 package changed its layout; regenerate the lock and adapt _BIN_DIRS",
            )
        script = wrappers / tool
        script.write_text(_wrapper_script(_prefix_argv(tree, arch, rel, at=final)))
        script.chmod(0o755)
        out[tool] = _prefix_argv(tree, arch, rel)
    return out


def _iproute_why_not(tool: str) -> tuple[tuple[str, ...] | None, str]:
    """How to run the pinned prefix's ``tool`` through its loader, or (None, why not)."""
    lock, problem = _try_load_lock()
    if lock is None:
        return None, problem
    prefix = lock.prefix_dir()
    if _read_marker(prefix) is None:
        return None, f"no private CRIU prefix at {prefix} (it carries iproute2)"
    rel = _prefix_program(prefix, tool)
    if rel is None:
        return None, (
            f"the private CRIU prefix at {prefix} has no {tool}: it was installed from an older lock, "
            "without iproute2"
        )
    return _prefix_argv(prefix, _arch_for(lock.architecture), rel), ""


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
    lock, _ = _try_load_lock()
    if lock is None or _read_marker(lock.prefix_dir()) is None:
        return None
    wrapper = lock.prefix_dir() / WRAPPERS_DIR / "ip"
    return str(wrapper) if os.access(wrapper, os.X_OK) else None


# ------------------------------------------------------------------------------------------------ locate

_CACHE: dict[tuple[str, ...], Criu] = {}


def reset_cache() -> None:
    """Forget what :func:`locate` found (after an install, or when a test changes the environment)."""
    _CACHE.clear()


def _system_nft(lock: Lock | None) -> tuple[str, ...] | None:
    nft = shutil.which("nft")
    if nft is not None:
        return (nft,)
    if lock is not None:
        criu, _ = _installed_prefix(lock)
        if criu is not None:
            return criu.nft_argv
    return None


def _try_load_lock() -> tuple[Lock | None, str]:
    try:
        return load_lock(), ""
    except CryosleepError as e:
        return None, str(e).replace("\n", " ")


def locate(*, refresh: bool = False) -> Criu:
    """The CRIU to use here, first found of:

    1. ``$CRYOSLEEP_CRIU``: a criu binary used as is (no version or check gate: the user chose it);
    2. ``criu`` on PATH, if it is >= 4.2 and ``criu check`` passes;
    3. the private prefix ``$CRYOSLEEP_HOME/criu/<pinned version>/`` made by :func:`install`.

    The answer is cached per process (keyed on the variables that steer the search), because finding a
    system criu runs ``criu check``; :func:`reset_cache` or ``refresh=True`` forgets it.
    """
    key = (os.environ.get("CRYOSLEEP_CRIU", ""), str(paths.criu_root()), os.environ.get("PATH", ""))
    if not refresh and key in _CACHE:
        return _CACHE[key]
    criu = _locate()
    _CACHE[key] = criu
    return criu


def _locate() -> Criu:
    lock, lock_problem = _try_load_lock()
    env = os.environ.get("CRYOSLEEP_CRIU", "").strip()
    if env:
        path = Path(env)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise CriuUnavailable(
                f"$CRYOSLEEP_CRIU points at {env}, which is not an executable file",
                "the variable overrides every other way of finding CRIU",
                f"fix or unset $CRYOSLEEP_CRIU; to install a private CRIU instead, {INSTALL_HINT}",
            )
        return Criu((str(path),), _system_nft(lock), _version_of([str(path)]) or "unknown", "system", None)

    reasons = ["$CRYOSLEEP_CRIU is not set"]
    system = shutil.which("criu")
    if system is None:
        reasons.append("no criu on PATH")
    else:
        version = _version_of([system])
        if version is None:
            reasons.append(f"{system} --version did not report a version")
        elif _version_tuple(version) < MIN_VERSION:
            need = ".".join(map(str, MIN_VERSION))
            reasons.append(f"{system} is CRIU {version}; Cryosleep needs >= {need}")
        else:
            ok, output = _criu_check([system])
            if ok:
                return Criu((system,), _system_nft(lock), version, "system", None)
            reasons.append(f"{system} (CRIU {version}) fails `criu check`: {_verdict(output)}")

    if lock is None:
        reasons.append(lock_problem)
    else:
        criu, why = _installed_prefix(lock)
        if criu is not None:
            return criu
        reasons.append(why)
    raise CriuUnavailable("no usable CRIU found on this machine", "; ".join(reasons), INSTALL_HINT)


# ------------------------------------------------------------------------------------------------ status


def status() -> dict[str, object]:
    """What :func:`locate` finds and whether ``criu check`` passes, as plain data. Never raises."""
    out: dict[str, object] = {"available": False, "criu_root": str(paths.criu_root())}
    lock, problem = _try_load_lock()
    if lock is not None:
        prefix = lock.prefix_dir()
        marker = _read_marker(prefix)
        out["lock"] = {
            "path": str(LOCK_PATH),
            "suite": lock.suite,
            "criu_version": lock.criu_version,
            "architecture": lock.architecture,
            "packages": len(lock.packages),
            "sha256": lock.digest,
        }
        out["pinned_prefix"] = str(prefix)
        out["pinned_prefix_installed"] = marker is not None
        out["pinned_prefix_current"] = marker is not None and marker.get("lock_sha256") == lock.digest
    else:
        out["lock_error"] = problem
    try:
        out["ip"] = list(iproute_argv("ip"))
    except CryosleepError as e:
        out["ip"] = e.to_json()
    out["cr_ip_tool"] = _criu_env().get("CR_IP_TOOL")
    try:
        criu = locate(refresh=True)
    except CryosleepError as e:
        out["error"] = e.to_json()
        return out
    except Exception as e:  # status is a diagnostic: report, never raise
        out["error"] = {"error": "internal", "what": repr(e)}
        return out
    ok, output = criu.check()
    out.update(criu.to_json())
    out["available"] = ok
    out["check"] = {"ok": ok, "verdict": _verdict(output), "output": output}
    return out


# ----------------------------------------------------------------------------------------------- install


@contextlib.contextmanager
def _install_lock(root: Path) -> Iterator[None]:
    """One install (or bundle download) at a time per CRIU root: they share staging and cache dirs."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".install.lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cleanup_stale(root: Path) -> None:
    """Remove what a crashed install left behind (only called while holding the install lock)."""
    for d in root.iterdir():
        if d.name.startswith((".install-", ".old-", ".apt-")) and d.is_dir() and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)


def _cache_dir() -> Path:
    return paths.criu_root() / ".debs"


def _fetch_debs(lock: Lock, say: Progress) -> dict[str, Path]:
    """The pinned .debs in the download cache, downloading those missing or not matching the lock.

    Fresh downloads are verified before they enter the cache, so the cache only ever holds pinned files.
    """
    cache = _cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    have = {p.name: cache / p.basename for p in lock.packages}
    need = [p for p in lock.packages if _mismatch(p, have[p.name]) is not None]
    if not need:
        say(f"using {len(have)} cached packages from {cache}")
        return have
    mirror = debian_mirror()
    say(f"downloading {len(need)} packages from Debian {lock.suite} at {mirror.uri} (from {mirror.origin})")
    with tempfile.TemporaryDirectory(prefix=".apt-", dir=cache.parent) as td:
        apt = _PrivateApt(mirror, lock.suite, lock.architecture, Path(td))
        apt.update()
        landing = Path(td) / "debs"
        landing.mkdir()
        got = apt.download(need, landing)
        _verify_all(
            Lock(lock.suite, lock.criu_version, lock.architecture, tuple(need), lock.raw),
            got,
            f"the download from {mirror.uri}",
        )
        for p in need:
            os.replace(got[p.name], have[p.name])
    say(f"downloaded and verified {len(need)} packages")
    return have


def _unpack_bundle(bundle: Path, dest: Path, lock: Lock, say: Progress) -> dict[str, Path]:
    """Copy the pinned .debs out of a bundle. Only plain files named like a pinned .deb are taken, by
    base name, so a crafted member path cannot write outside ``dest``."""
    wanted = {p.basename: p for p in lock.packages}
    out: dict[str, Path] = {}
    bundle_lock: Lock | None = None
    try:
        with tarfile.open(bundle, mode="r:*") as tar:
            for member in tar:
                base = member.name.rsplit("/", 1)[-1]
                if not member.isfile():
                    continue
                src = tar.extractfile(member)
                if src is None:
                    continue
                if base == LOCK_MEMBER:
                    bundle_lock = parse_lock(json.loads(src.read()), f"{LOCK_MEMBER} in {bundle}")
                elif base in wanted:
                    with (dest / base).open("wb") as f:
                        shutil.copyfileobj(src, f)
                    out[wanted[base].name] = dest / base
    except (OSError, tarfile.TarError, ValueError) as e:
        raise CriuUnavailable(
            f"cannot read the CRIU bundle {bundle}",
            str(e),
            "check the path; make a bundle with `cryosleep criu bundle OUT`",
        ) from e
    if bundle_lock is None:
        raise CriuUnavailable(
            f"{bundle} is not a Cryosleep CRIU bundle",
            f"it holds no {LOCK_MEMBER}",
            "make a bundle with `cryosleep criu bundle OUT`",
        )
    if bundle_lock.digest != lock.digest:
        raise CriuUnavailable(
            f"the CRIU bundle {bundle} was made for a different lock than this Cryosleep's",
            f"the bundle pins criu {bundle_lock.criu_version} (lock sha256 {bundle_lock.digest[:16]}...), "
            f"this Cryosleep pins criu {lock.criu_version} (lock sha256 {lock.digest[:16]}...)",
            "make the bundle with the same Cryosleep version (same criu.lock.json) that installs it",
        )
    say(f"read {len(out)} packages from bundle {bundle}")
    return out


def _swap_into_place(tree: Path, final: Path) -> None:
    """Put the finished tree at ``final`` by rename: the prefix is either complete or absent, never half
    written. A previous prefix is moved aside first and deleted after."""
    old: Path | None = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f".old-{final.name}-{os.getpid()}-{time.time_ns()}")
        final.rename(old)
    tree.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def install(*, bundle: Path | None = None, force: bool = False, progress: Progress | None = None) -> Criu:
    """Install the pinned private CRIU prefix and return its handle.

    From ``bundle`` (an offline tar of the .debs and the lock) when given, else by downloading from the
    Debian mirror this machine's apt uses. Every .deb is checked against the lock before anything is
    unpacked; the tree is built in a staging directory beside the final prefix, ``criu check`` must pass
    in it, and only then is it renamed into place with a marker holding the lock's digest. When the marker
    already matches the lock the call returns at once, unless ``force``.
    """
    say = progress or _quiet
    lock = load_lock()
    host = _host_arch()
    if lock.architecture != host.debian:
        raise CriuUnavailable(
            f"the CRIU lock is for {lock.architecture}, this machine is {host.debian}",
            f"{LOCK_PATH} pins {lock.architecture} packages",
            f"on this machine run `python -m cryosleep.capture.criu_install update-lock` to pin "
            f"{host.debian} packages, or install criu >= 4.2 by other means and set $CRYOSLEEP_CRIU",
        )
    root = paths.criu_root()
    final = lock.prefix_dir()
    with _install_lock(root):
        _cleanup_stale(root)
        marker = _read_marker(final)
        if not force and marker is not None and marker.get("lock_sha256") == lock.digest:
            say(f"CRIU {lock.criu_version} is already installed at {final}")
            reset_cache()
            return _prefix_criu(final, lock, marker)
        staging = Path(tempfile.mkdtemp(prefix=".install-", dir=root))
        try:
            if bundle is not None:
                (staging / "debs").mkdir()
                debs = _unpack_bundle(Path(bundle), staging / "debs", lock, say)
                source = f"bundle {Path(bundle).resolve()}"
            else:
                debs = _fetch_debs(lock, say)
                source = "download"
            _verify_all(lock, debs, source)
            say(f"verified {len(lock.packages)} packages against {LOCK_PATH.name}")
            tree = staging / "prefix"
            tree.mkdir()
            for p in lock.packages:
                _extract_deb(debs[p.name], tree)
            iproute = _write_wrappers(tree, final, _arch_for(lock.architecture))
            ip_version = _ip_version(iproute["ip"])
            say(f"iproute2: {ip_version}")
            criu = _prefix_criu(tree, lock)
            version = _version_of(criu.argv)
            if version is None:
                raise CriuUnavailable(
                    f"the unpacked CRIU {lock.criu_version} does not run",
                    f"{' '.join(criu.command('--version'))} reported no version",
                    "report this; install criu >= 4.2 by other means and set $CRYOSLEEP_CRIU",
                )
            ok, output = criu.check()
            say(f"criu check: {_verdict(output)}")
            if not ok:
                raise CriuUnavailable(
                    f"`criu check` fails with the private CRIU {version}; it was not installed",
                    output or "(no output)",
                    "criu check needs root and a kernel with CRIU's features (CONFIG_CHECKPOINT_RESTORE...): "
                    "run the install as root; if it still fails, this machine cannot snapshot processes",
                )
            marker = {
                "lock_sha256": lock.digest,
                "criu_version": lock.criu_version,
                "version": version,
                "suite": lock.suite,
                "architecture": lock.architecture,
                "packages": [f"{p.name}={p.version}" for p in lock.packages],
                "source": source,
                "installed_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "check": _verdict(output),
                "iproute2": ip_version,
            }
            (tree / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
            tree.chmod(0o755)
            _swap_into_place(tree, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    reset_cache()
    say(f"installed CRIU {version} at {final}")
    return _prefix_criu(final, lock, marker)


# ------------------------------------------------------------------------------------------------ bundle


def make_bundle(out: Path, *, progress: Progress | None = None) -> Path:
    """Write an offline bundle (a tar of the pinned .debs and the lock) for machines with no registry.

    ``out`` is the tar's path, or an existing directory to put ``cryosleep-criu-<version>-<arch>.tar`` in.
    The .debs come from the download cache (downloaded when missing) and are verified first. The tar is
    written beside its final name and renamed, so a partial bundle is never left under that name.
    """
    say = progress or _quiet
    lock = load_lock()
    out = Path(out)
    if out.is_dir():
        out = out / f"cryosleep-criu-{lock.criu_version.replace(':', '_')}-{lock.architecture}.tar"
    out.parent.mkdir(parents=True, exist_ok=True)
    with _install_lock(paths.criu_root()):
        debs = _fetch_debs(lock, say)
        _verify_all(lock, debs, f"the download cache {_cache_dir()}")
        fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
                data = _lock_bytes(lock.raw)
                info = tarfile.TarInfo(LOCK_MEMBER)
                info.size, info.mode, info.mtime = len(data), 0o644, 0
                info.uname = info.gname = "root"
                tar.addfile(info, io.BytesIO(data))
                for p in sorted(lock.packages, key=lambda p: p.basename):
                    info = tar.gettarinfo(str(debs[p.name]), arcname=p.basename)
                    info.uid = info.gid = 0
                    info.uname = info.gname = "root"
                    info.mode, info.mtime = 0o644, 0
                    with debs[p.name].open("rb") as f:
                        tar.addfile(info, f)
            tmp.chmod(0o644)
            os.replace(tmp, out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    say(f"wrote {out} ({out.stat().st_size} bytes, {len(lock.packages)} packages)")
    return out


# ------------------------------------------------------------------------------------------- update-lock


def update_lock(
    *, out: Path | None = None, suite: str | None = None, progress: Progress | None = None
) -> Path:
    """Re-pin the lock to what the archive serves now: resolve ``ROOT_PACKAGES`` and their Depends closure
    in ``suite`` (default: the current lock's, else unstable) and record each .deb's version, pool
    filename, size and SHA-256 from the signed package index. Writes ``out`` (default: the shipped lock)."""
    say = progress or _quiet
    target = Path(out) if out is not None else LOCK_PATH
    if suite is None:
        current, _ = _try_load_lock()
        suite = current.suite if current is not None else DEFAULT_SUITE
    arch = _host_arch()
    mirror = debian_mirror()
    say(f"resolving {' + '.join(ROOT_PACKAGES)} in Debian {suite} ({arch.debian}) at {mirror.uri}")
    with tempfile.TemporaryDirectory(prefix="cryosleep-apt-") as td:
        apt = _PrivateApt(mirror, suite, arch.debian, Path(td))
        apt.update()
        names = apt.closure(ROOT_PACKAGES, EXCLUDED_PACKAGES)
        records = {r["Package"]: r for r in apt.records(names) if "Package" in r}
    missing = [n for n in names if n not in records]
    if missing:
        raise CriuUnavailable(
            f"the package index of Debian {suite} has no record for: {', '.join(missing)}", "", UPDATE_HINT
        )
    packages = []
    for name in names:
        r = records[name]
        try:
            packages.append(
                {
                    "name": name,
                    "version": r["Version"],
                    "filename": r["Filename"],
                    "sha256": r["SHA256"],
                    "size": int(r["Size"]),
                }
            )
        except (KeyError, ValueError) as e:
            raise CriuUnavailable(f"the index record of {name} lacks {e}", str(r), UPDATE_HINT) from e
    raw = {
        "suite": suite,
        "criu_version": records["criu"]["Version"],
        "architecture": arch.debian,
        "roots": list(ROOT_PACKAGES),
        "packages": packages,
    }
    parse_lock(raw, "generated")  # refuse to write a lock we could not read back
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(_lock_bytes(raw))
    Path(tmp_name).chmod(0o644)
    os.replace(tmp_name, target)
    say(f"pinned criu {raw['criu_version']} and {len(packages) - 1} other packages in {target}")
    return target


# ---------------------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cryosleep.capture.criu_install``: install, bundle, status, update-lock."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    parser = argparse.ArgumentParser(
        prog="python -m cryosleep.capture.criu_install",
        description="Install, bundle and inspect Cryosleep's private CRIU.",
        parents=[common],
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("install", parents=[common], help="install the pinned private CRIU")
    p.add_argument("--bundle", type=Path, help="install from this offline bundle instead of downloading")
    p.add_argument("--force", action="store_true", help="reinstall even if already installed")
    p = sub.add_parser("bundle", parents=[common], help="write an offline bundle of the pinned packages")
    p.add_argument("out", type=Path, help="the tar to write, or a directory to write it in")
    sub.add_parser("status", parents=[common], help="show which CRIU would be used and whether it works")
    p = sub.add_parser("update-lock", parents=[common], help="re-pin the lock to the archive's versions")
    p.add_argument("--out", type=Path, help=f"write here instead of {LOCK_PATH}")
    p.add_argument("--suite", help="Debian suite to pin from (default: the current lock's)")
    args = parser.parse_args(argv)
    as_json = bool(getattr(args, "json", False))

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    result: dict[str, object]
    try:
        if args.cmd == "install":
            result = install(bundle=args.bundle, force=args.force, progress=say).to_json()
        elif args.cmd == "bundle":
            result = {"bundle": str(make_bundle(args.out, progress=say))}
        elif args.cmd == "status":
            result = status()
        else:
            result = {"lock": str(update_lock(out=args.out, suite=args.suite, progress=say))}
    except CryosleepError as e:
        if as_json:
            print(json.dumps(e.to_json(), indent=2))
        else:
            print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if as_json:
        print(json.dumps(result, indent=2))
    elif args.cmd == "status":
        for k, v in result.items():
            if k != "check":
                print(f"{k}: {v}")
        check = result.get("check")
        if isinstance(check, dict):
            print(f"criu check: {check.get('verdict')}")
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    return 0 if args.cmd != "status" or result.get("available") else 1


if __name__ == "__main__":
    sys.exit(main())
