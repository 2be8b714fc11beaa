"""CRIU's action script: runs inside ``criu dump`` while the tree is frozen.

At ``post-dump`` (images written, tasks still frozen) it stages the files the job writes (files.stage) and
the files named in ``CRYOSLEEP_HOOK_EXTRA_FILES`` (the workers' NCCL control blocks, exactly as CRIU saw them),
but not those in ``CRYOSLEEP_HOOK_SKIP`` (the fast path's staging files, copied after the freeze),
and records the size and mtime of the files it only reads or maps (files.record_expected).
A non-zero exit makes CRIU fail the dump and resume every task, which is what fault injection uses:
``CRYOSLEEP_FAULT=capture-fail`` fails here, ``capture-hang`` blocks here until the snapshot's timeout
(``capture-hang-kill`` too, and then the agent kills CRIU itself instead of letting it roll back, to
exercise the last-resort cleanup).

``--serve FIFO TIMEOUT`` (``capture.criu.start_hook``): started with the dump, before the freeze, it waits for
the action script's post-dump on ``FIFO.in``, does the same, and answers its exit code on ``FIFO.out``; it ends
after one post-dump, or after TIMEOUT seconds without one.
"""

from __future__ import annotations

import errno
import os
import select
import sys
import time
from pathlib import Path

from cryosleep.capture import files


def fail(msg: str) -> int:
    """Report to the agent (CRIU does not pass a script's output on) and make CRIU fail the dump."""
    err = os.environ.get("CRYOSLEEP_HOOK_ERR")
    if err:
        with open(err, "a") as f:
            f.write(f"cryosleep hook: {msg}\n")
    print(f"cryosleep hook: {msg}", file=sys.stderr)
    return 1


def main() -> int:
    if sys.argv[1:2] == ["--serve"]:
        return serve(sys.argv[2], float(sys.argv[3]))
    action = os.environ.get("CRTOOLS_SCRIPT_ACTION", "")
    if action != "post-dump":
        return 0
    return post_dump()


def serve(fifo: str, timeout: float) -> int:
    """One post-dump for the action script that writes to ``fifo``.in; its exit code answered on ``fifo``.out."""
    end = time.monotonic() + timeout
    fd = os.open(f"{fifo}.in", os.O_RDONLY | os.O_NONBLOCK)  # no writer yet: open now, wait in poll
    try:
        poll = select.poll()
        poll.register(fd, select.POLLIN)
        if not poll.poll(max(0.0, end - time.monotonic()) * 1000):
            return 0  # CRIU never reached post-dump (it failed, or was stopped): nothing to do
        os.read(fd, 64)
    finally:
        os.close(fd)
    rc = post_dump()
    while time.monotonic() < end:  # the script opens the answer's FIFO as soon as its signal is written
        try:
            out = os.open(f"{fifo}.out", os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:  # ENXIO: not opened for reading yet
                raise
            time.sleep(0.001)
            continue
        try:
            os.write(out, f"{rc}\n".encode())
        finally:
            os.close(out)
        break
    return rc


def post_dump() -> int:
    started = time.monotonic()
    rc = _post_dump()
    times = os.environ.get("CRYOSLEEP_HOOK_TIMES")
    if times:  # the agent's profile of the freeze (criu_stats.read); never fails the dump
        try:
            Path(times).write_text(f"post-dump {time.monotonic() - started:.6f}\n")
        except OSError:
            pass
    return rc


def _post_dump() -> int:
    root = int(os.environ["CRYOSLEEP_HOOK_ROOT_PID"])
    dest = Path(os.environ["CRYOSLEEP_HOOK_STAGE_DIR"])
    limit = int(os.environ.get("CRYOSLEEP_HOOK_COPY_LIMIT", files.DEFAULT_COPY_LIMIT))
    extra = [p for p in os.environ.get("CRYOSLEEP_HOOK_EXTRA_FILES", "").split(os.pathsep) if p]
    skip = [p for p in os.environ.get("CRYOSLEEP_HOOK_SKIP", "").split(os.pathsep) if p]
    try:
        held = files.scan(root)  # one pass over /proc while the tree is frozen, for both
        staged = files.stage(root, dest, limit, extra, skip, held)
        files.record_expected(root, dest, staged, held)
    except OSError as e:
        return fail(f"staging the job's files failed: {e}")
    fault = os.environ.get("CRYOSLEEP_FAULT", "")
    if fault == "capture-fail":
        return fail("injected capture failure (CRYOSLEEP_FAULT=capture-fail)")
    if fault in ("capture-hang", "capture-hang-kill"):
        time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
