"""The errors a user can meet, all in one tree.

Every error says what failed, why, and what to do next, and has a JSON form for tools (``to_json``; its
``error`` field is the class's ``kind``, which ``from_json`` turns back into the class)::

    CryosleepError              what/why/hint, exit code 1
     +-- UsageError             bad input on the command line, or a malformed name or URL (exit 2)
     +-- NotFound               unknown job or snapshot
     |    +-- ObjectNotFound    a store backend has no object of that name
     +-- NotEligible            a check refused the operation before anything started
     +-- CaptureFailed          a snapshot failed; every rank was resumed
     +-- RestoreFailed          a restore failed; nothing of the job is left running
     +-- Busy                   another operation holds the job (a snapshot already in progress)
     +-- StoreCorrupt           an image failed verification
     |    +-- IntegrityError    bytes read or written do not match their checksum
     |    +-- ChunkCorrupt      a chunk's bytes do not give back its address
     |    +-- WrongKey          a chunk does not decrypt with the job's key
     |    +-- Unauthenticated   a manifest unsigned, altered, replayed or signed with another key (store/auth.py)
     +-- BackendError           a store backend failed (I/O, network, server); ``retryable`` says if it may pass
     |    +-- Conflict          a conditional write lost: the object changed since it was read (or exists)
     +-- CriuUnavailable        no usable CRIU; the hint says how to install it
     +-- IprouteUnavailable     no iproute2 (``ip``, ``bridge``) to run; the hint says how to get one
     +-- CudaError              a call of the CUDA driver's checkpoint API failed
     +-- InterceptorError       a control block is missing, malformed, or its interceptor did not answer
     +-- NetError               the job network could not be set up or changed
     +-- ProtocolError          a coordinator message was malformed or out of place
     +-- Unauthorized           a coordinator request without a credential it knows (or from a refused address)
     +-- Forbidden              a coordinator request with a credential that may not do that (another job, tenant)
     +-- TlsError               the TLS handshake with the coordinator failed (a certificate not trusted)
     +-- Unreachable            the coordinator did not answer

Exceptions that never reach a user stay private to their module (a notice endpoint's failed poll, a
decryption that becomes ``WrongKey``).
"""

from __future__ import annotations

from typing import Any

_KINDS: dict[str, type[CryosleepError]] = {}


class CryosleepError(Exception):
    """Base of every error shown to a user: ``what`` failed, ``why``, and a ``hint`` on what to do."""

    exit_code = 1
    kind = "error"

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        _KINDS[cls.kind] = cls  # so that from_json gives back the same class

    def __init__(self, what: str, why: str = "", hint: str = "", **details: Any) -> None:
        super().__init__(what)
        self.what = what
        self.why = why
        self.hint = hint
        self.details = details

    def __str__(self) -> str:
        parts = [self.what]
        if self.why:
            parts.append(f"why: {self.why}")
        if self.hint:
            parts.append(f"what to do: {self.hint}")
        return "\n  ".join(parts)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"error": self.kind, "what": self.what, "why": self.why, "hint": self.hint}
        if self.details:
            out["details"] = self.details
        return out


class UsageError(CryosleepError):
    exit_code = 2
    kind = "usage"


class NotFound(CryosleepError):
    kind = "not_found"


class NotEligible(CryosleepError):
    kind = "not_eligible"


class CaptureFailed(CryosleepError):
    kind = "capture_failed"


class RestoreFailed(CryosleepError):
    kind = "restore_failed"


class StoreCorrupt(CryosleepError):
    kind = "store_corrupt"


class Busy(CryosleepError):
    kind = "busy"


class CriuUnavailable(CryosleepError):
    kind = "criu_unavailable"


class IprouteUnavailable(CryosleepError):
    kind = "iproute_unavailable"


class CudaError(CryosleepError):
    kind = "cuda_error"


class InterceptorError(CryosleepError):
    """A control block is missing, malformed, or its interceptor did not answer."""

    kind = "interceptor_error"


class NetError(CryosleepError):
    kind = "net"


class ObjectNotFound(NotFound):
    kind = "object_not_found"


class BackendError(CryosleepError):
    kind = "backend_error"

    def __init__(self, what: str, why: str = "", hint: str = "", *, retryable: bool = False) -> None:
        super().__init__(what, why, hint)
        self.retryable = retryable


class Conflict(BackendError):
    kind = "conflict"


class IntegrityError(StoreCorrupt):
    kind = "integrity_error"


class ChunkCorrupt(StoreCorrupt):
    """A chunk's bytes do not give back its address (altered, truncated, or not a chunk)."""

    kind = "chunk_corrupt"


class WrongKey(StoreCorrupt):
    kind = "wrong_key"


class Unauthenticated(StoreCorrupt):
    """A snapshot whose manifest is unsigned, altered, signed with another key, or copied from another one."""

    kind = "unauthenticated"


class ProtocolError(CryosleepError):
    kind = "protocol"


class Unauthorized(CryosleepError):
    kind = "unauthorized"


class Forbidden(CryosleepError):
    kind = "forbidden"


class TlsError(CryosleepError):
    kind = "tls"


class Unreachable(CryosleepError):
    kind = "unreachable"


_KINDS["error"] = CryosleepError


def from_json(data: dict[str, Any]) -> CryosleepError:
    """Rebuild an error from its JSON form (as an agent sends it over its control socket)."""
    cls = _KINDS.get(str(data.get("error", "error")), CryosleepError)
    return cls(str(data.get("what", "error")), str(data.get("why", "")), str(data.get("hint", "")),
               **dict(data.get("details") or {}))
