"""Authenticated snapshots: every manifest carries an HMAC-SHA256 under a key the platform holds.

A restore runs as root and puts back what the snapshot says, so whoever can write a store must not choose what
a restoring host writes. The manifest lists every image file with its SHA-256 (and every file a restore puts
back, at which path); its MAC covers all of it, and the key id, the snapshot id and the job name with it. So one
MAC check plus the files' checksums authenticate every byte a restore uses:

- an edited manifest (a staged file's path, a file's checksum) fails the MAC;
- a swapped image file fails its checksum, which the MAC covers;
- an older manifest copied under a newer snapshot's id names the older id, which the MAC covers;
- a manifest signed with another job's key (or a tenant's) names a key id that is not this job's key.

The chunk store keeps the same manifest (its secret-named variables redacted, which the MAC leaves out, see
:meth:`Manifest.signed_json`) beside the chunk index; a chunk's address is its content's hash (keyed with an
encryption key), and the files' SHA-256 under the MAC fix which chunks form them. Rotating a key is therefore
re-signing manifests (``cryosleep resign``), never re-uploading chunks.

The signing key of a job is found, first match wins, in:

1. the key file named by the caller (``--sign-key-file``);
2. ``$CRYOSLEEP_SIGN_KEY``: the key itself, 64 hex digits or base64;
3. ``$CRYOSLEEP_SIGN_KEY_FILE``: a key file;
4. ``$CRYOSLEEP_SIGN_KEY_COMMAND``: a command (a KMS hook) run with two arguments, the job's name and the key
   id the snapshot names (empty when signing), that prints the key (the hook keeps old keys by id, so it can
   rotate without re-signing);
5. ``$CRYOSLEEP_HOME/keys/<job>.sign``: the job's own key file;
6. the job's encryption key (``--key-file``, else the one this host's record of the job names, ``$CRYOSLEEP_KEY``...:
   :mod:`cryosleep.store.crypto`), from which a signing key is derived with HKDF (its own ``info`` label);
7. ``$CRYOSLEEP_HOME/keys/host.sign``: the host's key, made (32 random bytes, owner-only) the first time this
   host signs without any of the above. Snapshots signed with it restore on this host only, until the key is
   copied (or they are re-signed under a shared key).

A key is 32 bytes (raw, hex or base64 text); key files must be owner-only. A manifest records the key's id (a
fingerprint: 16 hex digits), never the key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import posixpath
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryosleep import paths
from cryosleep.errors import CryosleepError, Unauthenticated, UsageError
from cryosleep.store.keyfile import find_secret, new_key_file, parse_key, read_key_file
from cryosleep.store.manifest import Manifest

__all__ = ["ALGORITHM", "STRICT", "SignKey", "Trust", "Unauthenticated", "authenticate", "path_problems", "sign",
           "signing_key"]

ALGORITHM = "HMAC-SHA256"
PURPOSE = "cryosleep-manifest-v1"
HOOK_TIMEOUT_S = 30.0
KEY_HINT = ("give the job's signing key with --sign-key-file FILE, $CRYOSLEEP_SIGN_KEY, $CRYOSLEEP_SIGN_KEY_FILE or "
            "$CRYOSLEEP_SIGN_KEY_COMMAND, or put it in $CRYOSLEEP_HOME/keys/<job>.sign; a job run with --key-file: "
            "give that (docs/security.md)")
UNSIGNED_HINT = ("if you trust where this snapshot came from, pass --allow-unsigned (then sign it: "
                 "`cryosleep resign SNAPSHOT --allow-unsigned`); otherwise do not restore it")
# Where no job keeps a file a restore could put back: the kernel's and the devices' (not /dev/shm).
NOT_JOB_FILES = ("/proc/", "/sys/", "/dev/")


@dataclass(frozen=True)
class SignKey:
    """A signing key; ``key_id`` (16 hex digits) names it in manifests, ``origin`` where it was found."""

    secret: bytes
    key_id: str
    origin: str

    def __repr__(self) -> str:  # never the key itself
        return f"SignKey({self.key_id}, from {self.origin})"

    @classmethod
    def from_secret(cls, secret: bytes, origin: str) -> SignKey:
        if len(secret) != 32:
            raise UsageError(f"the signing key from {origin} is {len(secret)} bytes, not 32", "", KEY_HINT)
        return cls(secret, hmac.new(secret, b"cryosleep-sign-key-id", hashlib.sha256).hexdigest()[:16], origin)

    def mac(self, message: bytes) -> str:
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Trust:
    """How a command authenticates snapshots (its ``--key-file``, ``--sign-key-file`` and ``--allow-unsigned``)."""

    key_file: Path | None = None  # the job's encryption key: the root of its signing key when it has no other
    sign_key_file: Path | None = None
    allow_unsigned: bool = False


STRICT = Trust()  # the default: keys looked up as the module docstring says, unsigned snapshots refused


def _hook(command: str, job: str, key_id: str) -> SignKey:
    origin = "$CRYOSLEEP_SIGN_KEY_COMMAND"
    try:
        res = subprocess.run([*shlex.split(command), job, key_id], capture_output=True, timeout=HOOK_TIMEOUT_S,
                             check=False)
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        raise UsageError(f"the signing key command {command!r} could not be run", str(e), KEY_HINT) from e
    if res.returncode != 0:
        err = res.stderr.decode(errors="replace").strip()[-300:]
        raise UsageError(f"the signing key command {command!r} failed for job {job!r} (exit {res.returncode})",
                         err or "it printed nothing on stderr", "fix the command, or give the key another way")
    return SignKey.from_secret(parse_key(res.stdout, origin, KEY_HINT), origin)


def signing_key(job: str, trust: Trust = STRICT, *, key_id: str = "", create: bool = False) -> SignKey | None:
    """The job's signing key from the first source that has one (see the module docstring). ``key_id``: the id
    a snapshot names (told to the KMS hook). ``create``: make the host's key when no source has one (signing);
    else None then."""
    found = find_secret(trust.sign_key_file, "CRYOSLEEP_SIGN_KEY", "CRYOSLEEP_SIGN_KEY_FILE", KEY_HINT)
    if found is not None:
        return SignKey.from_secret(*found)
    command = os.environ.get("CRYOSLEEP_SIGN_KEY_COMMAND", "").strip()
    if command:
        return _hook(command, job, key_id)
    own = paths.home() / "keys" / f"{job}.sign"
    if "/" not in job and not job.startswith(".") and own.is_file():
        return SignKey.from_secret(read_key_file(own, KEY_HINT), str(own))
    enc = _encryption_root(job, trust.key_file or _recorded_key_file(job))
    if enc is not None:
        return enc
    host = paths.home() / "keys" / "host.sign"
    if create and not host.exists():
        new_key_file(host)
    if host.exists():
        return SignKey.from_secret(read_key_file(host, KEY_HINT), str(host))
    return None


def _recorded_key_file(job: str) -> Path | None:
    """The key file this host's record of the job names (``$CRYOSLEEP_HOME/jobs/<job>/job.json``, written by its
    agent here: the job's ``--key-file``), so a local restore needs no ``--key-file`` again. Never a path a
    manifest names: a manifest is what is being checked."""
    if "/" in job or job.startswith("."):
        return None
    try:
        spec = json.loads((paths.jobs_dir() / job / "job.json").read_text())["spec"]
        key_file = spec["persist"].get("key_file")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return Path(key_file) if isinstance(key_file, str) and key_file else None


def _encryption_root(job: str, key_file: Path | None) -> SignKey | None:
    try:
        from cryosleep.store.crypto import load_key
    except ImportError:  # no cryptography here: no encryption key either
        return None
    key = load_key(job, key_file)
    if key is None:
        return None
    return SignKey.from_secret(key.sign, f"{key.origin} (the job's encryption key)")


def _message(manifest: Manifest, key_id: str) -> bytes:
    body = {"purpose": PURPOSE, "key_id": key_id, "manifest": manifest.signed_json()}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(manifest: Manifest, key: SignKey) -> None:
    """Sign ``manifest`` in place (its ``auth``) with ``key``."""
    manifest.auth = {"algorithm": ALGORITHM, "key_id": key.key_id, "mac": key.mac(_message(manifest, key.key_id))}


def authenticate(manifest: Manifest, sid: str, trust: Trust = STRICT) -> str:
    """Check that ``manifest`` is snapshot ``sid``'s, signed with its job's key, and that every path it names is
    one a restore may use; returns how it was authenticated, for messages. Unauthenticated if not: an unsigned
    manifest passes only with ``trust.allow_unsigned``, an altered or foreign one never."""
    what = f"snapshot {sid} is not authentic; nothing was restored"
    if manifest.id != sid:
        raise Unauthenticated(what, f"its manifest names snapshot {manifest.id!r}: a manifest copied from another "
                              "snapshot (a replay)", "do not restore it; restore another snapshot and remove this one")
    bad = path_problems(manifest)
    if bad:
        raise Unauthenticated(what, "its manifest names paths a restore must not use: " + "; ".join(bad[:5]),
                              "do not restore it; restore another snapshot and remove this one", problems=bad)
    auth = manifest.auth
    if auth is None:
        if trust.allow_unsigned:
            return "unsigned (accepted: --allow-unsigned)"
        raise Unauthenticated(f"snapshot {sid} is not signed; nothing was restored",
                              "its manifest has no MAC, so nothing shows it was written by this platform",
                              UNSIGNED_HINT)
    key_id, mac = auth.get("key_id"), auth.get("mac")
    if auth.get("algorithm") != ALGORITHM or not isinstance(key_id, str) or not isinstance(mac, str):
        raise Unauthenticated(what, f"its signature is not an {ALGORITHM} with a key id: {auth!r:.120}",
                              "do not restore it; restore another snapshot and remove this one")
    key = signing_key(manifest.job_name, trust, key_id=key_id)
    if key is None:
        raise Unauthenticated(f"snapshot {sid} cannot be authenticated: no signing key for job "
                              f"{manifest.job_name!r} here", f"it is signed with key {key_id}", KEY_HINT)
    if key.key_id != key_id:
        raise Unauthenticated(what, f"it is signed with key {key_id}; the key of job {manifest.job_name!r} "
                              f"(from {key.origin}) is {key.key_id}: another job's or tenant's key, or an old one",
                              "a job run with --key-file: give it; if it is an old key of this job, re-sign the "
                              "snapshot with `cryosleep resign SNAPSHOT --from-key-file OLD`; otherwise do not "
                              "restore it")
    if not hmac.compare_digest(mac, key.mac(_message(manifest, key_id))):
        raise Unauthenticated(what, f"its manifest was altered after it was signed (the {ALGORITHM} under key "
                              f"{key_id} does not match)", "do not restore it; restore another snapshot and remove "
                              "this one")
    return f"signed with key {key_id} (from {key.origin})"


def _normal(path: str) -> bool:
    """No NUL, no ``..``, ``.``, empty component or trailing slash."""
    return "\0" not in path and posixpath.normpath(path) == path and not path.startswith("//") \
        and ".." not in path.split("/")


def _job_path(path: Any) -> bool:
    """A path a restore may write: absolute, normal, not under /proc, /sys or /dev (but /dev/shm)."""
    return isinstance(path, str) and path.startswith("/") and path != "/" and _normal(path) \
        and (path.startswith("/dev/shm/") or not path.startswith(NOT_JOB_FILES))


def path_problems(manifest: Manifest) -> list[str]:
    """The paths of ``manifest`` that a restore must not use: image files outside their node's folder, files to
    put back that are not absolute and normal (no ``..``, no ``//``) or lie under /proc, /sys or /dev, copies
    that are not image files of the manifest, and what else is not sane (a negative size, an odd mode)."""
    out: list[str] = []
    for node in manifest.nodes:
        top = f"nodes/{node.node_rank}/"
        images = set()
        for f in node.files:
            if not _normal(f.path) or not f.path.startswith(top) or f.size < 0:
                out.append(f"image file {f.path!r:.120} (outside {top}, or not a normal relative path)")
            images.add(f.path)
        for s in node.staged:
            if not _job_path(s.path):
                out.append(f"file to put back {s.path!r:.120} (not an absolute normal path of the job's files)")
            if s.size < 0 or not 0 <= s.tail_len <= s.size or not 0 <= s.mode <= 0o7777:
                out.append(f"file to put back {s.path!r:.120} (size {s.size}, tail {s.tail_len}, mode {s.mode})")
            if s.staged is not None and f"{top}files/{s.staged}" not in images:
                out.append(f"copy {s.staged!r:.60} of {s.path!r:.120} (not an image file of the manifest)")
        for entry in node.gpu.fast_path.ranks.values() if node.gpu.fast_path else ():
            if not _job_path(entry.stage_path):
                out.append(f"device-memory staging file {entry.stage_path!r:.120} (not an absolute normal path)")
    return out


def resign(manifest: Manifest, sid: str, old: Trust, new: Trust) -> tuple[str, SignKey]:
    """Check ``manifest`` under ``old``, then sign it (in place) under ``new``'s key (made when none is
    configured); returns how it was authenticated before, and the new key."""
    before = authenticate(manifest, sid, old)
    key = signing_key(manifest.job_name, new, create=True)
    if key is None:  # create=True always finds or makes one
        raise CryosleepError("no signing key", "", KEY_HINT)
    sign(manifest, key)
    return before, key
