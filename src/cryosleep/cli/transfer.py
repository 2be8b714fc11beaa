"""The remote store on the command line: `run`/`restore` options, fetching before a restore, and the
progress of uploads and downloads (a bar on a terminal, plain lines otherwise, JSON lines with --json).

Heavy modules (the chunk store needs zstandard and cryptography) are imported only when a remote store
is used.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from cryosleep.cli.output import age_arg, human_bytes
from cryosleep.errors import UsageError
from cryosleep.store import persist
from cryosleep.store.auth import Trust
from cryosleep.store.local import LocalStore

__all__ = ["TransferPrinter", "add_persist_options", "add_trust_options", "remote_config", "retention_of",
           "say_fetched", "summary", "trust_of"]


def add_trust_options(p: argparse.ArgumentParser) -> None:
    """--sign-key-file and --allow-unsigned: how a snapshot is authenticated (docs/security.md)."""
    p.add_argument("--sign-key-file", type=Path, default=None, metavar="FILE",
                   help="the job's signing key (default $CRYOSLEEP_SIGN_KEY, $CRYOSLEEP_SIGN_KEY_FILE, "
                   "$CRYOSLEEP_SIGN_KEY_COMMAND, $CRYOSLEEP_HOME/keys/JOB.sign, the job's --key-file, the host's key)")
    p.add_argument("--allow-unsigned", action="store_true",
                   help="accept a snapshot whose manifest has no MAC (an altered or foreign one is still refused)")


def trust_of(a: argparse.Namespace) -> Trust:
    return Trust(key_file=getattr(a, "key_file", None), sign_key_file=getattr(a, "sign_key_file", None),
                 allow_unsigned=bool(getattr(a, "allow_unsigned", False)))


def add_persist_options(p: argparse.ArgumentParser, *, store: bool = True) -> None:
    """--store (when the command lacks it), --key-file and --local-keep."""
    if store:
        p.add_argument("--store", default=None, metavar="URL",
                       help="persist every snapshot into this chunk store: a directory or s3://bucket/prefix "
                       "(credentials and endpoint from the AWS_* variables and ~/.aws files); the local store "
                       "($CRYOSLEEP_STORE) stages them")
    p.add_argument("--key-file", type=Path, default=None,
                   help="encrypt snapshots at rest with this job key (default $CRYOSLEEP_KEY, $CRYOSLEEP_KEY_FILE, "
                   "$CRYOSLEEP_HOME/keys/JOB.key, else unencrypted)")
    p.add_argument("--local-keep", type=int, default=persist.LOCAL_KEEP, metavar="N",
                   help="keep local copies of at most N persisted snapshots of the job (never one not yet "
                   f"persisted; default {persist.LOCAL_KEEP})")
    p.add_argument("--keep-last", type=int, default=None, metavar="N",
                   help="in the store: after each upload, keep the job's N newest snapshots and remove older ones "
                   "that --keep-every/--max-age do not keep (as `cryosleep gc`; chunks go at the next gc)")
    p.add_argument("--keep-every", type=int, default=None, metavar="K",
                   help="in the store: keep every Kth snapshot of the job beyond --keep-last, remove the others")
    p.add_argument("--max-age", type=age_arg, default=None, metavar="AGE",
                   help="in the store: remove the job's snapshots older than AGE (e.g. 7d) beyond --keep-last")


def retention_of(a: argparse.Namespace) -> dict[str, Any] | None:
    """The --keep-last/--keep-every/--max-age policy for the job's spec (None: keep everything)."""
    d = {"keep_last": a.keep_last, "keep_every": a.keep_every, "max_age": a.max_age}
    return {k: v for k, v in d.items() if v is not None} or None


def remote_config(job: str, url: str | Path | None, key_file: Path | None, local_keep: int,
                  retain: dict[str, Any] | None = None) -> dict[str, Any]:
    """The job spec's ``persist`` entry, checked (store reachable, key readable, policy sound); {} without a
    store."""
    if url is None:
        if retain:
            raise UsageError("--keep-last, --keep-every and --max-age apply to the store", "no --store was given",
                             "add --store URL, or thin a store later with `cryosleep gc`")
        return {}
    text = persist.normalize_url(url)
    if not persist.is_remote(text):
        text = str(Path(text).resolve())
    cfg = persist.RemoteConfig(text, str(key_file.resolve()) if key_file else None, local_keep, retain)
    persist.check_config(job, cfg)
    return cfg.to_json()


def say_fetched(fetched: dict[str, Any] | None, sid: str, into: Path) -> None:
    """The line a restore shows once it fetched its snapshot from a remote store (nothing when it was local)."""
    if fetched:
        sys.stderr.write(f"cryosleep: fetched {sid} from {fetched['store']} ({human_bytes(int(fetched['bytes']))}, "
                         f"every chunk verified, {float(fetched['seconds']):.2f} s, "
                         f"{human_bytes(float(fetched['rate']))}/s) into {into}\n")


def summary(rec: dict[str, Any] | None) -> str:
    """A snapshot's persistence in one line, from its record's JSON."""
    if not rec:
        return "local only"
    state = rec.get("state", "?")
    total = int(rec.get("bytes_total") or 0)
    if state in ("uploading", "verifying") and total:
        return f"{state} {100 * int(rec.get('bytes_done') or 0) / total:.0f}%"
    if state == "persisted":
        where = {"removed": ", local copy removed", "fetched": ", fetched"}.get(str(rec.get("local")), "")
        if rec.get("upload_s"):
            return (f"persisted+verified: {human_bytes(int(rec.get('bytes_sent') or 0))} sent, "
                    f"{100 * float(rec.get('dedup') or 0):.0f}% dedup, "
                    f"{human_bytes(float(rec.get('upload_rate') or 0))}/s{where}")
        return f"persisted+verified{where}"
    if state in ("failed", "retrying"):
        return f"{state}: {rec.get('reason', '')}"
    return str(state)


class TransferPrinter:
    """Progress of uploads, verifies and downloads, fed the ``transfer`` events (see store.persist)."""

    def __init__(self, *, as_json: bool = False, quiet: bool = False, out: TextIO | None = None) -> None:
        self.out = out or sys.stderr
        self.as_json = as_json
        self.quiet = quiet
        self.tty = self.out.isatty() and not as_json
        self._step: str | None = None
        self._t0 = time.monotonic()
        self._last_line = 0.0
        self._open = False

    def __call__(self, ev: dict[str, Any]) -> None:
        if ev.get("event") != "transfer" or self.quiet:
            return
        if self.as_json:
            self.out.write(json.dumps(ev) + "\n")
            self.out.flush()
            return
        step = str(ev.get("step"))
        if step != self._step:
            self.close()
            self._step, self._t0 = step, time.monotonic()
        done, total = int(ev.get("bytes") or 0), int(ev.get("total") or 0)
        secs = max(1e-6, time.monotonic() - self._t0)
        pct = 100 * done / total if total else 100.0
        text = f"  {step:8s} {pct:5.1f}%  {human_bytes(done)} / {human_bytes(total)}  {human_bytes(done / secs)}/s"
        if self.tty:
            width = 24
            fill = int(width * pct / 100)
            self.out.write(f"\r  {step:8s} [{'#' * fill}{'.' * (width - fill)}]{text[len(step) + 10:]}\033[K")
            self._open = True
            if ev.get("done"):
                self.close()
        elif ev.get("done") or time.monotonic() - self._last_line >= 2.0:
            self._last_line = time.monotonic()
            self.out.write(text + "\n")
        self.out.flush()

    def event(self, msg: dict[str, Any]) -> None:
        self(msg)

    def close(self) -> None:
        if self._open:
            self.out.write("\n")
            self.out.flush()
            self._open = False


# --------------------------------------------------------------------- ls / show / rm over a chunk store


def _chunk_snapshot_json(s: Any) -> dict[str, Any]:
    m = s.manifest or {}
    return {"snapshot": s.id, "job": s.job, "mode": s.mode, "created_at": s.created_at, "bytes": s.bytes,
            "stored_bytes": s.stored_bytes, "chunks": sum(len(f.chunks) for f in s.files),
            "files": len(s.files), "seq": s.seq, "encryption": s.encryption, "chunking": s.chunking,
            "compression": s.compression, "pause_s": m.get("pause_s"),
            "ranks": [r for n in m.get("nodes", []) for r in n.get("ranks", [])]}


def cmd_ls_remote(url: str, job: str | None, as_json: bool) -> int:
    from cryosleep.cli.output import emit_json, table, when

    snaps = persist.open_chunk_store(url).snapshots(job)
    if as_json:
        emit_json([{**_chunk_snapshot_json(s), "store": persist.normalize_url(url), "state": "persisted"}
                   for s in snaps])
        return 0
    rows = [[s.id, s.job, s.mode, when(s.created_at), human_bytes(s.bytes), human_bytes(s.stored_bytes),
             "yes" if s.encryption else "no"] for s in snaps]
    print(table(["snapshot", "job", "mode", "created", "size", "stored", "encrypted"], rows))
    return 0


def cmd_show_remote(url: str, ref: str, as_json: bool) -> int:
    from cryosleep.cli.output import emit_json, phase_table, when

    s = persist.open_chunk_store(url).load(ref)
    if as_json:
        emit_json({**_chunk_snapshot_json(s), "store": persist.normalize_url(url), "manifest": s.manifest})
        return 0
    m = s.manifest or {}
    print(f"snapshot  {s.id}\njob       {s.job}\nmode      {s.mode}\ncreated   {when(s.created_at)}")
    print(f"store     {persist.normalize_url(url)} (persisted; read back and verified when it was stored)")
    print(f"size      {human_bytes(s.bytes)} in {len(s.files)} files, {sum(len(f.chunks) for f in s.files)} chunks, "
          f"{human_bytes(s.stored_bytes)} stored ({s.compression}, {s.chunking.get('method', '?')} chunking)")
    enc = s.encryption
    print(f"encrypted {'no' if not enc else enc['algorithm'] + ', key ' + enc['key_id']}")
    if m.get("pause_s") is not None:
        print(f"pause     {float(m['pause_s']):.3f} s")
    if m.get("phases"):
        print(phase_table(m["phases"]))
    return 0


def cmd_rm_remote(url: str, refs: list[str], as_json: bool) -> int:
    from cryosleep.cli.output import emit_json

    store = persist.open_chunk_store(url)
    removed = [store.remove(r) for r in refs]
    if as_json:
        emit_json({"removed": removed, "store": persist.normalize_url(url)})
    else:
        for sid in removed:
            print(f"removed {sid} from {persist.normalize_url(url)} (its chunks go at the next `cryosleep gc`)")
    return 0


def records(store: LocalStore) -> dict[str, dict[str, Any]]:
    """Every snapshot's persistence record in the local store, as JSON."""
    return {sid: r.to_json() for sid, r in persist.load_records(store).items()}
