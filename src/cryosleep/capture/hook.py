"""CRIU's action script: runs inside ``criu dump`` while the tree is frozen.

At ``post-dump`` (images written, tasks still frozen) it stages the files the job writes (files.stage) and
the files named in ``CRYOSLEEP_HOOK_EXTRA_FILES`` (the workers' NCCL control blocks, exactly as CRIU saw them),
but not those in ``CRYOSLEEP_HOOK_SKIP`` (the fast path's staging files, copied after the freeze),
and records the size and mtime of the files it only reads or maps (files.record_expected).
A non-zero exit makes CRIU fail the dump and resume every task, which is what fault injection uses:
``CRYOSLEEP_FAULT=capture-fail`` fails here, ``capture-hang`` blocks here until the snapshot's timeout
(``capture-hang-kill`` too, and then the agent kills CRIU itself instead of letting it roll back, to
exercise the last-resort cleanup).
"""

from __future__ import annotations

import os
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
    action = os.environ.get("CRTOOLS_SCRIPT_ACTION", "")
    if action != "post-dump":
        return 0
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
