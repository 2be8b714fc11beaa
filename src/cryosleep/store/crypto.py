"""Encryption at rest: one key per job, AES-256-GCM per chunk, keyed content addresses.

A job's key is 32 random bytes (``cryosleep`` never makes one up: ``python -c "import os;
print(os.urandom(32).hex())" > job.key``), found, first match wins, in:

1. the key file named by the caller (``--key-file``);
2. ``$CRYOSLEEP_KEY``: the key itself, 64 hex digits or base64;
3. ``$CRYOSLEEP_KEY_FILE``: a key file;
4. ``$CRYOSLEEP_HOME/keys/<job>.key``: the job's key file, if it exists.

A key file holds the 32 bytes raw, or as hex or base64 text, and must not be readable by group or others.

Four sub-keys are derived with HKDF-SHA256 (distinct ``info`` strings): ``enc`` encrypts, ``addr`` keys
the content addresses, ``id`` gives the key's fingerprint that manifests record, ``sign`` signs the job's
manifests when no signing key of its own is configured (:mod:`cryosleep.store.auth`). A chunk's address is then
``HMAC-SHA256(addr, SHA-256(plaintext))`` rather than the plaintext hash itself, so the store reveals
neither the hash of any plaintext nor, across jobs with different keys, which chunks they share (each key
gets its own address space; dedup still works within a key). The address is bound into the ciphertext as
GCM's associated data, so a chunk copied to another address fails authentication. The 12-byte nonce is
random per chunk (at most 2**32 chunks per key keeps the collision risk negligible).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from cryosleep import paths
from cryosleep.errors import CryosleepError, UsageError
from cryosleep.store.keyfile import find_secret, read_key_file

__all__ = ["ALGORITHM", "DecryptError", "JobKey", "load_key"]

ALGORITHM = "AES-256-GCM"
NONCE = 12
KEY_HINT = ("give the job's key with --key-file FILE, $CRYOSLEEP_KEY (64 hex digits) or $CRYOSLEEP_KEY_FILE, "
            "or put it in $CRYOSLEEP_HOME/keys/<job>.key")


class DecryptError(Exception):
    """GCM authentication failed: the wrong key, or altered bytes."""


def _derive(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"cryosleep-store-v1", info=info).derive(secret)


@dataclass(frozen=True)
class JobKey:
    """A job's key, with its derived sub-keys. ``key_id`` (16 hex digits) identifies it in manifests."""

    enc: bytes
    addr: bytes
    key_id: str
    origin: str  # where it was found, for messages (never the key itself)
    sign: bytes = b""  # the manifests' signing key when this key is the root of it (cryosleep.store.auth)

    @classmethod
    def from_secret(cls, secret: bytes, origin: str = "memory") -> JobKey:
        if len(secret) != 32:
            raise UsageError(f"the key from {origin} is {len(secret)} bytes, not 32",
                             "AES-256 needs a 32-byte key", KEY_HINT)
        return cls(_derive(secret, b"enc"), _derive(secret, b"addr"), _derive(secret, b"id")[:8].hex(), origin,
                   _derive(secret, b"sign"))

    def address(self, plain_sha256: bytes) -> str:
        return hmac.new(self.addr, plain_sha256, hashlib.sha256).hexdigest()

    def seal(self, data: bytes, aad: bytes) -> bytes:
        nonce = os.urandom(NONCE)
        return nonce + AESGCM(self.enc).encrypt(nonce, data, aad)

    def open(self, blob: bytes, aad: bytes) -> bytes:
        if len(blob) < NONCE + 16:
            raise DecryptError("too short to hold a nonce and a tag")
        try:
            return AESGCM(self.enc).decrypt(blob[:NONCE], blob[NONCE:], aad)
        except InvalidTag:
            raise DecryptError("authentication failed") from None


def load_key(job: str | None, key_file: Path | None = None, *, required: bool = False) -> JobKey | None:
    """The job's key from the first source that has one (see the module docstring), or None (no encryption).

    ``required``: raise instead of returning None (reading an encrypted snapshot needs the key)."""
    found = find_secret(key_file, "CRYOSLEEP_KEY", "CRYOSLEEP_KEY_FILE", KEY_HINT)
    if found is not None:
        return JobKey.from_secret(*found)
    if job:
        path = paths.home() / "keys" / f"{job}.key"
        if path.is_file():
            return JobKey.from_secret(read_key_file(path, KEY_HINT), str(path))
    if required:
        raise CryosleepError(f"no key for job {job!r}", "its snapshots are encrypted", KEY_HINT)
    return None
