"""`cryosleep snapshot`, `ls`, `show`, `verify`, `resign`, `rm`: taking snapshots and looking after the store."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from cryosleep import paths
from cryosleep.agent.control import ControlClient
from cryosleep.cli import transfer
from cryosleep.cli.output import (
    PhasePrinter,
    emit_json,
    human_bytes,
    phase_table,
    require_root,
    seconds_arg,
    table,
    when,
)
from cryosleep.core.job import JobDir
from cryosleep.errors import StoreCorrupt, UsageError
from cryosleep.store import auth, persist
from cryosleep.store.local import LocalStore
from cryosleep.store.persist import is_remote, normalize_url, remove_record


def _store(a: argparse.Namespace) -> LocalStore:
    return LocalStore(a.store or paths.default_store())


def _chunk_store_url(a: argparse.Namespace) -> str | None:
    """The chunk store --store names: s3://..., or a directory holding only a chunk store (`run --store DIR`)."""
    if is_remote(a.store):
        return normalize_url(a.store)
    root = Path(a.store) if a.store else None
    if root is not None and (root / "cas" / "snapshots").is_dir() and not (root / "snapshots").is_dir():
        return str(root)
    return None


def add_snapshots(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("snapshot", help="capture every worker of a running job")
    s.add_argument("job")
    s.add_argument("--stop", action="store_true",
                   help="end the job once the snapshot is complete and verified (default: keep it running)")
    s.add_argument("--timeout", type=seconds_arg, default=600.0,
                   help="give up (and resume the job) after this (e.g. 600, 10m)")
    s.add_argument("--store", type=Path, default=None, help="store directory (default $CRYOSLEEP_STORE)")
    s.add_argument("--rehearse", action="store_true",
                   help="drain the job's NCCL ranks to a consistent cut, quiesce and rebuild their communicators, "
                   "and resume, capturing nothing (shows that the job can be cut, and the pause it costs)")
    s.add_argument("--no-precopy", dest="precopy", action="store_false",
                   help="dump the job's memory inside the pause, as without criu-uffd, instead of copying it first "
                   "while the job runs (docs/precopy.md)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_snapshot)

    ls = sub.add_parser("ls", help="list the snapshots in the store")
    ls.add_argument("--job")
    ls.add_argument("--store", type=Path, default=None)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_ls)

    sh = sub.add_parser("show", help="show a snapshot's manifest")
    sh.add_argument("snapshot")
    sh.add_argument("--store", type=Path, default=None)
    sh.add_argument("--json", action="store_true")
    sh.set_defaults(func=cmd_show)

    v = sub.add_parser("verify", help="re-check every checksum of a snapshot")
    v.add_argument("snapshot")
    v.add_argument("--store", type=Path, default=None)
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_verify)

    transfer.add_trust_options(v)

    rs = sub.add_parser("resign", help="sign a snapshot's manifest again under the job's key now (key rotation: "
                        "no image byte is copied or uploaded)")
    rs.add_argument("snapshot")
    rs.add_argument("--store", default=None, help="store directory or s3://bucket/prefix (default $CRYOSLEEP_STORE)")
    rs.add_argument("--from-key-file", type=Path, default=None, metavar="FILE",
                    help="the key it is signed with now (default: the job's key, found as `verify` finds it)")
    rs.add_argument("--sign-key-file", type=Path, default=None, metavar="FILE",
                    help="the key to sign it with (default: the job's key, found as a snapshot finds it)")
    rs.add_argument("--key-file", type=Path, default=None, help="the job's encryption key (a root of its signing key)")
    rs.add_argument("--allow-unsigned", action="store_true", help="sign a snapshot that is not signed yet")
    rs.add_argument("--json", action="store_true")
    rs.set_defaults(func=cmd_resign)

    rm = sub.add_parser("rm", help="remove snapshots from the store")
    rm.add_argument("snapshots", nargs="+")
    rm.add_argument("--store", type=Path, default=None)
    rm.add_argument("--json", action="store_true")
    rm.set_defaults(func=cmd_rm)


def cmd_snapshot(a: argparse.Namespace) -> int:
    require_root("taking a snapshot")
    job = JobDir(a.job)
    if not job.exists():
        job.read()  # raises NotFound with the right words
    client = ControlClient(job.socket, a.job)
    printer = PhasePrinter(not a.json)
    if a.rehearse and a.stop:
        raise UsageError("--rehearse and --stop cannot be combined", "a rehearsal captures nothing",
                         "drop one of them")
    if not a.json:
        what = "rehearsal (nothing captured)" if a.rehearse else "stop snapshot" if a.stop else "keep-running snapshot"
        sys.stderr.write(f"cryosleep: {what} of job {a.job}\n")
    store = str((a.store or paths.default_store()).resolve())
    req = {"op": "snapshot", "stop": a.stop, "timeout": a.timeout, "store": store, "rehearse": a.rehearse,
           "fault": os.environ.get("CRYOSLEEP_FAULT"), "precopy": a.precopy}
    bar = transfer.TransferPrinter(as_json=a.json)

    def on_event(msg: dict[str, object]) -> None:
        printer.event(msg)
        bar(msg)

    try:
        res = client.call(req, on_event=on_event)
    finally:
        bar.close()
    if a.json:
        emit_json(res)
        return 0
    if a.rehearse:
        print(f"job {res['job']}: consistent NCCL cut reached in {res['rounds']} round(s), pause "
              f"{res['pause_s']:.3f} s; nothing was captured")
        print(f"  {res['cut']}")
        print(phase_table(res["phases"]))
        return 0
    print(f"snapshot {res['snapshot']} of job {res['job']} ({res['mode']})")
    print(f"  pause {res['pause_s']:.3f} s, image {human_bytes(res['bytes'])} "
          f"(workers' memory {human_bytes(res['rss_bytes'])}), store {res['store']}")
    print(phase_table(res["phases"]))
    rec = res.get("persist")
    if rec:
        print(f"  {rec['remote']}: {transfer.summary(rec)}"
              + ("" if a.stop else " (the upload runs in the background; follow it with `cryosleep ls`)"))
    if a.stop:
        print(f"job {res['job']} is suspended; bring it back with `cryosleep restore {res['snapshot']}`"
              + (f" (or, on any machine, `cryosleep restore {res['snapshot']} --store {rec['remote']}`)"
                 if rec else ""))
    return 0


def cmd_ls(a: argparse.Namespace) -> int:
    if (url := _chunk_store_url(a)) is not None:
        return transfer.cmd_ls_remote(url, a.job, a.json)
    store = _store(a)
    items = store.manifests(a.job)
    recs = transfer.records(store)
    # Snapshots whose local copy was removed once persisted (bounded staging) are listed from their records.
    gone = sorted((r for sid, r in recs.items() if r.get("local") == "removed" and (not a.job or r["job"] == a.job)),
                  key=lambda r: r["events"][0]["t"] if r.get("events") else 0)
    if a.json:
        emit_json([{"snapshot": m.id, "job": m.job_name, "mode": m.mode, "created_at": m.created_at,
                    "bytes": m.bytes, "pause_s": m.pause_s, "ranks": [r for n in m.nodes for r in n.ranks],
                    "restored_from": m.restored_from, "local": True, "persist": recs.get(m.id)} for m in items]
                  + [{"snapshot": r["snapshot"], "job": r["job"], "mode": r["mode"], "bytes": r["bytes_total"],
                      "local": False, "persist": r} for r in gone])
        return 0
    rows = [[m.id, m.job_name, m.mode, when(m.created_at), human_bytes(m.bytes), f"{m.pause_s:.3f} s",
             transfer.summary(recs.get(m.id))] for m in items]
    rows += [[r["snapshot"], r["job"], r["mode"], when(r["events"][0]["t"] if r.get("events") else None),
              human_bytes(r["bytes_total"]), "-",
              transfer.summary(r) + f" (in {r['remote']} only)"] for r in gone]
    print(table(["snapshot", "job", "mode", "created", "size", "pause", "persistence"], rows))
    return 0


def cmd_show(a: argparse.Namespace) -> int:
    if (url := _chunk_store_url(a)) is not None:
        return transfer.cmd_show_remote(url, a.snapshot, a.json)
    store = _store(a)
    m = store.load(a.snapshot)
    rec = transfer.records(store).get(m.id)
    if a.json:
        emit_json({**m.to_json(), "persist": rec})
        return 0
    print(f"snapshot  {m.id}\njob       {m.job_name} ({len(m.job['program'])} args: {' '.join(m.job['program'])})")
    print(f"mode      {m.mode}\ncreated   {when(m.created_at)}\nsize      {human_bytes(m.bytes)}")
    print(f"pause     {m.pause_s:.3f} s\nfrom      {m.restored_from or '-'}")
    print(f"persisted {transfer.summary(rec)}" + (f" ({rec['remote']})" if rec else ""))
    print("host      " + ", ".join(f"{k}={v}" for k, v in sorted(m.host.items())))
    for n in m.nodes:
        print(f"node {n.node_rank}: ranks {n.ranks}, {n.processes} processes, {len(n.files)} files, "
              f"{human_bytes(n.bytes)}, {len(n.staged)} job files staged")
        if n.nccl.ranks:
            comms = {c.ident for r in n.nccl.ranks for c in r.comms}
            print(f"  NCCL: ranks {[r.rank for r in n.nccl.ranks]} cut with {len(comms)} communicator(s), "
                  "rebuilt on restore")
        out = n.outbound
        if out.reset or out.kept:
            undrained = len(out.undrained)
            print(f"  outside the job: {len(out.reset)} connection(s) reset on restore"
                  + (f" ({undrained} with unacknowledged bytes after {out.waited_s or 0:g} s)" if undrained else "")
                  + f", {len(out.kept)} kept (--outbound-keep/--outbound-reset)")
        fast = n.gpu.fast_path
        moved = {r: e for r, e in fast.ranks.items() if e.image} if fast else {}
        if fast and (moved or fast.plain):
            size = human_bytes(sum(e.bytes for e in moved.values()))
            plain = sorted(fast.plain.items())
            print(f"  fast path: ranks {sorted(moved, key=int)} moved {size} of device memory themselves"
                  + "".join(f"; rank {r} took the plain path: {why}" for r, why in plain))
    print(phase_table(m.phases))
    return 0


def cmd_verify(a: argparse.Namespace) -> int:
    """The manifest's MAC and paths (store/auth.py), then every file against its checksum."""
    store = _store(a)
    sid = store.resolve(a.snapshot)
    try:
        how = auth.authenticate(store.load(sid), sid, transfer.trust_of(a))
    except auth.Unauthenticated as e:
        if not a.json:
            raise
        emit_json({"snapshot": sid, "ok": False, "authenticated": False, "problems": [e.why], "error": e.to_json()})
        return 1
    problems = store.verify(sid)
    if a.json:
        emit_json({"snapshot": sid, "ok": not problems, "authenticated": True, "auth": how, "problems": problems})
        return 1 if problems else 0
    if problems:
        raise StoreCorrupt(f"snapshot {sid} failed verification", "; ".join(problems),
                           "do not restore it; restore another snapshot and remove this one")
    print(f"snapshot {sid}: {how}; every file matches its checksum")
    return 0


def cmd_resign(a: argparse.Namespace) -> int:
    """Key rotation: a snapshot authenticated under its current key (``--from-key-file``), its files checked,
    then its manifest signed under the job's key now (``--sign-key-file``...); no image byte is copied."""
    old = auth.Trust(key_file=a.key_file, sign_key_file=a.from_key_file, allow_unsigned=a.allow_unsigned)
    new = auth.Trust(key_file=a.key_file, sign_key_file=a.sign_key_file)
    if (url := _chunk_store_url(a)) is not None:
        snap, before, key_id = persist.resign_remote(url, a.snapshot, old, new)
        sid, where = snap.id, url
    else:
        store = _store(a)
        sid, where = store.resolve(a.snapshot), str(store.root)
        manifest = store.load(sid)
        before = auth.authenticate(manifest, sid, old)
        problems = store.verify(sid)  # re-signing must not vouch for files that do not match
        if problems:
            raise StoreCorrupt(f"snapshot {sid} failed verification; it was not re-signed", "; ".join(problems[:5]),
                               "do not restore it; restore another snapshot and remove this one")
        _, key = auth.resign(manifest, sid, old, new)
        store.rewrite(manifest, sign=False)
        key_id = key.key_id
    if a.json:
        emit_json({"snapshot": sid, "store": where, "before": before, "key_id": key_id})
    else:
        print(f"snapshot {sid}: was {before}; now signed with key {key_id}")
    return 0


def cmd_rm(a: argparse.Namespace) -> int:
    if (url := _chunk_store_url(a)) is not None:
        return transfer.cmd_rm_remote(url, a.snapshots, a.json)
    store = _store(a)
    removed = [store.remove(ref) for ref in a.snapshots]
    for sid in removed:  # a copy in the job's remote store stays: `cryosleep rm SNAPSHOT --store URL` removes it
        remove_record(store, sid)
    if a.json:
        emit_json({"removed": removed})
    else:
        for sid in removed:
            print(f"removed {sid}")
    return 0
