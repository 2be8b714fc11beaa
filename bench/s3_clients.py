"""Throughput of the S3 client libraries against one local server (docs/storage.md, "S3 client").

    .venv/bin/python bench/s3_clients.py [--gib 2] [--object-mib 8] [--threads 8] [--clients boto3 minio obstore]

Starts the loopback S3 server (Ceph radosgw, `make s3server`) over a fresh directory under /tmp (or
--dir), then for each client: PUTs --gib GiB of incompressible data as --object-mib MiB objects from
--threads threads (what the chunk store does), GETs them back, and PUTs/GETs one 1 GiB object as a
multipart upload. Prints one markdown row per client and operation (MiB/s, wall clock; CPU seconds of
this process). The server runs on the same 2 cores, so the numbers compare clients under equal load, not
a network.
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ (the test S3 server)

from tools.s3serve import S3Server

BUCKET = "bench"


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(label: str, nbytes: int, fn: Callable[[], None]) -> None:
    c0, t0 = cpu(), time.perf_counter()
    fn()
    dt, dc = time.perf_counter() - t0, cpu() - c0
    print(f"| {label} | {nbytes / dt / 2**20:.0f} | {dt:.2f} | {dc:.1f} |", flush=True)


def boto3_ops(srv: S3Server) -> dict[str, Callable[..., object]]:
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    c = boto3.client("s3", endpoint_url=srv.endpoint, aws_access_key_id=srv.access_key,
                     aws_secret_access_key=srv.secret_key, region_name="us-east-1",
                     config=Config(max_pool_connections=32, s3={"addressing_style": "path"}))
    tc = TransferConfig(multipart_chunksize=16 << 20, max_concurrency=8)
    return {
        "put": lambda k, b: c.put_object(Bucket=BUCKET, Key=k, Body=b),
        "get": lambda k: c.get_object(Bucket=BUCKET, Key=k)["Body"].read(),
        "put_big": lambda k, b: c.upload_fileobj(io.BytesIO(b), BUCKET, k, Config=tc),
        "get_big": lambda k: c.download_fileobj(BUCKET, k, io.BytesIO(), Config=tc),
        "mkbucket": lambda: c.create_bucket(Bucket=BUCKET),
    }


def minio_ops(srv: S3Server) -> dict[str, Callable[..., object]]:
    import urllib3
    from minio import Minio

    http = urllib3.PoolManager(maxsize=32)
    c = Minio(f"127.0.0.1:{srv.port}", access_key=srv.access_key, secret_key=srv.secret_key, secure=False,
              http_client=http, region="us-east-1")

    def get(k: str) -> bytes:
        r = c.get_object(BUCKET, k)
        try:
            return r.read()
        finally:
            r.close()
            r.release_conn()

    return {
        # part_size above the object size: one PUT, as the others do (minio splits anything over 5 MiB)
        "put": lambda k, b: c.put_object(BUCKET, k, io.BytesIO(b), len(b), part_size=64 << 20),
        "get": get,
        "put_big": lambda k, b: c.put_object(BUCKET, k, io.BytesIO(b), len(b), part_size=16 << 20,
                                             num_parallel_uploads=8),
        "get_big": get,
        "mkbucket": lambda: c.make_bucket(BUCKET),
    }


def obstore_ops(srv: S3Server) -> dict[str, Callable[..., object]]:
    import obstore
    from obstore.store import S3Store

    s = S3Store(BUCKET, endpoint=srv.endpoint, access_key_id=srv.access_key, secret_access_key=srv.secret_key,
                region="us-east-1", client_options={"allow_http": True})
    return {
        "put": lambda k, b: obstore.put(s, k, b, use_multipart=False),
        "get": lambda k: obstore.get(s, k).bytes(),
        "put_big": lambda k, b: obstore.put(s, k, b, chunk_size=16 << 20, max_concurrency=8),
        "get_big": lambda k: obstore.get(s, k).bytes(),
        "mkbucket": lambda: boto3_ops(srv)["mkbucket"](),
    }


CLIENTS = {"boto3": boto3_ops, "minio": minio_ops, "obstore": obstore_ops}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--object-mib", type=int, default=8)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--clients", nargs="+", default=list(CLIENTS))
    p.add_argument("--dir", default=None, help="server data directory parent (default: a new one under /tmp)")
    a = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="cryosleep-s3bench-", dir=a.dir))
    size = a.object_mib << 20
    count = int(a.gib * 1024 / a.object_mib)
    pool = os.urandom(size + 4096)
    bodies = [pool[i % 4096: i % 4096 + size] for i in range(min(count, 64))]
    big = os.urandom(1 << 30)
    print(f"{count} objects of {a.object_mib} MiB ({count * size / 2**30:.1f} GiB), {a.threads} threads; "
          "1 GiB multipart object; server: radosgw (posix) on 127.0.0.1")
    print("| client / operation | MiB/s | seconds | client CPU s |\n| --- | --- | --- | --- |")
    try:
        for name in a.clients:
            with S3Server(base / name) as srv:
                ops = CLIENTS[name](srv)
                ops["mkbucket"]()
                keys = [f"chunks/{i:06d}" for i in range(count)]
                with ThreadPoolExecutor(a.threads) as ex:
                    timed(f"{name} PUT {a.object_mib} MiB objects", count * size,
                          lambda ex=ex, ops=ops, keys=keys: list(ex.map(
                              lambda ik: ops["put"](ik[1], bodies[ik[0] % len(bodies)]), enumerate(keys))))
                    timed(f"{name} GET {a.object_mib} MiB objects", count * size,
                          lambda ex=ex, ops=ops, keys=keys: list(ex.map(ops["get"], keys)))
                timed(f"{name} PUT 1 GiB multipart", len(big), lambda ops=ops: ops["put_big"]("big", big))
                timed(f"{name} GET 1 GiB", len(big), lambda ops=ops: ops["get_big"]("big"))
            shutil.rmtree(base / name, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
