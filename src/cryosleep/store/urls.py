"""From a store URL to its backend: ``SCHEME://...`` (a backend named in ``SCHEMES``) or a directory.

A new backend is one module beside ``s3.py`` implementing :class:`cryosleep.store.backend.Backend` with a
``from_url(url)`` that opens it, and one line in ``SCHEMES`` naming it for its URL scheme. The module is imported
only when a store URL names its scheme (an S3 client loads only for an S3 store).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from cryosleep.errors import UsageError
from cryosleep.store.backend import Backend, LocalBackend

__all__ = ["SCHEMES", "is_remote", "normalize_url", "open_backend"]

# URL scheme -> the module of its backend (a ``from_url(url: str) -> Backend``). A new backend is named here.
SCHEMES = {
    "s3": "cryosleep.store.s3",
}


def normalize_url(url: str | Path) -> str:
    """A store URL as text; ``s3:/b/p`` (what argparse's Path makes of ``s3://b/p``) becomes ``s3://b/p``."""
    text = str(url)
    scheme, sep, rest = text.partition(":/")
    if sep and scheme in SCHEMES:
        return f"{scheme}://{rest.lstrip('/')}"
    return text


def is_remote(url: str | Path | None) -> bool:
    """The URL names a backend of ``SCHEMES`` (not a directory)."""
    return url is not None and normalize_url(url).partition("://")[0] in SCHEMES


def open_backend(url: str | Path) -> Backend:
    """The backend a store URL names: ``SCHEME://...`` for a backend in ``SCHEMES``, or a directory (its ``cas/``
    folder)."""
    text = normalize_url(url)
    if is_remote(text):
        backend: Backend = importlib.import_module(SCHEMES[text.partition("://")[0]]).from_url(text)
        return backend
    if "://" in text:
        raise UsageError(f"unsupported store URL {text!r}", f"the URL schemes are {', '.join(sorted(SCHEMES))}",
                         "name a directory or one of those schemes")
    return LocalBackend(Path(text) / "cas")
