"""`cryosleep gc` and `cryosleep verify --deep`: looking after the content-addressed store.

The store is ``--store`` (a directory, whose ``cas/`` folder holds it, or ``s3://bucket/prefix``), else
``$CRYOSLEEP_STORE``, else the default store directory. ``verify`` itself is defined with the other
snapshot commands; this module adds ``--deep`` (and ``--key-file``) to it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryosleep import paths
from cryosleep.cli.output import age_arg, emit_json, human_bytes, table
from cryosleep.cli.transfer import trust_of
from cryosleep.errors import CryosleepError, StoreCorrupt
from cryosleep.store.gc import GRACE_S, collect
from cryosleep.store.persist import authentic, is_remote
from cryosleep.store.retention import Policy, RetentionDecision, SnapshotInfo, decide
from cryosleep.store.urls import open_backend

if TYPE_CHECKING:
    from cryosleep.store.cas import ChunkStore, Snapshot


def _chunk_store(store: str | Path | None) -> ChunkStore:
    # Imported here: the chunk store needs numpy, zstandard and cryptography, the rest of the CLI does not.
    from cryosleep.store.cas import ChunkStore

    return ChunkStore(open_backend(store if store is not None else paths.default_store()))


def add_store_cmds(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    g = sub.add_parser("gc", help="remove snapshots by retention rules, then chunks no snapshot needs")
    g.add_argument("--store", default=None, help="store directory or s3://bucket/prefix (default $CRYOSLEEP_STORE)")
    g.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    g.add_argument("--grace", type=age_arg, default=GRACE_S,
                   help="never delete chunks younger than this (default 1h; e.g. 30m, 2h)")
    g.add_argument("--keep-last", type=int, default=None,
                   help="keep each job's N newest snapshots (alone: remove the rest; with --max-age or "
                   "--keep-every: those decide beyond the N)")
    g.add_argument("--keep-every", type=int, default=None, help="keep every Kth snapshot of a job, remove others")
    g.add_argument("--max-age", type=age_arg, default=None, help="remove snapshots older than this (e.g. 7d)")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_gc)

    v = sub.choices.get("verify")
    if v is None:  # registered after the snapshot commands; stand alone if they are absent
        v = sub.add_parser("verify", help="re-check every checksum of a snapshot")
        v.add_argument("snapshot")
        v.add_argument("--store", default=None)
        v.add_argument("--json", action="store_true")
        v.set_defaults(func=None)
    v.add_argument("--deep", action="store_true",
                   help="content-addressed store: re-read and re-hash every chunk of the snapshot")
    v.add_argument("--key-file", type=Path, default=None, help="the job's key, for an encrypted snapshot")
    shallow = v.get_default("func")

    def verify(a: argparse.Namespace) -> int:
        if a.deep or shallow is None or is_remote(a.store):  # a chunk store is always verified chunk by chunk
            return cmd_verify_deep(a)
        code: int = shallow(a)
        return code

    v.set_defaults(func=verify)


def _info(s: Snapshot, latest: dict[str, str]) -> SnapshotInfo:
    return SnapshotInfo(s.id, s.job, s.created_at, s.seq, protected=s.mode == "stop" and latest.get(s.job) == s.id)


def cmd_gc(a: argparse.Namespace) -> int:
    store = _chunk_store(a.store)
    policy = Policy(keep_last=a.keep_last, keep_every=a.keep_every, max_age=a.max_age)
    decisions: list[RetentionDecision] = []
    if not policy.empty:
        snaps = store.snapshots()
        latest = {s.job: s.id for s in snaps}  # sorted oldest first: the last one per job wins
        decisions = decide([_info(s, latest) for s in snaps], policy, time.time())
        if not a.dry_run:
            for d in decisions:
                if not d.keep:
                    store.remove(d.snapshot.id)
    report = collect(store, dry_run=a.dry_run, grace=a.grace)
    removed = [d for d in decisions if not d.keep]
    if a.json:
        out: dict[str, Any] = report.to_json()
        out["store"] = store.backend.url
        out["retention"] = [{"snapshot": d.snapshot.id, "job": d.snapshot.job, "keep": d.keep, "reason": d.reason}
                            for d in decisions]
        emit_json(out)
        return 0
    verb = "would remove" if a.dry_run else "removed"
    if decisions:
        print(table(["snapshot", "job", "decision", "reason"],
                    [[d.snapshot.id, d.snapshot.job, "keep" if d.keep else "remove", d.reason] for d in decisions]))
        print(f"{verb} {len(removed)} of {len(decisions)} snapshots")
    if report.deferred:
        print(f"chunks: nothing deleted, {len(report.uploads_in_progress)} upload(s) in progress "
              f"({', '.join(report.uploads_in_progress)}); run gc again when they are done")
        return 0
    print(f"store {store.backend.url}: {report.snapshots} snapshots, {report.chunks} chunks, "
          f"{report.referenced} referenced, {report.unreferenced} unreferenced "
          f"({report.too_young} younger than the grace period)")
    print(f"{verb} {report.deleted} chunks, {human_bytes(report.bytes_freed)} freed "
          f"({report.seconds:.2f} s)")
    return 0


def cmd_verify_deep(a: argparse.Namespace) -> int:
    from cryosleep.store.crypto import load_key

    store = _chunk_store(a.store)
    snap = store.load(a.snapshot)
    try:  # the manifest's MAC, and the chunk index against it, before any chunk is read
        _, how = authentic(snap, trust_of(a))
    except CryosleepError as e:
        if not a.json:
            raise
        emit_json({"snapshot": snap.id, "store": store.backend.url, "ok": False, "authenticated": False,
                   "problems": [{"what": e.why or e.what}], "error": e.to_json()})
        return 1
    key = load_key(snap.job, a.key_file, required=snap.encryption is not None)
    t0 = time.monotonic()
    snap, problems, checked = store.verify(snap.id, key=key)
    seconds = time.monotonic() - t0
    if a.json:
        emit_json({"snapshot": snap.id, "store": store.backend.url, "ok": not problems, "authenticated": True,
                   "auth": how, "chunks_checked": checked, "bytes": snap.bytes, "seconds": round(seconds, 3),
                   "problems": [p.to_json() for p in problems]})
        return 1 if problems else 0
    if problems:
        raise StoreCorrupt(f"snapshot {snap.id} failed deep verification ({len(problems)} problems)",
                           "; ".join(p.what for p in problems[:5]) + (" ..." if len(problems) > 5 else ""),
                           "do not restore it; restore another snapshot and remove this one",
                           chunks=[p.chunk for p in problems if p.chunk])
    print(f"snapshot {snap.id}: {how}; {checked} chunks re-read and re-hashed, {len(snap.files)} files "
          f"({human_bytes(snap.bytes)}) intact in {seconds:.2f} s")
    return 0

