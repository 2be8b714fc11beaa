"""A private prefix of pinned Debian packages: the installer CRIU's and the test S3 server's prefixes share.

A *prefix* is a set of .debs, every one pinned by a lock (name, version, pool filename, SHA-256, size),
unpacked under a directory of Cryosleep's own and started through the prefix's own dynamic loader
(``ld-linux ... --library-path PREFIX/usr/lib/... BINARY``), so that programs built for a newer glibc run on
an older system without touching its apt state or libraries. This module is the machinery: the Debian
mirror this machine's apt already uses (:func:`debian_mirror`), a private apt run against one suite of it
with every piece of state in a scratch directory (:class:`PrivateApt`), verification of each file against
its pin before anything is unpacked (:func:`mismatch`), unpacking without dpkg (:func:`extract_deb`), the
install lock and the all-or-nothing swap into place, and how to run a program of a finished prefix
(:func:`prefix_argv`). What a prefix holds, and its lock, belong to its user: ``core/toolprefix.py`` (CRIU,
nftables, iproute2) and the test S3 server under ``tools/``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import platform
import pwd
import re
import shutil
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryosleep.errors import CriuUnavailable

__all__ = [
    "MARKER_NAME",
    "Arch",
    "LockedPackage",
    "Mirror",
    "PrivateApt",
    "Say",
    "arch_for",
    "cleanup_stale",
    "debian_mirror",
    "extract_deb",
    "host_arch",
    "install_lock",
    "mismatch",
    "output",
    "prefix_argv",
    "prefix_program",
    "quiet",
    "read_marker",
    "run",
    "sha256",
    "swap_into_place",
]

Say = Callable[[str], None]  # where an install tells what it does, one line at a time (progress=)

MARKER_NAME = ".cryosleep-installed.json"  # written last into a finished prefix: what it holds, from which lock
# Where a .deb may put a program, searched in this order.
BIN_DIRS = ("usr/sbin", "usr/bin", "sbin", "bin")

DEFAULT_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
# Suite names of the Debian archive proper (not -updates/-security/-backports, which are other archives
# or partial suites); an apt entry for one of these points at a full Debian mirror.
DEBIAN_SUITES = frozenset(
    {
        "unstable", "sid", "testing", "stable", "oldstable", "oldoldstable", "experimental",
        "stretch", "buster", "bullseye", "bookworm", "trixie", "forky", "duke",
    }
)  # fmt: skip

APT_TIMEOUT_S = 900
REFETCH_HINT = "download the packages again (install again with --force), or use a fresh offline bundle"


def quiet(_msg: str) -> None:
    """The default progress sink: installs are silent unless a caller wants to show progress."""


# -------------------------------------------------------------------------------------- a pinned package


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


# ----------------------------------------------------------------------------------------- architectures


@dataclass(frozen=True)
class Arch:
    debian: str
    multiarch: str
    loader: str


ARCHES = {
    "x86_64": Arch("amd64", "x86_64-linux-gnu", "ld-linux-x86-64.so.2"),
    "aarch64": Arch("arm64", "aarch64-linux-gnu", "ld-linux-aarch64.so.1"),
}


def host_arch() -> Arch:
    machine = platform.machine()
    arch = ARCHES.get(machine)
    if arch is None:
        raise CriuUnavailable(
            f"no private CRIU for this machine's architecture ({machine})",
            f"Cryosleep knows how to run a private CRIU prefix only on {', '.join(sorted(ARCHES))}",
            "install criu >= 4.2 by other means and point $CRYOSLEEP_CRIU at it",
        )
    return arch


def arch_for(debian: str) -> Arch:
    for a in ARCHES.values():
        if a.debian == debian:
            return a
    raise CriuUnavailable(f"unknown Debian architecture {debian!r} in a package lock", "",
                          "regenerate the lock with its update-lock command on a machine of that architecture")


# ------------------------------------------------------------------------------------------- apt sources


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


# ------------------------------------------------------------------------------------------- private apt


def run(cmd: Sequence[str], *, cwd: Path | None = None, timeout: float,
         env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ if env is None else env, LC_ALL="C", LANG="C", LANGUAGE="C")
    return subprocess.run(
        list(cmd), cwd=cwd, env=env, text=True, capture_output=True, timeout=timeout, check=False
    )


def output(r: subprocess.CompletedProcess[str]) -> str:
    return "\n".join(s.strip() for s in (r.stdout, r.stderr) if s and s.strip())


def give_to_apt_user(*dirs: Path) -> None:
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


class PrivateApt:
    """apt-get/apt-cache run against one suite of one mirror, with every piece of state in ``work``.

    The system's sources, package status, preferences (pins) and caches are all replaced, so nothing here
    can change what the system's apt sees, and the system's pins cannot change what we resolve.
    """

    def __init__(self, mirror: Mirror, suite: str, arch: str, work: Path, *, install_hint: str,
                 update_hint: str) -> None:
        """``install_hint`` and ``update_hint`` end the errors: what to do when a download fails, and when the
        pinned versions are no longer served (the prefix's owner knows its commands)."""
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
        self.install_hint = install_hint
        self.update_hint = update_hint
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
            what, f"{self.mirror.uri} (from {self.mirror.origin}): {output(r)[-3000:]}", hint
        )

    def update(self) -> None:
        r = run(["apt-get", "-q", *self.opts, "update"], timeout=APT_TIMEOUT_S)
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
        r = run(["apt-cache", *self.opts, *args], timeout=APT_TIMEOUT_S)
        if r.returncode != 0:
            raise self._fail(f"apt-cache {args[0]} failed in Debian {self.suite}", r, self.update_hint)
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
        give_to_apt_user(tmp)
        r = run(
            ["apt-get", "-q", *self.opts, "download", *(f"{p.name}={p.version}" for p in pkgs)],
            cwd=tmp,
            timeout=APT_TIMEOUT_S,
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
                    self.update_hint,
                )
            raise self._fail("downloading the pinned CRIU packages failed", r, self.install_hint)
        out: dict[str, Path] = {}
        for p in pkgs:
            exact = tmp / p.basename
            found = exact if exact.is_file() else next(iter(sorted(tmp.glob(f"{p.name}_*.deb"))), None)
            if found is None:
                raise self._fail(f"apt-get download did not produce {p.basename}", r, self.install_hint)
            target = dest / p.basename
            shutil.move(str(found), target)
            out[p.name] = target
        return out


# -------------------------------------------------------------------------------------- files and checks


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def mismatch(pkg: LockedPackage, path: Path) -> str | None:
    """Why ``path`` is not the pinned ``pkg``, or None when its size and SHA-256 match the lock."""
    if not path.is_file():
        return f"{pkg.basename} is missing"
    size = path.stat().st_size
    digest = sha256(path)
    if size != pkg.size or digest != pkg.sha256:
        return (
            f"{pkg.basename}: expected sha256 {pkg.sha256} ({pkg.size} bytes), "
            f"got sha256 {digest} ({size} bytes)"
        )
    return None


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


def extract_deb(deb: Path, dest: Path, *, use_dpkg: bool | None = None) -> None:
    """Unpack a .deb's files (not its maintainer scripts) into ``dest``, like ``dpkg -x``.

    dpkg-deb is used when present, as on any Debian or Ubuntu machine; elsewhere the .deb is read directly
    (an ar archive holding data.tar.{xz,gz,bz2}), so a bundle also installs on a host without dpkg.
    """
    if use_dpkg is None:
        use_dpkg = shutil.which("dpkg-deb") is not None
    if use_dpkg:
        r = run(["dpkg-deb", "--extract", str(deb), str(dest)], timeout=300)
        if r.returncode != 0:
            raise CriuUnavailable(f"unpacking {deb.name} failed", output(r), REFETCH_HINT)
        return
    try:
        payload = next((b, n) for n, b in _ar_members(deb.read_bytes()) if n.startswith("data.tar"))
    except (StopIteration, ValueError) as e:
        raise CriuUnavailable(f"unpacking {deb.name} failed", f"not a valid .deb: {e!r}", REFETCH_HINT) from e
    data, member = payload
    if member.endswith(".zst"):
        raise CriuUnavailable(
            f"unpacking {deb.name} failed",
            "its data is zstd-compressed and dpkg-deb is not installed",
            "install dpkg (dpkg-deb), or use a bundle of Debian packages (xz-compressed)",
        )
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        tar.extractall(dest, filter="tar")


# ------------------------------------------------------------------------------------- a finished prefix


def prefix_argv(prefix: Path, arch: Arch, binary: str, *, at: Path | None = None) -> tuple[str, ...]:
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


def read_marker(prefix: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((prefix / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def prefix_program(prefix: Path, tool: str) -> str | None:
    """Where the prefix's .debs put ``tool``, relative to the prefix (None: not there)."""
    return next((f"{d}/{tool}" for d in BIN_DIRS if (prefix / d / tool).is_file()), None)


# -------------------------------------------------------------------------------------------- installing


@contextlib.contextmanager
def install_lock(root: Path) -> Iterator[None]:
    """One install (or bundle download) at a time per CRIU root: they share staging and cache dirs."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".install.lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cleanup_stale(root: Path) -> None:
    """Remove what a crashed install left behind (only called while holding the install lock)."""
    for d in root.iterdir():
        if d.name.startswith((".install-", ".old-", ".apt-")) and d.is_dir() and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)


def swap_into_place(tree: Path, final: Path) -> None:
    """Put the finished tree at ``final`` by rename: the prefix is either complete or absent, never half
    written. A previous prefix is moved aside first and deleted after."""
    old: Path | None = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f".old-{final.name}-{os.getpid()}-{time.time_ns()}")
        final.rename(old)
    tree.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
