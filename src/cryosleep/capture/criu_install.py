"""Find a usable CRIU, or install a pinned private copy of one.

Why this exists: Cryosleep needs CRIU >= 4.2. Older releases either fail ``criu check`` on recent kernels
(3.17: "Unexpected rt vDSO area bounds") or cannot dump any process holding an inet socket on kernels
>= 6.16 (4.1.1), and every PyTorch job holds one. Distributions that ship 4.2 are too new to install on
the machines we run on (it needs glibc >= 2.38), so we run Debian unstable's build from a *private prefix*:
its .debs and their library closure are unpacked under ``$CRYOSLEEP_HOME/criu/<version>/`` and started
through the prefix's own dynamic loader (``ld-linux ... --library-path PREFIX/usr/lib/... criu``). Nothing
of the system (its apt state, its libraries) is touched.

What gets installed is pinned by ``core/criu.lock.json`` (read by ``core/toolprefix.py``): the name,
version, pool filename, SHA-256 and size of every .deb (criu, nftables for the ``nft`` binary that removes a
CRIU network-lock table left by a killed dump, iproute2 for ``ip`` and ``bridge``, and their dependencies).
Every file is checked against the lock before anything is unpacked, so the lock, not the network, is the root
of trust.
``update-lock`` regenerates it from the archive when the pinned versions are superseded, or when
``ROOT_PACKAGES`` changes.

iproute2 is in the prefix because some machines have none; ``net/tools.py`` says how Cryosleep runs ``ip``,
``bridge`` and ``nft`` (the system's, else the prefix's), and every CRIU run gets ``CR_IP_TOOL`` from it.
The installer itself (the mirror, a private apt, verification, unpacking, the swap into place) is
``core/debs.py``, shared with the test S3 server's prefix.

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
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from cryosleep import paths
from cryosleep.core.debs import (
    MARKER_NAME,
    PrivateApt,
    Say,
    arch_for,
    cleanup_stale,
    debian_mirror,
    extract_deb,
    host_arch,
    install_lock,
    mismatch,
    output,
    prefix_argv,
    quiet,
    read_marker,
    run,
    swap_into_place,
)
from cryosleep.core.toolprefix import LOCK_PATH, Lock, load_lock, parse_lock, try_load_lock
from cryosleep.errors import CriuUnavailable, CryosleepError
from cryosleep.net.tools import ip_tool, iproute_argv, nft_argv, write_wrappers

__all__ = [
    "Criu",
    "install",
    "locate",
    "main",
    "make_bundle",
    "reset_cache",
    "status",
    "update_lock",
]

LOCK_MEMBER = "criu.lock.json"  # the lock's name inside a bundle

# What the prefix must provide: criu itself, nft to clean up a network-lock table after a killed dump, and
# iproute2 (ip, bridge) for the job network and for CRIU's own ``ip addr/route save|restore`` on machines
# that have no iproute2.
ROOT_PACKAGES = ("criu", "nftables", "iproute2")
# Packages never taken nor followed while resolving (none today; the closure is what apt would install).
EXCLUDED_PACKAGES: frozenset[str] = frozenset()
DEFAULT_SUITE = "unstable"
# The oldest CRIU that dumps inet sockets on the kernels we target; a system criu older than this is skipped.
MIN_VERSION = (4, 2)
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

APT_TIMEOUT_S = 900
_CHECK_TIMEOUT_S = 120


# -------------------------------------------------------------------------------------------- the handle


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


# ------------------------------------------------------------------------------------------------ checks


def _lock_bytes(raw: dict[str, Any]) -> bytes:
    return (json.dumps(raw, indent=2) + "\n").encode()


def _verify_all(lock: Lock, debs: dict[str, Path], source: str) -> None:
    """Refuse the whole set if any .deb differs from the lock: nothing is unpacked before this passes."""
    problems = [m for p in lock.packages if (m := mismatch(p, debs.get(p.name, Path("/nonexistent"))))]
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


def _version_of(argv: Sequence[str]) -> str | None:
    """What ``criu --version`` reports ("4.2.1"), or None when it does not run or says nothing usable."""
    try:
        r = run([*argv, "--version"], timeout=30, env=_criu_env())
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"Version:\s*(\S+)", r.stdout + r.stderr)
    return m.group(1) if r.returncode == 0 and m else None


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def _ip_version(argv: Sequence[str]) -> str:
    """What ``ip -V`` of the unpacked prefix says; raises CriuUnavailable when it does not run."""
    try:
        r = run([*argv, "-V"], timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        r = subprocess.CompletedProcess(list(argv), 127, "", str(e))
    if r.returncode != 0 or "iproute2" not in r.stdout + r.stderr:
        raise CriuUnavailable(
            "the unpacked iproute2 does not run",
            f"{' '.join(argv)} -V: {output(r) or f'exit code {r.returncode}'}",
            "report this; meanwhile install the system's iproute2 package, which Cryosleep prefers",
        )
    return output(r).splitlines()[0].strip()


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
        r = run([*argv, "check"], timeout=_CHECK_TIMEOUT_S, env=_criu_env() if env is None else env)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"could not run {' '.join(argv)} check: {e}"
    return r.returncode == 0, output(r)


def _verdict(output: str) -> str:
    """The line of ``criu check`` output worth showing ("Looks good."), else its last line."""
    lines = [ln for ln in output.splitlines() if ln.strip()]
    good = [ln for ln in lines if "Looks good" in ln]
    return (good or lines or ["(no output)"])[-1].strip()


# ------------------------------------------------------------------------------------ the private prefix


def _prefix_criu(prefix: Path, lock: Lock, marker: dict[str, Any] | None = None) -> Criu:
    arch = arch_for(lock.architecture)
    version = str((marker or {}).get("version") or lock.upstream_version)
    nft = prefix / "usr/sbin/nft"
    return Criu(
        argv=prefix_argv(prefix, arch, "usr/sbin/criu"),
        nft_argv=prefix_argv(prefix, arch, "usr/sbin/nft") if nft.exists() else None,
        version=version,
        source="prefix",
        prefix=prefix,
    )


def _installed_prefix(lock: Lock) -> tuple[Criu | None, str]:
    """The installed private prefix for ``lock``, or (None, why not)."""
    prefix = lock.prefix_dir()
    marker = read_marker(prefix)
    if marker is None:
        why = "not installed" if not prefix.exists() else f"no install marker {MARKER_NAME} (incomplete)"
        return None, f"no private CRIU {lock.criu_version} at {prefix} ({why})"
    criu = _prefix_criu(prefix, lock, marker)
    missing = [p for p in (criu.argv[0], criu.argv[-1]) if not Path(p).exists()]
    if missing:
        return None, f"the private CRIU at {prefix} is damaged ({', '.join(missing)} missing)"
    return criu, ""


# ------------------------------------------------------------------------------------------------ locate

_CACHE: dict[tuple[str, ...], Criu] = {}


def reset_cache() -> None:
    """Forget what :func:`locate` found (after an install, or when a test changes the environment)."""
    _CACHE.clear()


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
    lock, lock_problem = try_load_lock()
    env = os.environ.get("CRYOSLEEP_CRIU", "").strip()
    if env:
        path = Path(env)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise CriuUnavailable(
                f"$CRYOSLEEP_CRIU points at {env}, which is not an executable file",
                "the variable overrides every other way of finding CRIU",
                f"fix or unset $CRYOSLEEP_CRIU; to install a private CRIU instead, {INSTALL_HINT}",
            )
        return Criu((str(path),), nft_argv(), _version_of([str(path)]) or "unknown", "system", None)

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
                return Criu((system,), nft_argv(), version, "system", None)
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
    lock, problem = try_load_lock()
    if lock is not None:
        prefix = lock.prefix_dir()
        marker = read_marker(prefix)
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


def _cache_dir() -> Path:
    return paths.criu_root() / ".debs"


def _fetch_debs(lock: Lock, say: Say) -> dict[str, Path]:
    """The pinned .debs in the download cache, downloading those missing or not matching the lock.

    Fresh downloads are verified before they enter the cache, so the cache only ever holds pinned files.
    """
    cache = _cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    have = {p.name: cache / p.basename for p in lock.packages}
    need = [p for p in lock.packages if mismatch(p, have[p.name]) is not None]
    if not need:
        say(f"using {len(have)} cached packages from {cache}")
        return have
    mirror = debian_mirror()
    say(f"downloading {len(need)} packages from Debian {lock.suite} at {mirror.uri} (from {mirror.origin})")
    with tempfile.TemporaryDirectory(prefix=".apt-", dir=cache.parent) as td:
        apt = PrivateApt(mirror, lock.suite, lock.architecture, Path(td), install_hint=INSTALL_HINT,
                         update_hint=UPDATE_HINT)
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


def _unpack_bundle(bundle: Path, dest: Path, lock: Lock, say: Say) -> dict[str, Path]:
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


def install(*, bundle: Path | None = None, force: bool = False, progress: Say | None = None) -> Criu:
    """Install the pinned private CRIU prefix and return its handle.

    From ``bundle`` (an offline tar of the .debs and the lock) when given, else by downloading from the
    Debian mirror this machine's apt uses. Every .deb is checked against the lock before anything is
    unpacked; the tree is built in a staging directory beside the final prefix, ``criu check`` must pass
    in it, and only then is it renamed into place with a marker holding the lock's digest. When the marker
    already matches the lock the call returns at once, unless ``force``.
    """
    say = progress or quiet
    lock = load_lock()
    host = host_arch()
    if lock.architecture != host.debian:
        raise CriuUnavailable(
            f"the CRIU lock is for {lock.architecture}, this machine is {host.debian}",
            f"{LOCK_PATH} pins {lock.architecture} packages",
            f"on this machine run `python -m cryosleep.capture.criu_install update-lock` to pin "
            f"{host.debian} packages, or install criu >= 4.2 by other means and set $CRYOSLEEP_CRIU",
        )
    root = paths.criu_root()
    final = lock.prefix_dir()
    with install_lock(root):
        cleanup_stale(root)
        marker = read_marker(final)
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
                extract_deb(debs[p.name], tree)
            iproute = write_wrappers(tree, final, arch_for(lock.architecture))
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
            swap_into_place(tree, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    reset_cache()
    say(f"installed CRIU {version} at {final}")
    return _prefix_criu(final, lock, marker)


# ------------------------------------------------------------------------------------------------ bundle


def make_bundle(out: Path, *, progress: Say | None = None) -> Path:
    """Write an offline bundle (a tar of the pinned .debs and the lock) for machines with no registry.

    ``out`` is the tar's path, or an existing directory to put ``cryosleep-criu-<version>-<arch>.tar`` in.
    The .debs come from the download cache (downloaded when missing) and are verified first. The tar is
    written beside its final name and renamed, so a partial bundle is never left under that name.
    """
    say = progress or quiet
    lock = load_lock()
    out = Path(out)
    if out.is_dir():
        out = out / f"cryosleep-criu-{lock.criu_version.replace(':', '_')}-{lock.architecture}.tar"
    out.parent.mkdir(parents=True, exist_ok=True)
    with install_lock(paths.criu_root()):
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
    *, out: Path | None = None, suite: str | None = None, progress: Say | None = None
) -> Path:
    """Re-pin the lock to what the archive serves now: resolve ``ROOT_PACKAGES`` and their Depends closure
    in ``suite`` (default: the current lock's, else unstable) and record each .deb's version, pool
    filename, size and SHA-256 from the signed package index. Writes ``out`` (default: the shipped lock)."""
    say = progress or quiet
    target = Path(out) if out is not None else LOCK_PATH
    if suite is None:
        current, _ = try_load_lock()
        suite = current.suite if current is not None else DEFAULT_SUITE
    arch = host_arch()
    mirror = debian_mirror()
    say(f"resolving {' + '.join(ROOT_PACKAGES)} in Debian {suite} ({arch.debian}) at {mirror.uri}")
    with tempfile.TemporaryDirectory(prefix="cryosleep-apt-") as td:
        apt = PrivateApt(mirror, suite, arch.debian, Path(td), install_hint=INSTALL_HINT, update_hint=UPDATE_HINT)
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


# --------------------------------------------------------------------------------------------------- CLI


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
