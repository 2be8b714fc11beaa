"""Where the content-addressed store keeps its objects: one small interface, two backends.

A backend stores named objects (``chunks/ab/ab12...``, ``snapshots/<id>.json``): put, get, exists/stat,
list and delete, with streaming both ways (``put_stream`` from a file object, ``open`` to read one), and
an integrity check on both sides of every transfer. Object names are ``/``-separated relative paths
without ``..``. ``ObjectInfo.mtime`` comes from the backend's own clock (the file system's, the S3
server's), so the GC compares times from one clock only (see :mod:`cryosleep.store.gc`).

Backends, picked by :func:`cryosleep.store.urls.open_backend` from a store URL:

- a directory path: :class:`LocalBackend` over ``<dir>/cas/`` (beside the directory store's
  ``snapshots/``); writes go to a temporary file, are fsynced and renamed into place;
- ``s3://bucket/prefix``: :class:`cryosleep.store.s3.S3Backend` (credentials, region and endpoint from the
  usual AWS variables and config files; ``$CRYOSLEEP_S3_ENDPOINT`` or ``AWS_ENDPOINT_URL`` for other
  S3-compatible servers).

Errors (in the one tree of :mod:`cryosleep.errors`): ``ObjectNotFound`` (the named object does not exist),
``BackendError`` (the backend failed: I/O, network, server; ``retryable`` says if it may pass) and
``IntegrityError`` (bytes read or written do not match their checksum).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from cryosleep.errors import (
    BackendError,
    IntegrityError,
    ObjectNotFound,
    UsageError,
)

__all__ = [
    "Backend",
    "LocalBackend",
    "ObjectInfo",
    "check_name",
]

_COPY = 8 << 20


@dataclass(frozen=True)
class ObjectInfo:
    name: str
    size: int
    mtime: float  # seconds since the epoch, by the backend's clock


class Backend(Protocol):
    """The store's view of a backend. Implementations are safe to call from many threads at once."""

    url: str

    def put(self, name: str, data: bytes) -> ObjectInfo:
        """Store ``data`` under ``name`` (replacing any object there), verified by the backend."""
        ...

    def put_stream(self, name: str, f: BinaryIO, size: int) -> ObjectInfo:
        """Store ``size`` bytes read from ``f`` without holding them all in memory (multipart on S3)."""
        ...

    def get(self, name: str) -> bytes:
        """The object's bytes, checked against the backend's checksum where it keeps one."""
        ...

    def open(self, name: str) -> BinaryIO:
        """A stream of the object's bytes (the caller closes it)."""
        ...

    def stat(self, name: str) -> ObjectInfo | None:
        """The object's size and time, or None when it does not exist."""
        ...

    def exists(self, name: str) -> bool: ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose name starts with ``prefix``, in no promised order."""
        ...

    def delete(self, name: str) -> None:
        """Remove the object; removing one that does not exist is not an error."""
        ...


def check_name(name: str) -> str:
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise UsageError(f"invalid object name {name!r}", "names are relative, /-separated, without . or ..")
    return name


class LocalBackend:
    """Objects as files under ``root`` (``root/<name>``); temporary files under ``root/.tmp``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.url = str(self.root)
        self._tmp = self.root / ".tmp"

    def _path(self, name: str) -> Path:
        return self.root / check_name(name)

    def _error(self, what: str, e: OSError) -> BackendError:
        return BackendError(what, str(e), f"check that {self.root} exists, is writable and has space")

    def _commit(self, tmp: Path, name: str, size: int, digest: str, want: str | None) -> ObjectInfo:
        if want is not None and digest != want:
            tmp.unlink(missing_ok=True)
            raise IntegrityError(f"object {name}: the bytes written do not match what was read",
                                 f"sha256 {digest}, expected {want}", "retry; check the disk")
        final = self._path(name)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, final)
        st = final.stat()
        if st.st_size != size:
            raise IntegrityError(f"object {name} is {st.st_size} bytes on disk, {size} were written", "",
                                 "check the disk")
        return ObjectInfo(name, st.st_size, st.st_mtime)

    def _tmpfile(self) -> Path:
        self._tmp.mkdir(parents=True, exist_ok=True)
        return self._tmp / secrets.token_hex(8)

    def put(self, name: str, data: bytes) -> ObjectInfo:
        tmp = self._tmpfile()
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            with open(tmp, "rb") as f:  # read back what reached the file system
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            return self._commit(tmp, name, len(data), digest, hashlib.sha256(data).hexdigest())
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise self._error(f"cannot write object {name}", e) from e

    def put_stream(self, name: str, f: BinaryIO, size: int) -> ObjectInfo:
        tmp = self._tmpfile()
        h = hashlib.sha256()
        try:
            with open(tmp, "wb") as out:
                left = size
                while left > 0:
                    block = f.read(min(_COPY, left))
                    if not block:
                        raise BackendError(f"object {name}: the source ended {left} bytes early")
                    h.update(block)
                    out.write(block)
                    left -= len(block)
                out.flush()
                os.fsync(out.fileno())
            with open(tmp, "rb") as back:
                digest = hashlib.file_digest(back, "sha256").hexdigest()
            return self._commit(tmp, name, size, digest, h.hexdigest())
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise self._error(f"cannot write object {name}", e) from e
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def get(self, name: str) -> bytes:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {name} in {self.url}") from None
        except OSError as e:
            raise self._error(f"cannot read object {name}", e) from e

    def open(self, name: str) -> BinaryIO:
        try:
            return open(self._path(name), "rb")
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {name} in {self.url}") from None

    def stat(self, name: str) -> ObjectInfo | None:
        try:
            st = self._path(name).stat()
        except FileNotFoundError:
            return None
        return ObjectInfo(name, st.st_size, st.st_mtime)

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        top = self.root
        # Walk only the directory the prefix names, not the whole store.
        head = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = top / head if head else top
        if not start.is_dir():
            return
        for dirpath, dirnames, filenames in os.walk(start):
            if Path(dirpath) == top:
                dirnames[:] = [d for d in dirnames if d != ".tmp"]
            for fn in filenames:
                full = Path(dirpath) / fn
                name = full.relative_to(top).as_posix()
                if name.startswith(prefix):
                    try:
                        st = full.stat()
                    except FileNotFoundError:
                        continue
                    yield ObjectInfo(name, st.st_size, st.st_mtime)

    def delete(self, name: str) -> None:
        try:
            self._path(name).unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self._error(f"cannot delete object {name}", e) from e

    def destroy(self) -> None:
        """Remove every object (tests)."""
        shutil.rmtree(self.root, ignore_errors=True)
