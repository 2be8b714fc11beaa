"""A restore's image check, streamed: the big files are checked while CRIU reads them, not before.

A snapshot's image is mostly the workers' memory pages (CRIU's ``pages-*.img``). Checking every file against
the manifest before CRIU starts, then letting CRIU read it again, costs the whole image's read and hash on top
of the restore. What matters is that no byte of a file that does not match the manifest is ever used: either
parsed by CRIU as root (the small image files: process tree, files, mounts, sockets, the page maps), written
to the host (the job's files), or run (the pages, once the tasks resume). So:

- every file but the pages is checked in full before anything is used (``upfront``; the fast path's device
  memory files are checked as they are copied, in the devmem phase);
- the pages files are checked for presence, type and size before, and their content is hashed by
  ``PageCheck``'s threads while the restore goes on: the other phases, then CRIU itself, which reads the same
  bytes from the page cache (one read from the store's disk, by whichever comes first);
- CRIU's ``post-restore`` action (``PageCheck.gate``) runs once every task is restored and before any resumes,
  and waits there for the check's verdict: a pages file that does not match makes the script fail, and CRIU
  then kills the restored tasks before any of them ran an instruction (CRIU: "Aborting restore due to
  post-restore script ret code").
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from cryosleep.capture import criu as criu_calls
from cryosleep.store.manifest import PRECOPY_PARENT, FileEntry, Manifest

__all__ = ["GATE_ENV", "PageCheck", "streamed_files"]

GATE_ENV = "CRYOSLEEP_RESTORE_GATE"
BLOCK = 8 << 20
GATE_SCRIPT = (
    "#!/bin/sh\n"
    "# CRIU's post-restore action of a Cryosleep restore (capture/imagecheck.py): every task is restored and\n"
    "# none has run; the restore goes on only once the pages read meanwhile were found to match the manifest.\n"
    f"[ \"$CRTOOLS_SCRIPT_ACTION\" = post-restore ] && [ -n \"${GATE_ENV}\" ] || exit 0\n"
    f"read verdict < \"${GATE_ENV}\" || exit 1\n"
    "[ \"$verdict\" = intact ]\n"
)


def streamed_files(manifest: Manifest) -> dict[str, FileEntry]:
    """The files whose content is checked as the restore reads them (CRIU's pages files: the final dump's and
    its pre-dump's, which CRIU reads through the ``parent`` link), by path."""
    return {f.path: f for n in manifest.nodes for f in n.files
            if ("/criu/" in f.path or f"/{PRECOPY_PARENT}/" in f.path) and Path(f.path).name.startswith("pages-")}


def _sha256(path: Path, size: int, stop: threading.Event) -> str:
    h = hashlib.sha256()
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        pos = 0
        while pos < size and not stop.is_set():  # stop: the restore failed elsewhere, the verdict is moot
            n = os.preadv(fd, [view[:min(BLOCK, size - pos)]], pos)
            if not n:
                break
            h.update(view[:n])  # hashlib lets go of the GIL for a block this large
            pos += n
    finally:
        os.close(fd)
    return h.hexdigest()


class PageCheck:
    """The pages files of a snapshot hashed in parallel threads from ``start``; ``problems`` waits for the verdict,
    ``gate`` is CRIU's action script that waits for it too. ``close`` when the restore ends, either way."""

    def __init__(self, base: Path, entries: dict[str, FileEntry]) -> None:
        self.base = base
        self.entries = entries
        self.bytes = sum(f.size for f in entries.values())
        self.seconds = 0.0  # how long the hashing took (it overlaps the restore's other phases)
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[tuple[FileEntry, Future[str]]] = []
        self._t0 = 0.0
        self._fifo: Path | None = None
        self._closed = threading.Event()
        self._verdict: list[str] | None = None
        self._served: threading.Thread | None = None

    def start(self) -> None:
        self._t0 = time.monotonic()
        if not self.entries:
            return
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(len(self.entries), 16, os.cpu_count() or 2)),
                                        thread_name_prefix="page-check")
        # largest first: the long ones start at once, the small ones fill in
        for f in sorted(self.entries.values(), key=lambda f: -f.size):
            self._futures.append((f, self._pool.submit(_sha256, self.base / f.path, f.size, self._closed)))

    def problems(self) -> list[str]:
        """Waits until every pages file was hashed; the ones that do not match the manifest (empty: intact)."""
        if self._verdict is not None:
            return self._verdict
        out: list[str] = []
        for f, fut in self._futures:
            try:
                got = fut.result()
            except OSError as e:
                out.append(f"{f.path}: cannot be read ({e.strerror or e})")
                continue
            if got != f.sha256:
                out.append(f"{f.path}: sha256 {got[:16]}..., expected {f.sha256[:16]}... (altered)")
        if self._futures:
            self.seconds = time.monotonic() - self._t0
        self._verdict = out
        return out

    def gate(self, work_dir: Path) -> tuple[str, dict[str, str]]:
        """CRIU's ``--action-script`` that holds the restored tasks at post-restore until the verdict, and its
        environment; the verdict is served from a thread, through a FIFO in ``work_dir`` that the script reads."""
        work_dir.mkdir(parents=True, exist_ok=True)
        self._fifo = work_dir / "page-check.fifo"
        self._fifo.unlink(missing_ok=True)
        os.mkfifo(self._fifo, 0o600)
        self._served = threading.Thread(target=self._serve, args=(str(self._fifo),), name="restore-gate",
                                        daemon=True)
        self._served.start()
        return criu_calls.action_script("criu-restore-gate", GATE_SCRIPT), {GATE_ENV: str(self._fifo)}

    def _serve(self, fifo: str) -> None:
        word = b"altered\n" if self.problems() else b"intact\n"
        while not self._closed.is_set():
            try:  # succeeds once the script has the FIFO open for reading (it waits there for a writer)
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as e:
                if e.errno != errno.ENXIO:  # no reader yet: CRIU has not reached post-restore
                    return
                time.sleep(0.002)
                continue
            with contextlib.suppress(OSError):
                os.write(fd, word)
            os.close(fd)
            return

    def close(self) -> None:
        """The restore ended (either way): no thread is left hashing or serving, the FIFO is gone."""
        self._closed.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._served is not None:
            self._served.join(timeout=5.0)
        if self._fifo is not None:
            self._fifo.unlink(missing_ok=True)
