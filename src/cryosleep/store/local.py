"""The local directory store.

Layout::

    <root>/snapshots/<id>/manifest.json   a complete, committed snapshot
    <root>/snapshots/<id>/nodes/...       its image files
    <root>/.staging/<id>/                 a snapshot being written; never listed, removed on failure

A snapshot becomes visible only by an atomic rename from ``.staging`` once every file is written, hashed
and the manifest is on disk, so a crash at any point leaves no half snapshot listed as valid.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import stat
import time
from collections.abc import Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cryosleep.errors import CryosleepError, NotFound, StoreCorrupt, UsageError
from cryosleep.store import auth
from cryosleep.store.manifest import FileEntry, Manifest

CHUNK = 4 * 1024 * 1024


def sha256_file(path: Path, limit: int | None = None) -> str:
    h = hashlib.sha256()
    left = limit
    with open(path, "rb") as f:
        while True:
            want = CHUNK if left is None else min(CHUNK, left)
            if want == 0:
                break
            block = f.read(want)
            if not block:
                break
            h.update(block)
            if left is not None:
                left -= len(block)
    return h.hexdigest()


def hash_tree(base: Path, rel_dirs: Iterable[str], workers: int = 4,
              known: Mapping[str, str] | None = None) -> list[FileEntry]:
    """Size and SHA-256 of every regular file under ``base/rel_dir`` for each dir, paths relative to base.
    ``known`` gives the SHA-256 of files hashed as they were written (relative path -> hex): not read again."""
    files: list[Path] = []
    for rel in rel_dirs:
        top = base / rel
        if top.is_dir():
            files.extend(p for p in sorted(top.rglob("*")) if p.is_file() and not p.is_symlink())
    known = known or {}

    def digest(p: Path) -> str:
        return known.get(str(p.relative_to(base))) or sha256_file(p)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        sums = list(pool.map(digest, files))
    return [
        FileEntry(path=str(p.relative_to(base)), size=p.stat().st_size, sha256=s)
        for p, s in zip(files, sums, strict=True)
    ]


def _tree(top: Path, base: Path) -> list[str]:
    """Every entry under ``top`` that is not a directory (links included), relative to ``base``."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(top):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            out.append(os.path.relpath(os.path.join(dirpath, name), base))
    return out


def make_links(base: Path, manifest: Manifest) -> None:
    """The links the manifest describes (a pre-copied node's ``criu/parent``), made where missing; one that is
    there must be exactly that link (StoreCorrupt otherwise)."""
    for rel, target in manifest.links().items():
        p = base / rel
        if p.is_symlink() and os.readlink(p) == target:
            continue
        if p.exists() or p.is_symlink():
            raise StoreCorrupt(f"the snapshot's {rel} is not the link its manifest describes",
                               f"expected a link to {target}", "restore another snapshot")
        p.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, p)


def _sign(manifest: Manifest) -> None:
    """Sign with the job's key (the key file of its remote store's config being the root when it names one)."""
    persist = manifest.job.get("persist")
    key_file = persist.get("key_file") if isinstance(persist, dict) else None
    key = auth.signing_key(manifest.job_name, auth.Trust(key_file=Path(key_file) if key_file else None),
                           create=True)
    assert key is not None  # create=True finds or makes one
    auth.sign(manifest, key)


def _write_manifest(path: Path, manifest: Manifest) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(manifest.dumps())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def new_snapshot_id(job: str) -> str:
    return f"{job}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"


@dataclass
class Staging:
    """A snapshot being written."""

    id: str
    path: Path

    def node_dir(self, node_rank: int) -> Path:
        return self.path / "nodes" / str(node_rank)


class LocalStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @property
    def snapshots(self) -> Path:
        return self.root / "snapshots"

    @property
    def staging(self) -> Path:
        return self.root / ".staging"

    def begin(self, job: str) -> Staging:
        sid = new_snapshot_id(job)
        path = self.staging / sid
        try:
            path.mkdir(parents=True)
        except OSError as e:
            raise CryosleepError(
                f"cannot create a snapshot in the store {self.root}",
                str(e),
                "check that the store directory is writable and has space, or pass --store",
            ) from e
        return Staging(sid, path)

    def abort(self, staging: Staging) -> None:
        shutil.rmtree(staging.path, ignore_errors=True)

    def commit(self, staging: Staging, manifest: Manifest, *, sign: bool = True) -> Path:
        """Sign the manifest (``sign``: False keeps the MAC it has, a fetched snapshot's), write it and publish
        the snapshot atomically."""
        manifest.complete = True
        if sign:
            _sign(manifest)
        make_links(staging.path, manifest)  # a fetched image's: the chunk store holds files, not links
        _write_manifest(staging.path / "manifest.json", manifest)
        self.snapshots.mkdir(parents=True, exist_ok=True)
        final = self.snapshots / staging.id
        os.replace(staging.path, final)
        dfd = os.open(self.snapshots, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return final

    def rewrite(self, manifest: Manifest, *, sign: bool = True) -> None:
        """Write a committed snapshot's manifest again (its final phase times; a new MAC), signed anew."""
        if sign:
            _sign(manifest)
        _write_manifest(self.path_of(manifest.id) / "manifest.json", manifest)

    def path_of(self, sid: str) -> Path:
        return self.snapshots / sid

    def resolve(self, ref: str) -> str:
        """A snapshot id from an exact id or a unique prefix."""
        if not ref or "/" in ref or ref.startswith("."):
            raise UsageError(f"invalid snapshot id {ref!r}", "", "list snapshots with `cryosleep ls`")
        if (self.snapshots / ref / "manifest.json").exists():
            return ref
        matches = [p.name for p in self.snapshots.glob(f"{ref}*")] if self.snapshots.exists() else []
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise NotFound(
                f"no snapshot {ref!r} in the store {self.root}",
                "no snapshot id starts with it",
                "list snapshots with `cryosleep ls` (and check --store / CRYOSLEEP_STORE)",
            )
        raise UsageError(
            f"snapshot id {ref!r} is ambiguous",
            f"it matches {', '.join(sorted(matches))}",
            "give more of the id",
        )

    def load(self, ref: str) -> Manifest:
        sid = self.resolve(ref)
        path = self.snapshots / sid / "manifest.json"
        try:
            return Manifest.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            raise NotFound(f"snapshot {sid} has no manifest", f"{path} is missing",
                           "the snapshot is incomplete; remove it with `cryosleep rm`") from None
        except (ValueError, RecursionError) as e:  # ManifestError is a ValueError
            raise StoreCorrupt(
                f"the manifest of snapshot {sid} cannot be read",
                str(e),
                "the snapshot is damaged; restore another one (`cryosleep ls`) and remove this one",
            ) from e

    def manifests(self, job: str | None = None) -> list[Manifest]:
        out: list[Manifest] = []
        if not self.snapshots.exists():
            return out
        for d in self.snapshots.iterdir():
            if not (d / "manifest.json").exists():
                continue
            try:
                m = self.load(d.name)
            except CryosleepError:
                continue
            if job is None or m.job_name == job:
                out.append(m)
        out.sort(key=lambda m: m.created_at)
        return out

    def verify(self, ref: str, skip: Collection[str] = (), sizes_only: Collection[str] = ()) -> list[str]:
        """Every problem found re-checking the snapshot's files against its manifest (empty: intact). ``skip``:
        paths (relative to the snapshot) the caller checks itself as it reads them anyway; ``sizes_only``: paths
        checked here for presence, type and size, whose content the caller hashes as it reads them."""
        m = self.load(ref)
        base = self.snapshots / m.id
        entries = [f for n in m.nodes for f in n.files if f.path not in skip]
        problems: list[str] = []

        def check(f: FileEntry) -> str | None:
            p = base / f.path
            try:
                st = p.lstat()
            except FileNotFoundError:
                return f"{f.path}: missing"
            except OSError as e:  # a path the manifest names that is no file (its MAC is checked apart)
                return f"{f.path}: cannot be read ({e.strerror})"
            if not stat.S_ISREG(st.st_mode):
                return f"{f.path}: not a regular file (a link or a device put in its place)"
            size = st.st_size
            if size != f.size:
                return f"{f.path}: size {size}, expected {f.size} (truncated or altered)"
            if f.path in sizes_only:
                return None
            actual = sha256_file(p)
            if actual != f.sha256:
                return f"{f.path}: sha256 {actual[:16]}..., expected {f.sha256[:16]}... (altered)"
            return None

        listed = {f.path for n in m.nodes for f in n.files}
        try:
            links = m.links()
        except ValueError as e:
            links = {}
            problems.append(str(e))
        for rel in _tree(base / "nodes", base):  # a file CRIU would read that the manifest does not name
            if rel in links:
                p = base / rel
                if not p.is_symlink() or os.readlink(p) != links[rel]:
                    problems.append(f"{rel}: not the link to {links[rel]} the manifest describes")
            elif rel not in listed:
                problems.append(f"{rel}: not in the manifest (added after the snapshot)")
        problems += [f"{rel}: missing (the link to {t})" for rel, t in links.items() if not (base / rel).is_symlink()]
        with ThreadPoolExecutor(max_workers=max(4, min(16, os.cpu_count() or 4))) as pool:  # large files: I/O, hashlib
            for problem in pool.map(check, entries):
                if problem:
                    problems.append(problem)
        if not m.complete:
            problems.append("manifest is not marked complete")
        return problems

    def remove(self, ref: str) -> str:
        sid = self.resolve(ref)
        path = self.snapshots / sid
        trash = self.staging / f"rm-{sid}-{secrets.token_hex(2)}"
        self.staging.mkdir(parents=True, exist_ok=True)
        os.replace(path, trash)  # atomic: it is no longer listed from here on
        shutil.rmtree(trash, ignore_errors=True)
        return sid
