"""Reading a 32-byte secret from a key file or a variable: raw, 64 hex digits, or base64; a key file must be
readable by its owner alone. Shared by the encryption key (:mod:`cryosleep.store.crypto`) and the signing key
(:mod:`cryosleep.store.auth`); no third-party import, so the capture path can sign without them."""

from __future__ import annotations

import base64
import binascii
import os
import stat
from pathlib import Path

from cryosleep.errors import UsageError

__all__ = ["find_secret", "new_key_file", "parse_key", "read_key_file"]


def parse_key(raw: bytes, origin: str, hint: str) -> bytes:
    if len(raw) == 32:
        return raw
    text = raw.strip()
    try:
        if len(text) == 64:
            return bytes.fromhex(text.decode())
        decoded = base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        decoded = b""
    if len(decoded) == 32:
        return decoded
    raise UsageError(f"the key from {origin} is not 32 bytes (raw, 64 hex digits, or base64)",
                     f"it holds {len(raw)} bytes that decode to none of these", hint)


def read_key_file(path: Path, hint: str) -> bytes:
    try:
        st = path.stat()
        raw = path.read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read the key file {path}", str(e), hint) from e
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UsageError(f"the key file {path} is readable by others (mode {stat.S_IMODE(st.st_mode):o})",
                         "a key that others can read protects nothing", f"chmod 600 {path}")
    return parse_key(raw, str(path), hint)


def find_secret(key_file: Path | None, var: str, file_var: str, hint: str) -> tuple[bytes, str] | None:
    """(secret, where it was found) from, first match wins, ``key_file``, the variable ``var`` (the key itself),
    or the key file the variable ``file_var`` names; None when none of them is set."""
    if key_file is not None:
        return read_key_file(Path(key_file), hint), str(key_file)
    env = os.environ.get(var, "").strip()
    if env:
        return parse_key(env.encode(), f"${var}", hint), f"${var}"
    env_file = os.environ.get(file_var, "").strip()
    if env_file:
        return read_key_file(Path(env_file), hint), env_file
    return None


def new_key_file(path: Path) -> None:
    """Create ``path`` with 32 random bytes (hex), owner-only, in an owner-only directory; an existing file is
    kept (two processes creating it at once: one wins, both read the same key)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, os.urandom(32).hex().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # never replaces a key another process made meanwhile
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
