"""Files the job writes, and files it reads under /tmp, /dev/shm or /run (which the destination will not
have): staged at the dump, brought back to their state at the snapshot on restore. Files it only reads or
maps elsewhere (libraries, datasets): recorded at the dump, checked at restore (``expected``).

CRIU restores a process's open files by path and trusts they are as they were. A job keeps appending to
its logs after a keep-running snapshot, so restoring that older snapshot must first put every such file
back to its size and content at the dump (otherwise the restored job would carry on after lines it never
wrote, or CRIU refuses the restore). The copy is taken while CRIU holds the tree frozen (its post-dump
hook), so it is exactly what CRIU saw.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryosleep.core import proctree
from cryosleep.errors import RestoreFailed
from cryosleep.store.manifest import ExpectedFile, StagedFile

# Files up to this size are copied whole into the snapshot; larger ones are restored by truncation alone
# (after checking that the bytes before the cut are unchanged).
DEFAULT_COPY_LIMIT = 256 * 1024 * 1024
TAIL = 64 * 1024
STAGED_INDEX = "staged.json"
EXPECTED_INDEX = "expected.json"
# Not files a restore could find changed: the kernel's and the devices' (GPU device files are not regular).
NOT_EXPECTED = ("/proc/", "/sys/", "/dev/")


# Where files do not outlive the machine (or a reboot): one the job reads there is staged like one it
# writes, since the destination will not have it.
VOLATILE = ("/tmp/", "/dev/shm/", "/run/")


@dataclass(frozen=True)
class Held:
    """What a (frozen) tree holds, from one pass over /proc: ``staged``, the regular files held open for
    writing by any of its processes and those it holds open or maps under VOLATILE; ``held``, every path
    it holds open or maps; each path once, in tree order."""

    staged: list[str]
    held: list[str]


def scan(root_pid: int) -> Held:
    held: dict[str, None] = {}
    staged: dict[str, None] = {}
    for pid in proctree.tree(root_pid):
        maps = sorted(proctree.maps_paths(pid))
        wanted = [m for m in maps if m.startswith(VOLATILE)]
        for f in proctree.open_files(pid):
            if f.is_path:
                held.setdefault(f.target, None)
                if f.writable or f.target.startswith(VOLATILE):
                    wanted.append(f.target)
        for m in maps:
            held.setdefault(m, None)
        for path in wanted:
            if path.endswith(" (deleted)"):
                continue
            try:
                st = os.stat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                staged.setdefault(path, None)
    return Held(list(staged), list(held))


def writable_files(root_pid: int) -> list[str]:
    """Regular files held open for writing by any process of the tree, and files it holds open or maps
    under VOLATILE, each path once, in tree order."""
    return scan(root_pid).staged


def copy_workers(n: int) -> int:
    """Threads for ``n`` independent copies of large files (hashlib and file I/O release the GIL)."""
    return max(1, min(n, 16, max(2, os.cpu_count() or 2)))


def copy_hashed(src: str | Path, dst: str | Path, size: int, block: int = 8 << 20, *, src_off: int = 0,
                dst_off: int | None = None, dst_dir_fd: int | None = None) -> str:
    """Copy ``size`` bytes of file ``src`` from ``src_off`` to ``dst`` and return their SHA-256 (one read).
    ``dst_off`` None: ``dst`` is created (truncated) and written from its start; else the bytes go at that
    offset of the existing file ``dst`` (several threads may fill one file so, each its own range).
    ``dst_dir_fd``: ``dst`` is a name in that directory (:func:`open_dir`); a link there is not followed."""
    h = hashlib.sha256()
    fin = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        flags = os.O_WRONLY | os.O_CLOEXEC | (os.O_CREAT | os.O_TRUNC if dst_off is None else 0)
        if dst_dir_fd is not None:
            flags |= os.O_NOFOLLOW
        fout = os.open(dst, flags, 0o600, dir_fd=dst_dir_fd)
        try:
            buf = bytearray(block)
            view = memoryview(buf)
            pos_in, pos_out, left = src_off, dst_off or 0, size
            while left > 0:
                n = os.preadv(fin, [view[:min(block, left)]], pos_in)
                if not n:
                    raise OSError(errno.EIO, f"{src} ended {left} bytes early")
                h.update(view[:n])
                done = 0
                while done < n:  # a write may be short
                    done += os.pwrite(fout, view[done:n], pos_out + done)
                pos_in, pos_out, left = pos_in + n, pos_out + n, left - n
        finally:
            os.close(fout)
    finally:
        os.close(fin)
    return h.hexdigest()


def copy_prefix(src: int, dst: int, size: int) -> None:
    """Copy the first ``size`` bytes of ``src`` to ``dst``: in the kernel where it can, else by reads."""
    left = size
    try:
        while left > 0:
            n = os.copy_file_range(src, dst, left)
            if n == 0:
                return
            left -= n
        return
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
    while left > 0:  # across filesystems (the store on another disk than the job's files)
        block = os.pread(src, min(left, 1 << 20), size - left)
        if not block:
            return
        os.write(dst, block)
        left -= len(block)


def _hash_range(path: str, start: int, end: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start
        while left > 0:
            block = f.read(min(left, 1 << 20))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def stage(root_pid: int, dest: Path, copy_limit: int = DEFAULT_COPY_LIMIT,
          extra: list[str] | None = None, skip: list[str] | None = None, held: Held | None = None) -> list[
            StagedFile]:
    """Copy (or fingerprint) every writable file of the frozen tree into ``dest``; write the index.

    ``extra`` names more files to stage the same way: the NCCL control blocks, which the workers map but do
    not hold open (CRIU records the mapping by path; the restore needs the file back as it was). ``skip``
    names files the snapshot carries another way (the fast path's staging files, copied after the freeze).
    ``held``: the tree's scan, when the caller has it already (the hook scans once, inside the freeze)."""
    dest.mkdir(parents=True, exist_ok=True)
    out: list[StagedFile] = []
    found = [p for p in (held or scan(root_pid)).staged if p not in set(skip or [])]
    for path in extra or []:
        if path not in found and os.path.isfile(path):
            found.append(path)
    for i, path in enumerate(found):
        # the file itself, not a link put in its place (the job's user may own its directory): what is read here
        # is what the snapshot says the job had, as root reads it
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, f"{path} is no longer a regular file")
            size = st.st_size
            tail_len = min(TAIL, size)
            tail = _hash_range(f"/proc/self/fd/{fd}", size - tail_len, size)
            staged: str | None = None
            digest: str | None = None
            if size <= copy_limit:
                name = f"{i:04d}"
                with open(dest / name, "wb") as dst:
                    copy_prefix(fd, dst.fileno(), size)
                digest = _hash_range(str(dest / name), 0, size)
                staged = name
        finally:
            os.close(fd)
        out.append(StagedFile(path=path, size=size, mode=stat.S_IMODE(st.st_mode), staged=staged,
                              sha256=digest, tail_sha256=tail, tail_len=tail_len, uid=st.st_uid, gid=st.st_gid))
    (dest / STAGED_INDEX).write_text(json.dumps([s.__dict__ for s in out], indent=1))
    return out


def held_files(root_pid: int, exclude: set[str], held: Held | None = None) -> list[str]:
    """Regular files the tree holds open or maps (the Python installation, datasets), each path once,
    except ``exclude`` (the staged ones) and deleted files (CRIU carries those itself)."""
    out = []
    for path in (held or scan(root_pid)).held:
        if path in exclude or path.endswith(" (deleted)") or path.startswith(NOT_EXPECTED):
            continue
        try:
            if stat.S_ISREG(os.stat(path).st_mode):
                out.append(path)
        except OSError:
            continue
    return out


def record_expected(root_pid: int, dest: Path, staged: list[StagedFile], held: Held | None = None) -> list[
        ExpectedFile]:
    """Size and mtime of every file the frozen tree reads or maps (``expected.json`` in ``dest``)."""
    out = []
    for path in held_files(root_pid, {s.path for s in staged}, held):
        try:
            st = os.stat(path)
        except OSError:
            continue
        out.append(ExpectedFile(path=path, size=st.st_size, mtime_ns=st.st_mtime_ns))
    (dest / EXPECTED_INDEX).write_text(json.dumps([e.__dict__ for e in out], indent=1))
    return out


def read_expected(dest: Path) -> list[ExpectedFile]:
    index = dest / EXPECTED_INDEX
    if not index.exists():
        return []
    return [ExpectedFile(**d) for d in json.loads(index.read_text())]


def hash_expected(expected: list[ExpectedFile], cache: Path) -> None:
    """Fill in each file's SHA-256 (after the job resumed), reusing ``cache`` for files unchanged since it
    was hashed (same size, mtime and inode), so only the first snapshot of a job pays for its libraries."""
    try:
        known: dict[str, list[Any]] = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    for e in expected:
        try:
            st = os.stat(e.path)
        except OSError:
            continue
        if (st.st_size, st.st_mtime_ns) != (e.size, e.mtime_ns):
            continue  # changed since the dump: leave it unhashed (a restore then needs size and mtime equal)
        key = [st.st_size, st.st_mtime_ns, st.st_ino]
        hit = known.get(e.path)
        if hit and hit[:3] == key:
            e.sha256 = hit[3]
            continue
        try:
            e.sha256 = _hash_range(e.path, 0, st.st_size)
        except OSError:
            continue
        known[e.path] = [*key, e.sha256]
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known))
    os.replace(tmp, cache)


def check_expected(expected: list[ExpectedFile]) -> list[str]:
    """What differs here from the files the job read at the snapshot (empty: all there, unchanged)."""
    problems = []
    for e in expected:
        try:
            st = os.stat(e.path)
        except FileNotFoundError:
            problems.append(f"{e.path}: missing (the job had it open or mapped)")
            continue
        except OSError as err:
            problems.append(f"{e.path}: cannot be read ({err.strerror})")
            continue
        if st.st_size != e.size:
            problems.append(f"{e.path}: {st.st_size} bytes, {e.size} at the snapshot")
        elif st.st_mtime_ns != e.mtime_ns:
            if e.sha256 is None:
                problems.append(f"{e.path}: modified since the snapshot (mtime), and no checksum to compare")
            elif _hash_range(e.path, 0, st.st_size) != e.sha256:
                problems.append(f"{e.path}: its content differs from the snapshot's (SHA-256)")
    return problems


def read_index(dest: Path) -> list[StagedFile]:
    index = dest / STAGED_INDEX
    if not index.exists():
        return []
    return [StagedFile(**d) for d in json.loads(index.read_text())]


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
NO_LINKS = ("a component of its path is a symbolic link or not a directory: a restore follows no path its "
            "manifest did not sign")


def open_dir(path: str, *, create: bool = False, mode: int = 0o777, owner: tuple[int, int] = (0, 0)) -> int:
    """An fd of the directory ``path`` (absolute), reached one component at a time from ``/`` (openat with
    O_NOFOLLOW), so no symbolic link is followed, and none swapped in between a check and a write can redirect
    it; missing directories are made (``create``, with ``mode``, belonging to ``owner``: uid, gid). OSError
    (ELOOP, ENOTDIR) at a link."""
    fd = os.open("/", _DIR)
    try:
        for part in (p for p in path.split("/") if p):
            try:
                nfd = os.open(part, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, mode, dir_fd=fd)
                    made = True
                except FileExistsError:  # made meanwhile (another node of the job restoring here)
                    made = False
                nfd = os.open(part, _DIR, dir_fd=fd)
                if made and owner != (0, 0):
                    os.fchown(nfd, *owner)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _why(e: OSError) -> str:
    return NO_LINKS if e.errno in (errno.ELOOP, errno.ENOTDIR) else (e.strerror or str(e))


def _current(s: StagedFile) -> str | None:
    """Problem with the file a too-large staged file is truncated back into (reached without links)."""
    parent, name = os.path.split(s.path)
    try:
        dfd = open_dir(parent)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
        finally:
            os.close(dfd)
    except FileNotFoundError:
        return f"{s.path}: missing, and too large ({s.size} bytes) to have been copied"
    except OSError as e:
        return f"{s.path}: cannot be read ({_why(e)})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return f"{s.path}: not a regular file"
        if st.st_size < s.size:
            return f"{s.path}: now {st.st_size} bytes, shorter than at the snapshot ({s.size})"
        if s.tail_sha256 and _hash_range(f"/proc/self/fd/{fd}", s.size - s.tail_len, s.size) != s.tail_sha256:
            return f"{s.path}: its content before byte {s.size} changed since the snapshot"
        return None
    finally:
        os.close(fd)


def plan_restore(staged: list[StagedFile], files_dir: Path) -> list[str]:
    """Problems that would stop bringing the files back (checked before anything is changed)."""
    problems: list[str] = []
    for s in staged:
        if s.staged is not None:
            if not (files_dir / s.staged).exists():
                problems.append(f"{s.path}: its copy {s.staged} is missing from the snapshot")
            continue
        problem = _current(s)
        if problem:
            problems.append(problem)
    return problems


def restore(staged: list[StagedFile], files_dir: Path) -> None:
    """Put every staged file back to its state at the snapshot (call plan_restore first). Each is written at
    its path alone: its directory opened component by component without following links (:func:`open_dir`),
    the copy made under a temporary name there (O_EXCL, O_NOFOLLOW) and renamed over it within that
    directory, so a link swapped in at any point is never written through."""
    problems = plan_restore(staged, files_dir)
    if problems:
        raise RestoreFailed(
            "files the job had open cannot be brought back to their state at the snapshot",
            "; ".join(problems),
            "restore a later snapshot, or put those files back",
        )
    for s in staged:
        # a temporary name of this restore's own: two nodes of a job restored on one host at once (each waiting
        # for the other at the coordinator's barrier) may both put back the same file, e.g. a library of a
        # virtualenv under /tmp; each replaces it whole, atomically
        parent, name = os.path.split(s.path)
        tmp = f"{name}.cryosleep-restore-{os.getpid()}"
        dfd = -1
        try:
            dfd = open_dir(parent, create=True, mode=0o700 if s.uid else 0o777, owner=(s.uid, s.gid))
            if s.staged is None:
                fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
                try:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        raise OSError(errno.EINVAL, "not a regular file")
                    os.ftruncate(fd, s.size)
                finally:
                    os.close(fd)
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
            with open(files_dir / s.staged, "rb") as src:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=dfd)
                try:
                    copy_prefix(src.fileno(), fd, s.size)
                    os.fchown(fd, s.uid, s.gid)  # its owner at the snapshot (signed with the manifest)
                    os.fchmod(fd, s.mode & 0o1777)  # never set-user or set-group id
                finally:
                    os.close(fd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError as e:
            if dfd >= 0:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
            raise RestoreFailed(f"the file {s.path} the job had open could not be put back", _why(e),
                                "check that its directory is writable and has room, and that no link was put on "
                                "its path; nothing of the job runs yet", path=s.path) from e
        finally:
            if dfd >= 0:
                os.close(dfd)
