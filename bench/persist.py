"""Snapshots persisted to S3 through the wired path, against the raw rate of the same server
(docs/benchmarks.md, "Persisting snapshots to S3").

    sudo .venv/bin/python bench/persist.py [--mem-mb 512] [--nproc 2] [--raw-mb 1024]

Starts the loopback S3 server (Ceph radosgw, `make s3server`) over a fresh directory under /tmp, then:

- raw: --raw-mb of incompressible data as 8 MiB objects, PUT then GET from 8 threads through the store's
  S3 backend (minio-py; no chunking, hashing, compression or encryption): what the server and client move;
- wired: tests/jobs/workloads/ddp_basic.py (gloo DDP, --nproc ranks, --mem-mb of identical extra state per
  rank) under `cryosleep run --store s3://... --key-file K`, a keep-running snapshot (its background upload
  and remote verify, from the persistence record), a second one 5 s later (what dedup saves), a stop
  snapshot (its persist phase, which the job waits for), then `persist.fetch` of the stop snapshot into an
  empty local store (download + check of every chunk).

Rates are MiB of image per second (what a user waits for) and MiB per second on the wire (compressed,
encrypted). Everything runs on the same machine, server included.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _cli import cli  # bench/ is on sys.path when a script here is run

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "tests" / "jobs" / "workloads" / "ddp_basic.py"
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # tools/ (the test S3 server)

from cryosleep import paths  # noqa: E402
from cryosleep.store import persist  # noqa: E402
from cryosleep.store.local import LocalStore  # noqa: E402
from cryosleep.store.s3 import S3Backend  # noqa: E402
from tools.s3serve import S3Server  # noqa: E402

MiB = 1 << 20


def raw(srv: S3Server, bucket: str, total_mb: int) -> tuple[float, float]:
    """Seconds to PUT, then GET, total_mb of random 8 MiB objects from 8 threads."""
    be = S3Backend(bucket, "raw", settings={"access_key_id": srv.access_key, "secret_access_key": srv.secret_key,
                                            "endpoint": srv.endpoint, "region": "us-east-1"})
    blobs = [os.urandom(8 * MiB) for _ in range(8)]
    names = [f"obj/{i}" for i in range(total_mb // 8)]
    with ThreadPoolExecutor(8) as pool:
        t0 = time.monotonic()
        list(pool.map(lambda i: be.put(names[i], blobs[i % 8]), range(len(names))))
        put_s = time.monotonic() - t0
        t0 = time.monotonic()
        list(pool.map(be.get, names))
        get_s = time.monotonic() - t0
    return put_s, get_s


def wait_persisted(store: Path, sid: str) -> dict[str, Any]:
    path = store / "persist" / f"{sid}.json"
    while True:
        if path.exists():
            rec: dict[str, Any] = json.loads(path.read_text())
            if rec["state"] in ("persisted", "failed"):
                if rec["state"] == "failed":
                    raise SystemExit(f"upload of {sid} failed: {rec['reason']}")
                return rec
        time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mem-mb", type=int, default=512)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--raw-mb", type=int, default=1024)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cryosleep-bench-persist-"))
    rows: list[list[str]] = []
    try:
        with S3Server(tmp / "radosgw") as srv:
            bucket = "bench-persist"
            srv.create_bucket(bucket)
            put_s, get_s = raw(srv, bucket, a.raw_mb)
            rows.append(["raw PUT 8 MiB objects", f"{a.raw_mb}", f"{put_s:.2f}", f"{a.raw_mb / put_s:.0f}",
                         f"{a.raw_mb / put_s:.0f}"])
            rows.append(["raw GET 8 MiB objects", f"{a.raw_mb}", f"{get_s:.2f}", f"{a.raw_mb / get_s:.0f}",
                         f"{a.raw_mb / get_s:.0f}"])
            key = tmp / "job.key"
            key.write_bytes(os.urandom(32))
            key.chmod(0o600)
            store = tmp / "store"
            env = dict(os.environ, CRYOSLEEP_HOME=str(tmp / "home"), CRYOSLEEP_STORE=str(store), **srv.env())
            env.setdefault("CRYOSLEEP_CRIU_ROOT", str(paths.criu_root()))
            url = f"s3://{bucket}/cryo"
            cli(env, "run", "--detach", "--name", "bench", "--nproc-per-node", str(a.nproc), "--store", url,
                "--key-file", str(key), "--local-keep", "1", str(WORKLOAD), "--steps", "1000000", "--step-sleep",
                "0.05", "--mem-mb", str(a.mem_mb))
            log = tmp / "home" / "jobs" / "bench" / "logs" / "rank-0.log"
            while not log.exists() or log.read_text().count("\nstep ") < 5:
                time.sleep(0.2)
            for label in ("keep-running 1", "keep-running 2"):
                s = cli(env, "snapshot", "bench")
                rec = wait_persisted(store, str(s["snapshot"]))
                img = rec["bytes_total"] / MiB
                rows.append([f"{label}: upload", f"{img:.0f}", f"{rec['upload_s']:.2f}",
                             f"{img / rec['upload_s']:.0f}", f"{rec['bytes_sent'] / MiB / rec['upload_s']:.0f}",
                             f"sent {rec['bytes_sent'] / MiB:.0f} MiB, {100 * rec['dedup']:.0f}% dedup"])
                rows.append([f"{label}: remote verify", f"{img:.0f}", f"{rec['verify_s']:.2f}",
                             f"{img / rec['verify_s']:.0f}", f"{rec['stored_bytes'] / MiB / rec['verify_s']:.0f}", ""])
                time.sleep(5)
            s = cli(env, "snapshot", "bench", "--stop")
            rec = dict(s["persist"])  # type: ignore[call-overload]
            img = rec["bytes_total"] / MiB
            phases: dict[str, float] = s["phases"]  # type: ignore[assignment]
            rows.append(["stop: persist phase (upload + verify)", f"{img:.0f}", f"{phases['persist']:.2f}",
                         f"{img / phases['persist']:.0f}", "",
                         f"sent {rec['bytes_sent'] / MiB:.0f} MiB, {100 * rec['dedup']:.0f}% dedup; "
                         f"pause {s['pause_s']:.2f} s"])
            os.environ.update(srv.env())
            other = LocalStore(tmp / "other-machine")
            t0 = time.monotonic()
            m, frec = persist.fetch(url, str(s["snapshot"]), other, key_file=key)
            dl = time.monotonic() - t0
            rows.append(["fetch (download + check every chunk)", f"{m.bytes / MiB:.0f}", f"{dl:.2f}",
                         f"{m.bytes / MiB / dl:.0f}", f"{frec.stored_bytes / MiB / dl:.0f}", ""])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"# {time.strftime('%Y-%m-%d', time.gmtime())}, {platform.node()}, {os.cpu_count()} cores, "
          f"--mem-mb {a.mem_mb} --nproc {a.nproc}; server: radosgw (posix) on 127.0.0.1")
    print("| step | MiB (image) | seconds | MiB/s (image) | MiB/s (wire) | notes |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print("| " + " | ".join(r + [""] * (6 - len(r))) + " |")


if __name__ == "__main__":
    main()
