"""The pinned CRIU built with memory tracked by userfaultfd write-protect (``criu-uffd``), beside the stock one.

Why: a write-tracked pre-copy copies a job's memory while it runs and freezes it only for the pages written since
(CRIU's ``pre-dump --track-mem``, then ``dump --track-mem --prev-images-dir``). CRIU tracks writes only by the
kernel's soft-dirty bits, and kernels built without ``CONFIG_MEM_SOFT_DIRTY`` (these machines' 6.18) refuse it
("Tracking memory is not available"). Linux 6.7+ has another tracker: a userfaultfd registered with
``UFFDIO_REGISTER_MODE_WP`` in the asynchronous mode (``UFFD_FEATURE_WP_ASYNC``): a write clears the page's
write-protect bit with no fault to handle, ``PAGEMAP_SCAN`` reports the page ``PAGE_IS_WRITTEN`` and re-protects
it with ``PM_SCAN_WP_MATCHING``. The change (``core/criu_uffd.patch``, ours) makes CRIU use it when soft-dirty bits
are missing: kerndat detects it, the reset of a task's tracking re-protects its written pages instead of writing
``clear_refs``, and "changed since the parent" is ``PAGE_IS_WRITTEN`` instead of ``PAGE_IS_SOFT_DIRTY`` (CRIU 4.2
already reads page categories through ``PAGEMAP_SCAN``); the build keeps its kerndat cache under its own name.

CRIU does not register anything: whoever holds the userfaultfd does (a process whose memory is not registered
shows every page written, and is dumped whole, as without tracking). The registration lives as long as any
process holds the file, so the tracked process can hand its fd to another (``pidfd_getfd``) and close its own:
CRIU cannot dump a process holding a userfaultfd. docs/precopy.md has the design, the measurements and what is
left; capture/precopy.py runs this build in the snapshot sequence.

Built from Debian's source of the pinned version (``core/criu_source.json``: its orig tarball, pinned by SHA-256,
fetched from the same archive as the .debs), with this machine's compiler and -dev packages (``make criu-uffd``
installs them with apt), installed as ``usr/sbin/criu-uffd`` in the private prefix and run through the prefix's
loader like its ``criu``. A stamp records which source and patch it was built from; a build is redone when
either changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from cryosleep import paths
from cryosleep.core.debs import Say, arch_for, debian_mirror, output, prefix_argv, quiet, read_marker, run, sha256
from cryosleep.core.toolprefix import load_lock
from cryosleep.errors import CriuUnavailable

HERE = Path(__file__).resolve().parents[1] / "core"
SOURCE_PIN = HERE / "criu_source.json"
PATCH = HERE / "criu_uffd.patch"
BINARY = "usr/sbin/criu-uffd"
STAMP = ".criu-uffd.json"
BUILD_DEPS = ("build-essential", "pkgconf", "patch", "libprotobuf-c-dev", "protobuf-c-compiler", "libprotobuf-dev",
              "protobuf-compiler", "libnl-3-dev", "libnet1-dev", "libcap-dev", "libbsd-dev", "uuid-dev",
              "libnftables-dev", "libgnutls28-dev")
BUILD_HINT = ("run `make criu-uffd` as root (it installs the build's -dev packages with apt, then builds), or "
              "`cryosleep criu build-uffd` once they are installed")
BUILD_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Source:
    criu_version: str
    filename: str
    sha256: str
    size: int

    @property
    def basename(self) -> str:
        return Path(self.filename).name


def load_source(path: Path = SOURCE_PIN) -> Source:
    try:
        raw = json.loads(path.read_text())
        orig = raw["orig"]
        return Source(str(raw["criu_version"]), str(orig["filename"]), str(orig["sha256"]), int(orig["size"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CriuUnavailable(f"the CRIU source pin {path} is not valid", f"{type(e).__name__}: {e}",
                              "reinstall Cryosleep") from e


def _stamp(src: Source) -> dict[str, str]:
    return {"criu_version": src.criu_version, "source_sha256": src.sha256,
            "patch_sha256": hashlib.sha256(PATCH.read_bytes()).hexdigest()}


def _prefix(src: Source) -> Path:
    lock = load_lock()
    if lock.criu_version != src.criu_version:
        raise CriuUnavailable(f"the CRIU source pin is for {src.criu_version}, the lock for {lock.criu_version}",
                              "core/criu_source.json must name the version core/criu.lock.json pins",
                              "pin the source of the locked version (its .dsc lists the orig tarball's SHA-256)")
    prefix = lock.prefix_dir()
    if read_marker(prefix) is None:
        raise CriuUnavailable(f"no private CRIU {lock.criu_version} at {prefix} to build criu-uffd beside",
                              "criu-uffd runs through the private prefix's loader and libraries",
                              "run `cryosleep criu install` first")
    return prefix


def built(src: Source | None = None) -> tuple[str, ...] | None:
    """The command prefix of the installed criu-uffd, or None (not built, or built from another source or
    patch)."""
    src = src or load_source()
    try:
        prefix = _prefix(src)
        stamp = json.loads((prefix / STAMP).read_text())
    except (CriuUnavailable, OSError, ValueError):
        return None
    if stamp != _stamp(src) or not (prefix / BINARY).exists():
        return None
    return prefix_argv(prefix, arch_for(load_lock().architecture), BINARY)


def tracks(argv: tuple[str, ...]) -> tuple[bool, str]:
    """Whether this criu can track memory on this kernel (``criu check --feature mem_dirty_track``)."""
    r = subprocess.run([*argv, "check", "--feature", "mem_dirty_track"], capture_output=True, text=True,
                       timeout=120, check=False)
    return r.returncode == 0, (r.stdout + r.stderr).strip()


def _fetch(src: Source, say: Say) -> Path:
    cache = paths.criu_root() / ".debs"
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / src.basename
    if dest.exists() and dest.stat().st_size == src.size and sha256(dest) == src.sha256:
        say(f"using the cached source {dest}")
        return dest
    mirror = debian_mirror()
    url = f"{mirror.uri.rstrip('/')}/{src.filename}"
    say(f"downloading {url} (from {mirror.origin})")
    with tempfile.NamedTemporaryFile(dir=cache, prefix=".src-", delete=False) as tmp:
        try:
            with urllib.request.urlopen(url, timeout=300) as resp:
                shutil.copyfileobj(resp, tmp)
        except OSError as e:
            os.unlink(tmp.name)
            raise CriuUnavailable(f"could not download CRIU's source from {url}", f"{type(e).__name__}: {e}",
                                  "check the machine's Debian mirror ($CRYOSLEEP_DEBIAN_MIRROR)") from e
    got = Path(tmp.name)
    if got.stat().st_size != src.size or sha256(got) != src.sha256:
        got.unlink()
        raise CriuUnavailable(f"CRIU's source from {url} does not match its pin",
                              f"expected {src.size} bytes with SHA-256 {src.sha256}",
                              "the archive serves other bytes under that name: do not build from it")
    os.replace(got, dest)
    return dest


def _run(cmd: list[str], cwd: Path, what: str) -> None:
    try:
        r = run(cmd, cwd=cwd, timeout=BUILD_TIMEOUT_S)
    except FileNotFoundError as e:
        raise CriuUnavailable(f"could not {what}", f"{cmd[0]} is not installed", BUILD_HINT) from e
    if r.returncode:
        tail = "\n".join(output(r).splitlines()[-15:])
        raise CriuUnavailable(f"could not {what}", f"`{' '.join(cmd)}` exited {r.returncode}:\n{tail}", BUILD_HINT)


def build(*, force: bool = False, progress: Say | None = None) -> tuple[str, ...]:
    """Builds and installs criu-uffd if it is missing or stale; returns its command prefix."""
    say = progress or quiet
    src = load_source()
    have = built(src)
    if have is not None and not force:
        say(f"criu-uffd {src.criu_version} is built ({have[-1]})")
        return have
    prefix = _prefix(src)
    tarball = _fetch(src, say)
    with tempfile.TemporaryDirectory(prefix=".criu-uffd-build-", dir=paths.criu_root()) as td:
        tree = Path(td) / "criu"
        tree.mkdir()
        with tarfile.open(tarball) as tar:
            tar.extractall(tree, filter="data")
        tops = list(tree.iterdir())
        root = tops[0] if len(tops) == 1 and tops[0].is_dir() else tree
        say("applying core/criu_uffd.patch")
        _run(["patch", "-p1", "--forward", "--batch", "-i", str(PATCH)], root, "patch CRIU's source")
        say(f"building CRIU {src.criu_version} with the change (a few minutes)")
        _run(["make", f"-j{os.cpu_count() or 1}", "criu"], root, "build CRIU")
        staged = prefix / (BINARY + ".new")
        shutil.copyfile(root / "criu" / "criu", staged)
        staged.chmod(0o755)
        os.replace(staged, prefix / BINARY)
    (prefix / STAMP).write_text(json.dumps(_stamp(src), indent=2) + "\n")
    argv = prefix_argv(prefix, arch_for(load_lock().architecture), BINARY)
    ok, out = tracks(argv)
    say(f"criu-uffd installed at {prefix / BINARY}; memory tracking on this kernel: "
        + ("yes" if ok else f"no ({out.splitlines()[-1] if out else 'no output'})"))
    return argv


def status() -> dict[str, object]:
    src = load_source()
    argv = built(src)
    if argv is None:
        return {"criu_uffd": None, "tracks": False, "why": f"not built ({BUILD_HINT})"}
    ok, out = tracks(argv)
    return {"criu_uffd": argv[-1], "version": src.criu_version, "tracks": ok,
            "why": "" if ok else (out.splitlines()[-1] if out else "criu check failed")}
