"""What fixed-size and content-defined chunking find in real CRIU images (docs/storage.md, "Chunking").

    sudo .venv/bin/python bench/dedup.py [--mem-mb 512] [--nproc 2] [--specs fixed:4M cdc:1M ...] [--s3]
    sudo .venv/bin/python bench/dedup.py --images SNAPDIR1 SNAPDIR2     (two snapshot directories you have)
    sudo python3 bench/dedup.py --gpu-hidden 16384 --levels 1 3         (a GPU job, on the GPU machine)

Without --images it starts tests/jobs/workloads/ddp_basic.py (gloo DDP, --nproc ranks, --mem-mb of extra
state per rank, identical on every rank like a data-parallel replica's weights) under `cryosleep run`, takes
a keep-running snapshot, lets it train a few seconds, takes a stop snapshot, and uses those two images
(own CRYOSLEEP_HOME and store under /tmp, removed afterwards). For each chunking it reports:

- across ranks: the share of one rank's memory image (pages-*.img; the two largest are the two ranks)
  whose chunks the other rank's image already has;
- across snapshots: the share of the second snapshot's bytes whose chunks the first already stored
  (what a periodic snapshot after the first sends nothing for);
- chunks per GiB, and the single-thread speed of cutting + SHA-256;
- zstd (--levels) on snapshot 1's chunks, memory pages and other files apart: ratio, compress and decompress
  speed on one thread (the store compresses chunks in parallel on --workers threads).

Chunkings: fixed:SIZE, cdc:AVG (cuts anywhere), cdc4k:AVG (cuts only at 4 KiB boundaries).

Then it stores both snapshots with the default chunking through ChunkStore into a local directory (and,
with --s3, into the loopback S3 server), and reports time, throughput and bytes sent.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _cli import cli  # bench/ is on sys.path when a script here is run

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "tests" / "jobs" / "workloads" / "ddp_basic.py"
GPU_WORKLOAD = ROOT / "tests" / "gpu" / "workloads" / "cuda_train.py"
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # tools/ (the test S3 server)

from cryosleep.store.backend import LocalBackend  # noqa: E402
from cryosleep.store.cas import ChunkStore  # noqa: E402
from cryosleep.store.chunking import DEFAULT, ChunkSpec, iter_chunks  # noqa: E402

MiB = 1 << 20




def make_images(tmp: Path, mem_mb: int, nproc: int, gpu_hidden: int = 0) -> list[Path]:
    store = tmp / "store"
    env = dict(os.environ, CRYOSLEEP_HOME=str(tmp / "home"), CRYOSLEEP_STORE=str(store))
    from cryosleep import paths

    env.setdefault("CRYOSLEEP_CRIU_ROOT", str(paths.criu_root()))
    name = "dedup"
    job = [str(GPU_WORKLOAD), "--hidden", str(gpu_hidden)] if gpu_hidden else [str(WORKLOAD), "--mem-mb", str(mem_mb)]
    cli(env, "run", "--detach", "--name", name, "--nproc-per-node", str(nproc), *job, "--steps", "100000",
        "--step-sleep", "0.05")
    log = tmp / "home" / "jobs" / name / "logs" / "rank-0.log"
    end = time.monotonic() + 600
    while not (log.exists() and log.read_text().count("\n") >= 5):
        if time.monotonic() > end:
            raise SystemExit(f"{log} shows no training")
        time.sleep(0.2)
    first = cli(env, "snapshot", name)
    time.sleep(5)  # about 100 training steps between the two
    second = cli(env, "snapshot", name, "--stop")
    return [store / "snapshots" / str(s["snapshot"]) for s in (first, second)]


def image_files(snapdir: Path) -> list[Path]:
    return sorted(p for p in (snapdir / "nodes").rglob("*") if p.is_file())


@dataclass
class Cut:
    chunks: list[tuple[bytes, int]]  # (sha256, size)

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.chunks)


def cut(path: Path, spec: ChunkSpec) -> Cut:
    with open(path, "rb") as f:
        return Cut([(hashlib.sha256(b).digest(), len(b)) for _, b in iter_chunks(f, spec)])


def found_in(target: list[Cut], base: list[Cut]) -> float:
    have = {h for c in base for h, _ in c.chunks}
    total = sum(c.bytes for c in target)
    hit = sum(n for c in target for h, n in c.chunks if h in have)
    return hit / total if total else 0.0


def parse_spec(text: str) -> ChunkSpec:
    """fixed:4M, cdc:1M (cut anywhere), cdc4k:1M (cut only at 4 KiB page boundaries)."""
    method, _, size = text.partition(":")
    mult = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:].upper(), 1)
    n = int(size.rstrip("KkMm")) * mult
    if method == "fixed":
        return ChunkSpec("fixed", n)
    return ChunkSpec("cdc", n, align=4096 if method == "cdc4k" else 1)


def compression_table(files: list[Path], levels: list[int]) -> None:
    """zstd on the default chunks of one image, memory pages and the rest apart: ratio and one-thread speed."""
    import zstandard

    groups = {"memory (pages-*.img)": [f for f in files if f.name.startswith("pages-")],
              "other image files": [f for f in files if not f.name.startswith("pages-")]}
    print("\n| data | zstd level | ratio | compress MiB/s (1 thread) | decompress MiB/s |")
    print("| --- | --- | --- | --- | --- |")
    for label, group in groups.items():
        chunks = []
        for f in group:
            with open(f, "rb") as fh:
                chunks.extend(b for _, b in iter_chunks(fh, DEFAULT))
        total = sum(len(c) for c in chunks)
        if not total:
            continue
        for level in levels:
            cctx, dctx = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
            t0 = time.perf_counter()
            frames = [cctx.compress(c) for c in chunks]
            t1 = time.perf_counter()
            for fr in frames:
                dctx.decompress(fr)
            t2 = time.perf_counter()
            packed = sum(min(len(fr), len(c)) for fr, c in zip(frames, chunks, strict=True))  # stored raw if larger
            print(f"| {label}, {total / MiB:.0f} MiB | {level} | {total / packed:.2f} | {total / MiB / (t1 - t0):.0f} "
                  f"| {total / MiB / (t2 - t1):.0f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mem-mb", type=int, default=512)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--images", type=Path, nargs=2, help="two snapshot directories instead of a fresh job")
    p.add_argument("--gpu-hidden", type=int, default=0,
                   help="a GPU job instead: tests/gpu/workloads/cuda_train.py (DDP over NCCL) with this MLP width")
    p.add_argument("--specs", nargs="+", default=["fixed:1M", "fixed:4M", "fixed:16M", "cdc:256K", "cdc:1M",
                                                  "cdc:4M", "cdc4k:256K", "cdc4k:1M", "cdc4k:4M"])
    p.add_argument("--s3", action="store_true", help="also store into the loopback S3 server")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--levels", type=int, nargs="*", default=[1, 3, 9],
                   help="zstd levels to measure on snapshot 1 (ratio, single-thread speed); none: skip")
    p.add_argument("--store-spec", default=None, help="chunking for the store step (default: the default)")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cryosleep-dedup-"))
    try:
        snaps = a.images or make_images(tmp, a.mem_mb, a.nproc, a.gpu_hidden)
        files = [image_files(s) for s in snaps]
        sizes = [sum(f.stat().st_size for f in fs) for fs in files]
        pages = sorted((f for f in files[0] if f.name.startswith("pages-")), key=lambda f: f.stat().st_size)
        ranks = pages[-2:]
        print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}: {os.cpu_count()} cores, "
              f"python {platform.python_version()}")
        print(f"images: {sizes[0] / MiB:.0f} MiB and {sizes[1] / MiB:.0f} MiB ({len(files[0])} files); rank pages: "
              + ", ".join(f"{r.name} {r.stat().st_size / MiB:.0f} MiB" for r in ranks))
        print("\n| chunking | across ranks | across snapshots | unique in snapshot 1 | chunks/GiB "
              "| cut+SHA-256 MiB/s |")
        print("| --- | --- | --- | --- | --- | --- |")
        for text in a.specs:
            spec = parse_spec(text)
            t0 = time.perf_counter()
            cuts = [[cut(f, spec) for f in fs] for fs in files]
            dt = time.perf_counter() - t0
            by_name = {f: c for f, c in zip(files[0], cuts[0], strict=True)}
            rank_share = found_in([by_name[ranks[1]]], [by_name[ranks[0]]])
            snap_share = found_in(cuts[1], cuts[0])
            uniq: dict[bytes, int] = {}
            for c in cuts[0]:
                uniq.update(c.chunks)
            n_chunks = sum(len(c.chunks) for c in cuts[0])
            print(f"| {text} | {rank_share:.1%} | {snap_share:.1%} | {sum(uniq.values()) / sizes[0]:.1%} | "
                  f"{n_chunks / (sizes[0] / 2**30):.0f} | {sum(sizes) / MiB / dt:.0f} |", flush=True)

        if a.levels:
            compression_table(files[0], a.levels)

        def store_into(label: str, store: ChunkStore) -> None:
            for i, s in enumerate(snaps):
                rels = [str(f.relative_to(s)) for f in image_files(s)]
                r = store.put_snapshot(f"snap{i + 1}", "dedup", s, rels)
                print(f"| {label} | snapshot {i + 1} | {r.seconds:.1f} | {r.bytes_in / MiB / r.seconds:.0f} | "
                      f"{r.uploaded} sent, {r.present} present | {r.bytes_sent / MiB:.0f} MiB |", flush=True)
            t0 = time.perf_counter()
            out = tmp / f"restore-{label.split()[0]}"
            store.restore("snap2", out)
            dt = time.perf_counter() - t0
            print(f"| {label} | restore snapshot 2 | {dt:.1f} | {sizes[1] / MiB / dt:.0f} | - | - |", flush=True)
            shutil.rmtree(out, ignore_errors=True)

        spec = parse_spec(a.store_spec) if a.store_spec else DEFAULT
        print(f"\nstore (chunking {spec.to_json()}, zstd-3, {a.workers} workers):\n")
        print("| backend | step | seconds | MiB/s (image) | chunks | stored |\n| --- | --- | --- | --- | --- | --- |")
        store_into("local dir", ChunkStore(LocalBackend(tmp / "cas"), workers=a.workers, spec=spec))
        if a.s3:
            from cryosleep.store.s3 import S3Backend
            from tools.s3serve import S3Server

            with S3Server(tmp / "radosgw") as srv:
                srv.create_bucket("bench")
                settings = {"access_key_id": srv.access_key, "secret_access_key": srv.secret_key,
                            "endpoint": srv.endpoint}
                store_into("S3 (radosgw, loopback)", ChunkStore(S3Backend("bench", "cryo", settings=settings),
                                                                workers=a.workers, spec=spec))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
