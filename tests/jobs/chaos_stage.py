"""Where a chaos round's job keeps its snapshots, and the victims that live there (tests/jobs/chaos.py).

- the harness's own store (most rounds);
- ``disk``: a small tmpfs of bounded size made for the round, holding the round's store and its staging, filled
  up at the chosen moment (a file taking every free byte) and freed again once the snapshot or restore answered;
- ``s3``: a real S3 server of the round's own (tools/s3serve.py), the job's remote store (``run --store``),
  SIGKILLed at the chosen moment and started again once the snapshot or restore answered. A restore round
  keeps no local copy (``--local-keep 0``), so its restore fetches from the server: the store goes mid-fetch.

Each is undone after the round whatever happened: the server ended, the tmpfs unmounted (a mount that cannot be
unmounted is reported as left behind), the harness's environment as it was.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from cryosleep.errors import CryosleepError
from tests.jobs.harness import Harness
from tools.s3serve import S3Server, locate

# Resolved at import, before a test or the benchmark moves CRYOSLEEP_HOME: the gateway `make setup` installed.
try:
    RADOSGW: Path | None = locate()
except CryosleepError:
    RADOSGW = None

DISK_MB = 1536  # two snapshots of the round's job fit (about 250 MB each), with room for their staging


@dataclass
class Stage:
    store: Path  # the local store of the round's job (staging included)
    run_flags: tuple[str, ...] = ()
    store_flags: tuple[str, ...] = ()  # for restore, verify, ls of the round's snapshots
    server: S3Server | None = None
    mount: Path | None = None
    fill: Path | None = None
    saved_env: dict[str, str] = field(default_factory=dict)

    def fault(self) -> bool:
        """The stage's victim at its moment: the server killed, or the disk filled. True when it was done."""
        if self.server is not None:
            alive = self.server.proc is not None and self.server.proc.poll() is None
            self.server.stop()
            return alive
        if self.mount is not None:
            self.fill = self.mount / "fill"
            fd = os.open(self.fill, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                st = os.statvfs(self.mount)
                os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize)
            except OSError:
                pass
            finally:
                os.close(fd)
            block = b"\0" * (1 << 20)  # fallocate may leave a last few blocks: write until the disk refuses
            with open(self.fill, "ab", buffering=0) as f:
                try:
                    while True:
                        f.write(block)
                except OSError:
                    pass
            return True
        return False

    def recover(self) -> None:
        """The store comes back: the server started again, the disk's filler removed."""
        if self.server is not None and self.server.proc is None:
            self.server.start()
        if self.fill is not None:
            self.fill.unlink(missing_ok=True)
            self.fill = None


def make(h: Harness, kind: str, seed: int, restore_round: bool) -> Stage:
    """The round's stage: ``kind`` is its victim (``disk`` and ``s3`` have their own; any other uses the
    harness's store)."""
    store = Path(h.env["CRYOSLEEP_STORE"])
    saved = {k: h.env[k] for k in ("CRYOSLEEP_STORE",) if k in h.env}
    if kind == "disk":
        mnt = store.parent / f"chaos-disk-{seed}"
        mnt.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m,mode=0700", "tmpfs", str(mnt)], check=True)
        h.env["CRYOSLEEP_STORE"] = str(mnt / "store")
        return Stage(mnt / "store", mount=mnt, saved_env=saved)
    if kind == "s3":
        if RADOSGW is None:
            raise AssertionError("the S3 test server is not installed: run `make s3server`")
        srv = S3Server(store.parent / f"chaos-s3-{seed}", prefix=RADOSGW).start()
        bucket = f"chaos-{seed}"
        srv.create_bucket(bucket)
        for k in srv.env():
            if k in h.env:
                saved[k] = h.env[k]
        h.env.update(srv.env())
        url = f"s3://{bucket}/chaos"
        keep = ("--local-keep", "0") if restore_round else ()
        return Stage(store, run_flags=("--store", url, *keep), store_flags=("--store", url), server=srv,
                     saved_env=saved)
    return Stage(store)


def undo(h: Harness, stage: Stage) -> list[str]:
    """Take the stage down; what could not be undone, as problems."""
    left: list[str] = []
    if stage.server is not None:
        stage.server.stop()
        shutil.rmtree(stage.server.root, ignore_errors=True)
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"):
            h.env.pop(k, None)
    if stage.mount is not None:
        res = subprocess.run(["umount", str(stage.mount)], capture_output=True, text=True, check=False)
        if res.returncode != 0:
            left.append(f"the round's filesystem {stage.mount} could not be unmounted: {res.stderr.strip()} "
                        "(something of the round still holds it)")
            subprocess.run(["umount", "-l", str(stage.mount)], capture_output=True, check=False)
        try:
            stage.mount.rmdir()
        except OSError:
            pass
    h.env.update(stage.saved_env)
    return left


def mounts_under(*roots: Path) -> list[str]:
    """Mount points under any of ``roots`` (what a round may leave behind)."""
    keys = [str(r) for r in roots]
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4]
            if any(point == k or point.startswith(k + "/") for k in keys):
                out.append(point)
    return out
